"""A stack of attention and MLP sublayers, residual against mHC (n = 4) and its peers: step time and peak memory.

    python -m bench stack [--shapes 1024,2048] [--variants SUBSTRINGS] [--skip SUBSTRINGS] [--profile]
    python -m bench stack --smoke          # CPU, Triton interpreter, tiny shapes: checks the benchmark, not speed

One training step = forward + backward of mean(out^2) through the whole stack in bf16 (C = 1024: 24 sublayers, B = 8,
T = 2048; C = 2048: 16 sublayers, B = 4), 20 Sinkhorn iterations; median of --iters steps after --warmup (CUDA
events), after one untimed first step (compile, JIT), so peak memory covers the timed steps only. Every row also has
the host's time to issue a step (the device idle at its start): near the step time, the GPU waits for Python.
Variants (substrings of these names select them): residual; mHC through the project's HyperConnection chained (one
boundary op between sublayers) and one sublayer at a time, each also under torch.compile and CUDA graphs; mHC with
selective recompute, with the branch input rebuilt in the backward (rebuild_branch_input); HC; Liger-Kernel's LigerMHC,
lucidrains' hyper-connections and mHC on the reference torch ops. "mhc chained+compile" runs only when named: its
compile did not finish on an H200. Ratios are against the residual of the same process in the same mode. The copy
bandwidth and bf16 GEMM rate of the device, measured first, go to env (copy_tb_s, bf16_mm_tflops). --profile: per
eager mHC variant, device time per kernel over one step, and each fused kernel against its bytes (% of copy).
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Optional

import torch

from bench import harness, kernel_bytes
from bench import stack_models as M
from bench.profiling import print_rows, time_per_name

# (C, heads, blocks, B, T) per shape name; --smoke keeps the names at tiny sizes
SHAPES = {"1024": (1024, 16, 12, 8, 2048), "2048": (2048, 16, 8, 4, 2048)}
SMOKE_SHAPES = {"1024": (64, 4, 1, 2, 16), "2048": (96, 4, 1, 1, 24)}
OPT_IN = ("mhc chained+compile",)  # only when --variants names them
COLUMNS = [
    ("C", "C", ""),
    ("variant", "variant", ""),
    ("ms", "ms/step", ".1f"),
    ("host_ms", "host ms", ".1f"),
    ("x_residual", "x resid", ".3f"),
    ("x_residual_compiled", "x res.comp", ".3f"),
    ("x_residual_cudagraph", "x res.graph", ".3f"),
    ("peak_gib", "peak GiB", ".2f"),
    ("x_residual_peak", "x peak", ".2f"),
    ("note", "error / skipped", ""),
]
KERNEL_COLUMNS = [
    ("kernel", "kernel", ""),
    ("mb_per_call", "MB/call", ".0f"),
    ("floor_us", "floor us", ".1f"),
    ("us", "us", ".1f"),
    ("pct_copy", "% copy", ".0f"),
    ("ms_per_step", "ms/step", ".2f"),
]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def ceilings(device: str) -> tuple[Optional[float], Optional[float]]:
    """The device's copy bandwidth (TB/s, read + write) and bf16 8192^3 GEMM rate (TFLOP/s); None on the CPU."""
    if device != "cuda":
        return None, None
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = harness.median_ms(lambda: b.copy_(a), 20, 3, device)
    bw = 2 * 2**30 / (ms * 1e-3) / 1e12
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    k = torch.randn_like(m)
    ms = harness.median_ms(lambda: m @ k, 10, 3, device)
    return bw, 2 * 8192**3 / (ms * 1e-3) / 1e12


