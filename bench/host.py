"""Host time of the eager mHC and HC sublayer, of each fused op and of the GPT's forward (launches stubbed on the CPU).

    python -m bench host [--sublayers 24] [--steps 30] [--c 1024] [--bf16] [--forward]
    python -m bench host --ops [--c 1024] [--bf16]
    python -m bench host --model [--compile] [--chain] [--top 25] [--threads 1]

An eager training step issues its kernel launches from Python; where the host needs longer per sublayer than the GPU,
the GPU waits. Without a GPU this measures that host cost on any machine: the fused ops take their kernel path on
CPU tensors under the Triton interpreter with every kernel launch replaced by a no-op, so what is timed is the Python
wrappers, autograd, allocations and the launch arithmetic. On a GPU the launches are real, on tiny tensors (a few
microseconds of device work per kernel), so a step's wall time is still the host's.
Sublayer wirings (branches are identities, so the ops are all that runs; forward + backward, or --forward alone; the
wirings alternate step by step): mHC chained (one boundary op per sublayer), mHC one sublayer at a time (its enter op
and write-back), HC (its enter op and write-back).
--ops: each fused op those wirings call, forward and backward ops alike, on the arguments of its first call, without
grad, three ways: as a compiled graph calls it (the dispatcher, then the body: kernels/fused/custom_ops.py), through
torch.library's own custom-op path (its autograd and backend wrappers), and its body alone. us per call, the best of
rounds of 20 calls.
--model: the GPT's forward under bf16 autocast, residual against mHC (the trainer's shape on a GPU: C = 1024, 12
blocks, B = 8, T = 2048; tiny on the CPU), the device idle at each forward's start, then mHC's extra host time by
function (cProfile, own time). --compile: both models compiled, as `model.compile: true` runs them (the fused ops are
then the custom ops a compiled graph calls), and mHC timed a second time with every op call through torch.library's
own path; --chain: mHC chained under compile too (which `model.compile` refuses). Each forward's wall time and the
host thread's CPU time (steadier on a shared machine); on the CPU the models' own kernels run on --threads threads
(default 1: more spin in OpenMP barriers when other processes hold the cores).
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
    ("forward_cpu_ms", "thread CPU ms", ".2f"),
    ("x_residual", "x residual", ".2f"),
    ("first_call_s", "first call s", ".1f"),
]
OP_COLUMNS = [
    ("op", "op", ""),
    ("dispatched_us", "as compiled graphs call it, us", ".1f"),
    ("custom_op_us", "torch.library path, us", ".1f"),
    ("body_us", "body, us", ".1f"),
]
LIBRARY_PATH = "mhc, torch.library path"


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


def wirings(args, device: str) -> tuple[dict, torch.Tensor, list]:
    """The sublayer stacks as functions of the stream x (WIRINGS), that x, and their parameters."""
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

    return dict(zip(WIRINGS, (mhc(True), mhc(False), lambda x: run_sublayers(hc_layers, x, 0)))), x, params


def sublayer_rows(args, device: str) -> list[dict]:
    runs, x, params = wirings(args, device)
    with launches(device):
        ms = paired_ms(runs, x, params, args.steps, args.forward, device)
    return [
        dict(
            wiring=name,
            step_ms=v,
            per_sublayer_us=1e3 * v / args.sublayers,
            forward_only=args.forward,
            sublayers=args.sublayers,
            C=args.c,
            stream_dtype=str(x.dtype).removeprefix("torch."),
        )
        for name, v in ms.items()
    ]


def first_calls(runs: dict, x, params) -> dict:
    """name -> (op, args) of each fused custom op's first call in one forward + backward of every wiring: the eager
    path calls each op's body (`op.plain`) with the arguments a compiled graph hands the op. The routed enter ops
    (what compiled graphs call) take their plain op's arguments; HC's enter op runs unfolded (its operands by torch),
    as compiled."""
    from mhc_lightning.kernels import fused
    from mhc_lightning.kernels.fused import custom_ops

    first: dict = {}
    bodies = {name: op.plain for name, op in custom_ops.OPS.items()}

    def spy(name):
        def recorded(*a, **kw):
            first.setdefault(name, (a, kw))
            return bodies[name](*a, **kw)

        return recorded

    folds = fused._folds_hc_operands
    for name, op in custom_ops.OPS.items():
        op.plain = spy(name)
    fused._folds_hc_operands = lambda *a: False
    try:
        for run in runs.values():
            for q in params:
                q.grad = None
            run(x).float().sum().backward()
    finally:
        fused._folds_hc_operands = folds
        for name, op in custom_ops.OPS.items():
            op.plain = bodies[name]
    for plain, routed in (("mhc_pre", "mhc_enter"), ("hc_enter", "hc_enter_routed")):
        if plain in first:
            first.setdefault(routed, first[plain])
    return {name: (custom_ops.OPS[name], *first[name]) for name in sorted(first)}


def op_rows(args, device: str) -> list[dict]:
    from mhc_lightning.kernels.fused import custom_ops

    runs, x, params = wirings(args, device)
    rows = []
    with launches(device):
        calls = first_calls(runs, x, params)
        with torch.no_grad():
            for name, (op, a, kw) in calls.items():
                overload = op._opoverload  # what a compiled graph calls: torch.ops.mhc_lightning.<name>.default

                def library(a=a, kw=kw, overload=overload):
                    custom_ops.DIRECT = False
                    try:
                        overload(*a, **kw)
                    finally:
                        custom_ops.DIRECT = True

                ways = {
                    "dispatched": lambda a=a, kw=kw, overload=overload: overload(*a, **kw),
                    "custom_op": library,
                    "body": lambda a=a, kw=kw, op=op: op.plain(*a, **kw),
                }
                best = {}
                for i in range(3 + args.steps):  # alternating; the best of the rounds after 3 warm-up rounds
                    for how, call in ways.items():
                        harness.sync(device)
                        t = time.perf_counter()
                        for _ in range(20):
                            call()
                        harness.sync(device)
                        us = 1e6 * (time.perf_counter() - t) / 20
                        if i >= 3:
                            best[how] = min(best.get(how, us), us)
                rows.append(
                    dict(
                        op=name,
                        **{f"{how}_us": v for how, v in best.items()},
                        C=args.c,
                        stream_dtype=str(x.dtype).removeprefix("torch."),
                    )
                )
    return rows


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
    from mhc_lightning.kernels.fused import custom_ops
    from mhc_lightning.model import GPT, GPTConfig, HyperConfig
    from mhc_lightning.model.gpt import compile_model

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
    # (model, whether its op calls go straight to the bodies); compiled, mHC also through torch.library's path
    runs = {mode: (model, True) for mode, model in models.items()}
    if args.compile:
        runs[LIBRARY_PATH] = (models["mhc"], False)

    def forward(model, direct: bool = True) -> tuple[float, float]:
        """(wall ms, this thread's CPU ms) of one forward."""
        harness.sync(device)
        custom_ops.DIRECT = direct
        try:
            t, cpu = time.perf_counter(), time.thread_time()
            with torch.autocast(device, dtype=torch.bfloat16):
                model(idx)
            return 1e3 * (time.perf_counter() - t), 1e3 * (time.thread_time() - cpu)
        finally:
            custom_ops.DIRECT = True

    with launches(device):
        first = {m: forward(*run)[0] for m, run in runs.items()}
        times = {m: [] for m in runs}
        for i in range(args.steps + 2):
            for mode, run in runs.items():
                ms = forward(*run)
                if i >= 2:
                    times[mode].append(ms)
        own = {mode: own_ms(model, lambda m: forward(m)[0], args.steps) for mode, model in models.items()}
    extra = sorted(own["mhc"].items(), key=lambda kv: kv[1] - own["residual"].get(kv[0], 0.0), reverse=True)
    shape = dict(C=c, blocks=blocks, heads=heads, batch=batch, seq=seq, compiled=args.compile, chained=args.chain)
    rows = [
        dict(
            shape,
            mode=m,
            forward_ms=statistics.median(t[0] for t in v),
            forward_cpu_ms=statistics.median(t[1] for t in v),
            first_call_s=first[m] / 1e3,
        )
        for m, v in times.items()
    ]
    for row in rows:
        row["x_residual"] = row["forward_ms"] / rows[0]["forward_ms"]
        row["cpu_x_residual"] = row["forward_cpu_ms"] / rows[0]["forward_cpu_ms"]
    rows[1]["extra_functions"] = [
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
    p.add_argument("--threads", type=int, default=1, help="--model on the CPU: threads of the models' own kernels")
    p.add_argument("--ops", action="store_true", help="each fused op: as compiled graphs call it, against its body")
    args = p.parse_args(argv)
    if (args.compile or args.chain) and not args.model:
        p.error("--compile and --chain time the GPT's forward: add --model")
    if args.ops and args.model:
        p.error("--ops times the fused ops one by one: leave out --model")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
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
        # stubbed kernels leave memory unwritten: no denormal slow paths on the CPU. Both settings are the process's:
        # restored, so that a caller's later float math (tests in the same process) keeps its denormals and threads.
        threads = torch.get_num_threads()
        torch.set_flush_denormal(True)
        if device == "cpu":
            torch.set_num_threads(args.threads)
        try:
            rows = model_rows(args, device)
        finally:
            torch.set_flush_denormal(False)
            torch.set_num_threads(threads)
        report.env["threads"] = args.threads if device == "cpu" else threads
    else:
        rows = op_rows(args, device) if args.ops else sublayer_rows(args, device)
    for row in rows:
        report.rows.append(row)
    harness.print_table(rows, MODEL_COLUMNS if args.model else OP_COLUMNS if args.ops else COLUMNS)
    if args.model:
        print("mHC's extra host time by function (own ms per forward under cProfile, mHC / residual):")
        for r in rows[1]["extra_functions"]:
            print(f"  {r['function']:<60} {r['mhc_ms']:7.2f} / {r['residual_ms']:7.2f}")
    print("wrote", report.save())
    return 0
