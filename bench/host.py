"""Host time of the eager mHC and HC sublayer, and of the whole GPT's forward (Triton launches stubbed on the CPU).

    python -m bench host [--sublayers 24] [--steps 30] [--c 1024] [--bf16] [--forward]
    python -m bench host --model [--compile] [--chain] [--top 25]

An eager training step issues its kernel launches from Python; where the host needs longer per sublayer than the GPU,
the GPU waits. Without a GPU this measures that host cost on any machine: the fused ops take their kernel path on
CPU tensors under the Triton interpreter with every kernel launch replaced by a no-op, so what is timed is the Python
wrappers, autograd, allocations and the launch arithmetic. On a GPU the launches are real, on tiny tensors (a few
microseconds of device work per kernel), so a step's wall time is still the host's.
Sublayer wirings (branches are identities, so the ops are all that runs; forward + backward, or --forward alone; the
wirings alternate step by step): mHC chained (one boundary op per sublayer), mHC one sublayer at a time (its enter op
and write-back), HC (its enter op and write-back).
--model: the GPT's forward under bf16 autocast, residual against mHC (the trainer's shape on a GPU: C = 1024, 12
blocks, B = 8, T = 2048; tiny on the CPU), the device idle at each forward's start, then mHC's extra host time by
function (cProfile, own time). --compile: both models compiled, as `model.compile: true` runs them (the fused ops are
then the custom ops a compiled graph calls); --chain: mHC chained under compile too (which `model.compile` refuses).
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import statistics
import time

import torch
import torch.nn as nn

from bench import harness

WIRINGS = ("mhc chained", "mhc per-sublayer", "hc")
COLUMNS = [("wiring", "wiring", ""), ("step_ms", "ms per step", ".2f"), ("per_sublayer_us", "us per sublayer", ".0f")]
MODEL_COLUMNS = [
    ("mode", "mode", ""),
    ("forward_ms", "forward host ms", ".2f"),
    ("first_call_s", "first call s", ".1f"),
]


@contextlib.contextmanager
def launches(device: str):
    """On the CPU every launch of an interpreted Triton kernel (Triton's own interpreter class) returns at once."""
    if device == "cuda":
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = run


def paired_ms(runs: dict, x, params, steps: int, forward_only: bool, device: str) -> dict:
    """Median ms of forward + backward (or the forward alone) per wiring, the wirings alternating step by step (a
    shared host's load then weighs on all of them alike)."""
    times = {name: [] for name in runs}
    for i in range(steps + 3):
        for name, run in runs.items():
            for q in params:
                q.grad = None
            t = time.perf_counter()
            out = run(x)
            if not forward_only:
                out.float().sum().backward()
            harness.sync(device)
            if i >= 3:
                times[name].append(1e3 * (time.perf_counter() - t))
    return {name: statistics.median(ts) for name, ts in times.items()}


def sublayer_rows(args, device: str) -> list[dict]:
    from mhc_lightning.model import HyperConfig, HyperConnection
    from mhc_lightning.model.recompute import run_sublayers

    c, n = args.c, 4
    cfg = HyperConfig(residual_mode="mhc", n_streams=n, kernel_backend="triton", phi_init="normal", bias_init="a6")
    layers = nn.ModuleList(HyperConnection(nn.Identity(), c, i, cfg) for i in range(args.sublayers)).to(device)
    hc_cfg = HyperConfig(residual_mode="hc", n_streams=n, kernel_backend="triton", bias_init="hc_identity")
    hc_layers = nn.ModuleList(HyperConnection(nn.Identity(), c, i, hc_cfg) for i in range(args.sublayers)).to(device)
    params = list(layers.parameters()) + list(hc_layers.parameters())
    dtype = torch.bfloat16 if device == "cuda" or args.bf16 else torch.float32  # bf16: the trainer's stream
    x = torch.randn(2, 16, n, c, device=device, dtype=dtype, requires_grad=True)

    def mhc(chain: bool):
        def run(x):
            cfg.chain_sublayers = chain  # the mHC layers share cfg: run_sublayers chains only when it says so
            return run_sublayers(layers, x, 0)

        return run

    runs = dict(zip(WIRINGS, (mhc(True), mhc(False), lambda x: run_sublayers(hc_layers, x, 0))))
    with launches(device):
        ms = paired_ms(runs, x, params, args.steps, args.forward, device)
    return [
        dict(
            wiring=name,
            step_ms=v,
            per_sublayer_us=1e3 * v / args.sublayers,
            forward_only=args.forward,
            sublayers=args.sublayers,
            C=c,
            stream_dtype=str(dtype).removeprefix("torch."),
        )
        for name, v in ms.items()
    ]


def own_ms(model, forward, steps: int) -> dict:
    """Own host ms per forward of each function, under cProfile: "file:function" -> ms."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        forward(model)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    return {f"{os.path.basename(k[0])}:{k[2]}": 1e3 * v[2] / steps for k, v in stats.items()}


def model_rows(args, device: str) -> list[dict]:
    from mhc_lightning.model import GPT, GPTConfig, HyperConfig
    from mhc_lightning.model.compiled import compile_model

    real = device == "cuda"
    c, blocks, heads, batch, seq = (1024, 12, 16, 8, 2048) if real else (args.c, max(1, args.sublayers // 2), 2, 1, 16)
    models = {}
    for mode in ("residual", "mhc"):
        chain = True if args.chain and mode == "mhc" else "auto"
        hyper = HyperConfig(
            residual_mode=mode,
            n_streams=4,
            kernel_backend="triton",
            bias_init="home" if mode == "mhc" else "a6",
            chain_sublayers=chain,
        )
        models[mode] = GPT(GPTConfig(n_layers=blocks, d_model=c, n_heads=heads, context=seq, hyper=hyper)).to(device)
        if args.compile:  # the first call (untimed) traces and compiles
            models[mode] = compile_model(models[mode], fullgraph=True)
    idx = torch.randint(0, 256, (batch, seq), device=device)

    def forward(model) -> float:
        harness.sync(device)
        t = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            model(idx)
        return 1e3 * (time.perf_counter() - t)

    with launches(device):
        first = {m: forward(model) for m, model in models.items()}
        times = {m: [] for m in models}
        for i in range(args.steps + 2):
            for mode, model in models.items():
                ms = forward(model)
                if i >= 2:
                    times[mode].append(ms)
        own = {mode: own_ms(model, forward, args.steps) for mode, model in models.items()}
    extra = sorted(own["mhc"].items(), key=lambda kv: kv[1] - own["residual"].get(kv[0], 0.0), reverse=True)
    shape = dict(C=c, blocks=blocks, heads=heads, batch=batch, seq=seq, compiled=args.compile, chained=args.chain)
    rows = [dict(shape, mode=m, forward_ms=statistics.median(v), first_call_s=first[m] / 1e3) for m, v in times.items()]
    rows[-1]["extra_functions"] = [
        dict(function=k, mhc_ms=v, residual_ms=own["residual"].get(k, 0.0)) for k, v in extra[: args.top]
    ]
    return rows


def main(argv=None) -> int:
    p = harness.parser("host", __doc__)
    p.add_argument("--sublayers", type=int, default=24)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--c", type=int, default=64, help="channels (1024 takes the trainer's launch configurations)")
    p.add_argument("--bf16", action="store_true", help="bf16 streams, as the trainer's (always on a GPU)")
    p.add_argument("--forward", action="store_true", help="the forward alone (no backward)")
    p.add_argument("--model", action="store_true", help="the whole GPT's forward, residual against mHC")
    p.add_argument("--compile", action="store_true", help="--model: both models under torch.compile (fullgraph)")
    p.add_argument("--chain", action="store_true", help="--model: mHC chained (chain_sublayers true), also compiled")
    p.add_argument("--top", type=int, default=25, help="--model: functions listed by mHC's extra own time")
    args = p.parse_args(argv)
    if (args.compile or args.chain) and not args.model:
        p.error("--compile and --chain time the GPT's forward: add --model")
    device = harness.default_device()
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error(
            "without a GPU the fused ops run under the Triton interpreter: start with TRITON_INTERPRET=1 "
            "(python -m bench sets it)"
        )
    torch.manual_seed(0)
    report = harness.Report("host", args, argv or [], device)
    report.env["launches"] = "real" if device == "cuda" else "stubbed"
    if args.model:
        # stubbed kernels leave memory unwritten: no denormal slow paths on the CPU. The setting is the process's:
        # turned off again, so that a caller's later float math (tests in the same process) keeps its denormals.
        torch.set_flush_denormal(True)
        try:
            rows = model_rows(args, device)
        finally:
            torch.set_flush_denormal(False)
    else:
        rows = sublayer_rows(args, device)
    for row in rows:
        report.rows.append(row)
    harness.print_table(rows, MODEL_COLUMNS if args.model else COLUMNS)
    if args.model:
        print("mHC's extra host time by function (own ms per forward under cProfile, mHC / residual):")
        for r in rows[-1]["extra_functions"]:
            print(f"  {r['function']:<60} {r['mhc_ms']:7.2f} / {r['residual_ms']:7.2f}")
    print("wrote", report.save())
    return 0