def variants(c, heads, blocks, x, opts) -> list[tuple[str, callable]]:
    """(name, factory) in order of importance: the time budget cuts from the end."""
    from mhc_lightning.model.recompute import optimal_block

    dev, dt = opts["device"], opts["dtype"]
    block = optimal_block(2 * blocks, M.N_STREAMS)

    def hyper(backend="triton", **kw):
        model = M.Hyper(c, heads, blocks, backend, sinkhorn_iters=opts["iters"], **kw).to(dev, dt)
        for layer in model.layers:  # phi as --phi-dtype says (fp32: as the trainer holds it under bf16-mixed)
            if getattr(layer, "phi", None) is not None:
                layer.phi.data = layer.phi.data.to(opts["phi_dtype"])
        return model

    def residual():
        return M.Residual(c, heads, blocks).to(dev, dt)

    def graphed(model):  # forward and backward each replayed as one CUDA graph: the step no longer waits on the host
        return torch.cuda.make_graphed_callables(model, (x,), num_warmup_iters=3)

    return [
        ("residual", residual),
        ("mhc chained", lambda: hyper()),
        ("mhc per-sublayer", lambda: hyper(chained=False)),
        ("residual+compile", lambda: torch.compile(residual())),
        ("mhc per-sublayer+compile", lambda: torch.compile(hyper(chained=False))),
        ("residual+cudagraph", lambda: graphed(residual())),
        ("mhc chained+cudagraph", lambda: graphed(hyper())),
        ("mhc per-sublayer+cudagraph", lambda: graphed(hyper(chained=False))),
        ("mhc rebuilt u", lambda: hyper(rebuild=True)),
        ("hc", lambda: hyper(chained=False, mode="hc")),
        (f"mhc recompute L_r={block}+compile", lambda: torch.compile(hyper(recompute=block))),
        (f"mhc recompute L_r={block}", lambda: hyper(recompute=block)),
        ("liger", lambda: M.Liger(c, heads, blocks).to(dev, dt)),
        ("reference ops", lambda: hyper("torch")),
        ("lucidrains", lambda: M.Lucid(c, heads, blocks).to(dev, dt)),
        ("mhc chained+compile", lambda: torch.compile(hyper())),
    ]


def selected(names: list[str], keep, drop, smoke: bool) -> list[str]:
    """The variants to run: --variants (opt-in ones only when named), minus --skip; residual always. A token picks the
    variant of exactly that name ("hc"), else every variant whose name contains it ("cudagraph")."""

    def picks(name, tokens):
        return any(t == name or (t not in names and t in name) for t in tokens)

    out = []
    for name in names:
        chosen = picks(name, keep) if keep is not None else name not in OPT_IN
        if drop and picks(name, drop) or smoke and any(k in name for k in ("compile", "cudagraph", "liger", "lucid")):
            chosen = False
        if chosen or name == "residual":
            out.append(name)
    return out


def profile_step(step, shape_row: dict, copy_tbps: float, iters: int, device: str) -> dict:
    """Device time per kernel over one step (mean of 3), and each fused mHC kernel against its bytes."""
    from torch.profiler import ProfilerActivity, profile

    harness.sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        harness.sync(device)
    busy, rows = time_per_name(prof, 3)
    print_rows(rows, busy, top=15)
    tokens = shape_row["B"] * shape_row["T"]
    fused = kernel_bytes.efficiency(rows, tokens, shape_row["C"], M.N_STREAMS, iters, copy_tbps)
    if fused:
        harness.print_table(fused + [kernel_bytes.total(fused)], KERNEL_COLUMNS)
    return dict(busy_us_per_step=busy, top=rows[:40], kernels=fused)


def run_variant(name, make, x, shape_row, args, t0, copy_tbps) -> dict:
    row = dict(shape_row, variant=name)
    if time.time() - t0 > args.budget_s:
        return dict(row, skipped="time budget")
    if name == "liger":
        row["version"] = _version("liger-kernel")
    elif name == "lucidrains":
        row["version"] = _version("hyper-connections")
    torch.manual_seed(0)
    t = time.time()
    try:
        with torch.device(args.device):  # parameters made on the device: seconds of CPU init per variant otherwise
            model = make()
        params = list(model.parameters())

        def step():
            for q in params:
                q.grad = None
            model(x).float().square().mean().backward()

        step()  # compile, JIT: outside the timing and the peak
        if args.device == "cuda":
            harness.sync(args.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row["ms"] = harness.median_ms(step, args.iters, args.warmup, args.device)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
        row["host_ms"] = harness.host_ms(step, 1 if args.smoke else 5, args.device)
        row["wall_s"] = time.time() - t
        if args.profile and args.device == "cuda" and name.startswith("mhc") and "+" not in name:
            row["profile"] = profile_step(step, shape_row, copy_tbps, args.sinkhorn_iters, args.device)
    except Exception as exc:  # a missing peer or a failed compile is reported, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def add_ratios(rows: list[dict]) -> None:
    """x_residual (eager), x_residual_compiled, x_residual_cudagraph and x_residual_peak, per shape."""
    for c in {r["C"] for r in rows}:
        base = {r["variant"]: r for r in rows if r["C"] == c and r.get("ms")}
        for r in rows:
            if r["C"] != c or not r.get("ms"):
                continue
            for key, ref in (
                ("x_residual", "residual"),
                ("x_residual_compiled", "residual+compile"),
                ("x_residual_cudagraph", "residual+cudagraph"),
            ):
                if ref in base:
                    r[key] = r["ms"] / base[ref]["ms"]
            if "residual" in base and r.get("peak_gib") and base["residual"].get("peak_gib"):
                r["x_residual_peak"] = r["peak_gib"] / base["residual"]["peak_gib"]


def main(argv=None) -> int:
    p = harness.parser("stack", __doc__)
    p.add_argument("--shapes", default="1024,2048", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated names or substrings of names: only these variants (and the residual)",
    )
    p.add_argument("--skip", default=None, help="comma-separated names or substrings of names: leave these out")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining variants past this wall time")
    p.add_argument(
        "--phi-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="phi's dtype (the rest is bf16): fp32 is what the trainer holds under bf16-mixed",
    )
    p.add_argument("--profile", action="store_true", help="GPU: device time per kernel of each eager mHC variant")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, 4 Sinkhorn iterations")
    args = p.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    unknown = [s for s in args.shapes.split(",") if s not in shapes]
    if unknown:
        p.error(f"--shapes: {', '.join(unknown)}; allowed: {', '.join(shapes)}")
    args.device = "cpu" if args.smoke else harness.default_device()
    if args.device != "cuda" and not args.smoke:
        p.error("needs a CUDA device (--smoke runs the tiny shapes on the CPU)")
    # the interpreter's backward time grows ~ iters^2: --smoke takes 4, as the tests do
    args.sinkhorn_iters = 4 if args.smoke else 20
    dtype = torch.float32 if args.smoke else torch.bfloat16
    opts = dict(
        device=args.device,
        dtype=dtype,
        iters=args.sinkhorn_iters,
        phi_dtype=torch.float32 if args.phi_dtype == "fp32" or args.smoke else torch.bfloat16,
    )
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report = harness.Report("stack", args, argv or [], args.device)
    copy_tbps, mm = ceilings(args.device)
    report.env.update(copy_tb_s=copy_tbps, bf16_mm_tflops=mm)
    keep = [k.strip() for k in args.variants.split(",")] if args.variants else None
    drop = [k.strip() for k in args.skip.split(",")] if args.skip else None
    t0 = time.time()
    for key in args.shapes.split(","):
        c, heads, blocks, b, t = shapes[key]
        print(f"== C={c} sublayers={2 * blocks} B={b} T={t}", flush=True)
        x = torch.randn(b, t, c, device=args.device, dtype=dtype)
        shape_row = dict(C=c, sublayers=2 * blocks, B=b, T=t, n=M.N_STREAMS)
        table = dict(variants(c, heads, blocks, x, opts))
        for name in selected(list(table), keep, drop, args.smoke):
            row = report.add(run_variant(name, table[name], x, shape_row, args, t0, copy_tbps))
            print(
                "  "
                + ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in row.items()
                    if k not in ("profile",) + tuple(shape_row)
                ),
                flush=True,
            )
            if args.device == "cuda":
                torch.cuda.empty_cache()
    add_ratios(report.rows)
    ceiling = f"  copy {copy_tbps:.2f} TB/s  bf16 mm {mm:.0f} TFLOP/s" if copy_tbps else ""
    print(f"\n{report.env.get('gpu') or 'cpu'}  torch {report.env['torch']}  triton {report.env['triton']}{ceiling}")
    harness.print_table([dict(r, note=r.get("error") or r.get("skipped")) for r in report.rows], COLUMNS)
    print("wrote", report.save())
    return 0 if all("ms" in r or r.get("skipped") for r in report.rows) else 1
