"""Host time per sublayer of the fused mHC ops in an eager step, with every Triton launch stubbed out.

    python bench/bench_host.py [--sublayers 24] [--steps 30] [--out bench_host.json]
    python bench/bench_host.py --real [...]     # on a GPU: the real launches, timed apart (where the host time goes)
    python bench/bench_host.py --forward [...]  # the forward alone (the trainer's eager forward is where the host
                                                # can fall behind the GPU: docs/benchmarks.md, round 15)
    python bench/bench_host.py --model [--real] [--compile] [--chain]
                                                # the whole GPT's forward under bf16 autocast, residual against mHC,
                                                # and where mHC's extra host time goes (cProfile, own time);
                                                # --compile: both compiled (the fused ops then run as custom ops)
    python bench/bench_host.py --dispatch [--real] # each fused op of a sublayer called as its registered custom op
                                                # (what a torch.compile graph calls) against its body alone

An eager training step issues its kernel launches from Python; when the host needs longer per sublayer than the
GPU, the GPU waits (docs/benchmarks.md, "Eager host overhead"). This measures that host cost on any machine: the
fused ops run under the Triton interpreter's dispatch path with each kernel launch replaced by a no-op, on
tiny tensors, so what is timed is the Python wrappers, the autograd Functions, allocations and the launch
arithmetic, forward + backward. Wirings: the chain (one boundary op per sublayer) and one sublayer at a time
(fused pre op + write-back) for mHC, and HC's sublayer (`hc_enter` + write-back, its operands made inside the op; as
A/Bs, the operands by torch ops outside it, round 7's three ops, and `hc_enter` with its operands built outside the
step).
Branches are identities, so the ops are all that runs.
--real (CUDA): nothing stubbed, the same tiny tensors on the GPU (its work is a few microseconds per kernel, so a step's
wall time is the host's), each Triton launch timed on its own: the step's host time and the part spent in launches.
"""
import argparse
import json
import os
import statistics
import sys
import time

REAL = "--real" in sys.argv  # read before torch is imported: the interpreter must be off for real launches
if not REAL:
    os.environ["TRITON_INTERPRET"] = "1"  # the fused wrappers take their kernel path on CPU tensors

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import triton  # noqa: E402

from mhc_lightning.kernels import fused  # noqa: E402
from mhc_lightning.kernels.fused import ops  # noqa: E402
from mhc_lightning.kernels.fused.launch_cache import Launcher  # noqa: E402
from mhc_lightning.model import HyperConfig, HyperConnection  # noqa: E402
from mhc_lightning.model.recompute import run_sublayers  # noqa: E402


class _NoLaunch:
    """Stands in for a kernel's `kernel[grid](...)` launch."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _TimedLaunch:
    """A kernel's launch as the ops module calls it, with the host time of each launch added to `spent`."""

    def __init__(self, fn: Launcher, spent: dict, name: str):
        self.fn, self.spent, self.name = fn, spent, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            t = time.perf_counter()
            self.fn[grid](*args, **kwargs)
            sec, calls = self.spent.get(self.name, (0.0, 0))
            self.spent[self.name] = (sec + time.perf_counter() - t, calls + 1)
        return launch


def kernel_names() -> list[str]:
    """Every Triton kernel the ops module launches (kernels/fused/*.py, as ops wraps them)."""
    return sorted(k for k, v in vars(ops).items() if isinstance(v, Launcher))


def replace_launches(wrap) -> list[str]:
    """Replace every fused kernel, as the ops module calls it, by wrap(kernel, name) (the kernel modules keep theirs):
    a no-op launcher (stubbed) or a timed one (--real)."""
    names = kernel_names()
    for k in names:
        setattr(ops, k, wrap(getattr(ops, k), k))
    return names


def paired_step_ms(runs: dict, x, params, steps, forward_only: bool = False) -> dict:
    """Median ms of forward + backward (or the forward alone) per wiring, the wirings alternating step by step (a
    shared host's load then weighs on all of them alike)."""
    times = {name: [] for name in runs}
    launch = {name: [] for name in runs}
    per_kernel = {name: {} for name in runs}  # kernel -> [host seconds, launches] over the timed steps
    for i in range(steps + 3):
        for name, run in runs.items():
            for p in params:
                p.grad = None
            SPENT.clear()
            t = time.perf_counter()
            out = run(x)
            if not forward_only:
                out.sum().backward()
            if REAL:
                torch.cuda.synchronize()
            if i >= 3:
                times[name].append(1e3 * (time.perf_counter() - t))
                launch[name].append(1e3 * sum(sec for sec, _ in SPENT.values()))
                for k, (sec, calls) in SPENT.items():
                    acc = per_kernel[name].setdefault(k, [0.0, 0])
                    acc[0], acc[1] = acc[0] + sec, acc[1] + calls
    return {name: (statistics.median(ts), statistics.median(launch[name]) if REAL else 0.0,
                   {k: round(1e6 * sec / calls, 1) for k, (sec, calls) in per_kernel[name].items()})
            for name, ts in times.items()}


def under_config(run, name: str, key: str, value):
    """The wiring `run` with ops.CONFIG[name][key] set to value while it runs (an A/B row beside the default)."""
    def wired(x):
        cfg = ops.CONFIG[name]
        old, cfg[key] = cfg[key], value
        try:
            return run(x)
        finally:
            cfg[key] = old
    return wired


SPENT: dict = {}  # kernel -> (host seconds in its launches, launches), this step (--real)


def model_forward(args) -> dict:
    """--model: host ms of the whole GPT's forward (autograd recording, bf16 autocast, the trainer's model at --real:
    C = 1024, 12 blocks, 16 heads, B = 8, T = 2048; tiny on the CPU, --sublayers / 2 blocks), residual and mHC
    alternating, the device idle at each forward's start (synchronised before, not inside). Then one cProfile'd
    forward batch per mode: own time per function, and mHC's top functions beside the residual's time in the same
    function. --compile: both models compiled (`model/compiled.py`), so the fused ops run as the custom ops a compiled
    graph calls; --chain: mHC's sublayers chained under compile too (which `model.compile` refuses: round 4)."""
    import cProfile
    import pstats

    from mhc_lightning.model.compiled import compile_model
    from mhc_lightning.model.config import GPTConfig
    from mhc_lightning.model.gpt import GPT

    dev = "cuda" if REAL else "cpu"
    torch.set_flush_denormal(True)  # stubbed kernels leave memory unwritten: no denormal slow paths on the CPU
    c, layers, heads, batch, seq = (1024, 12, 16, 8, 2048) if REAL else (args.c, max(1, args.sublayers // 2), 2, 1, 16)
    models = {}
    for mode in ("residual", "mhc"):
        hyper = HyperConfig(residual_mode=mode, n_streams=4, kernel_backend="triton", bias_init="home"
                            if mode == "mhc" else "a6", chain_sublayers=True if args.chain and mode == "mhc" else "auto")
        models[mode] = GPT(GPTConfig(n_layers=layers, d_model=c, n_heads=heads, context=seq, hyper=hyper)).to(dev)
        if args.compile:  # as `model.compile: true` compiles it; the first calls (untimed) trace and compile
            models[mode] = compile_model(models[mode], fullgraph=True)
    idx = torch.randint(0, 256, (batch, seq), device=dev)

    def forward(model) -> float:
        if REAL:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = model(idx)
        ms = 1e3 * (time.perf_counter() - t)
        del out
        return ms

    times = {m: [] for m in models}
    first = {m: forward(model) for m, model in models.items()}  # compiled: the trace and compile
    for i in range(args.steps + 2):
        for mode, model in models.items():
            ms = forward(model)
            if i >= 2:
                times[mode].append(ms)
    rows = {m: dict(forward_ms=statistics.median(v), first_call_s=first[m] / 1e3) for m, v in times.items()}
    own = {}
    for mode, model in models.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            forward(model)
        prof.disable()
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
        own[mode] = {f"{os.path.basename(k[0])}:{k[2]}": 1e3 * v[2] / args.steps for k, v in stats.items()}
    extra = sorted(own["mhc"].items(), key=lambda kv: kv[1] - own["residual"].get(kv[0], 0.0), reverse=True)[:args.top]
    for mode, r in rows.items():
        print(f"{mode:<10} forward {r['forward_ms']:8.2f} ms host (first call {r['first_call_s']:.1f} s)", flush=True)
    print("mHC's extra host time by function (own ms per forward under cProfile, mHC / residual):")
    for name, ms in extra:
        print(f"  {name:<60} {ms:7.2f} / {own['residual'].get(name, 0.0):7.2f}")
    return dict(rows=rows, compiled=args.compile, chained=args.chain, shape=dict(c=c, blocks=layers, heads=heads, batch=batch, seq=seq),
                own_ms_top=[dict(function=k, mhc=v, residual=own["residual"].get(k, 0.0)) for k, v in extra])


def dispatch_cost(run, x, params, steps: int) -> dict:
    """--dispatch: host us per call of every fused op the wiring `run` calls (the ones its eager path reaches by
    `op.plain`; routed `mhc_enter` beside `mhc_pre`, whose arguments it takes), through its registered custom op (the
    call a torch.compile graph makes: dispatcher, the custom op's autograd and backend wrappers, then the body) against
    the body alone (the eager path's call), without grad, on the arguments of the op's first call in one forward +
    backward of the wiring. The difference is what the compiled graph pays per op call on top of the eager path."""
    first: dict = {}
    registered = {name: op for name, op in vars(ops).items() if hasattr(op, "plain") and callable(op)}
    bodies = {name: op.plain for name, op in registered.items()}

    def spy(name):
        def recorded(*a, **kw):
            first.setdefault(name, (a, kw))
            return bodies[name](*a, **kw)
        return recorded

    for name, op in registered.items():
        op.plain = spy(name)
    try:
        for p in params:
            p.grad = None
        run(x).float().sum().backward()
    finally:
        for name, op in registered.items():
            op.plain = bodies[name]
    if "mhc_pre_fwd" in first:  # under compile the enter op runs routed (ops.Routed): the same arguments
        first["mhc_enter_fwd"] = first["mhc_pre_fwd"]
    rows = {}
    with torch.no_grad():
        for name, (a, kw) in sorted(first.items()):
            calls = {"custom op": lambda: registered[name](*a, **kw), "body": lambda: bodies[name](*a, **kw)}
            best = {}
            for i in range(3 + steps):  # alternating; the best of the rounds after 3 warm-up rounds
                for how, call in calls.items():
                    if REAL:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(20):
                        call()
                    us = 1e6 * (time.perf_counter() - t) / 20
                    if i >= 3:
                        best[how] = min(best.get(how, us), us)
            rows[name] = dict(custom_op_us=best["custom op"], body_us=best["body"],
                              dispatch_us=best["custom op"] - best["body"])
            print(f"{name:<22} custom op {best['custom op']:7.1f} us, body {best['body']:7.1f} us: "
                  f"{best['custom op'] - best['body']:6.1f} us more per call", flush=True)
    return rows


def write_json(path, data: dict) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sublayers", type=int, default=24)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--forward", action="store_true", help="time the forward alone (no backward)")
    p.add_argument("--real", action="store_true", help="CUDA, real launches, each timed (read before import)")
    p.add_argument("--c", type=int, default=64, help="channels: 1024 takes the trainer's launch configs (C blocks)")
    p.add_argument("--model", action="store_true", help="the whole GPT's forward, residual against mHC (model_forward)")
    p.add_argument("--dispatch", action="store_true",
                   help="each fused op as its registered custom op against its body alone (dispatch_cost)")
    p.add_argument("--compile", action="store_true",
                   help="--model: both models under torch.compile (fullgraph), as `model.compile: true` runs them")
    p.add_argument("--chain", action="store_true",
                   help="--model: mHC's sublayers chained (chain_sublayers true; auto chains only in eager mode)")
    p.add_argument("--top", type=int, default=25, help="--model: functions listed by mHC's extra own time")
    p.add_argument("--bf16", action="store_true", help="bf16 streams, as the trainer's (always with --real): phi then "
                   "enters as 16-bit parts, with that path's launches")
    args = p.parse_args()
    if REAL and not torch.cuda.is_available():
        raise SystemExit("--real needs a CUDA device")
    # --model --real: launches as the trainer makes them (round 27's call 3 still timed each, ~2 us more per launch)
    stubbed = [] if REAL and args.model else replace_launches(
        (lambda fn, k: _TimedLaunch(fn, SPENT, k)) if REAL else (lambda fn, k: _NoLaunch()))
    dev = "cuda" if REAL else "cpu"
    torch.manual_seed(0)
    info = dict(torch=torch.__version__, python=sys.version.split()[0], threads=torch.get_num_threads(),
                steps=args.steps, command=" ".join(sys.argv), **{"timed_kernels" if REAL else "stubbed_kernels": stubbed})
    if REAL:
        info.update(triton=triton.__version__, gpu=torch.cuda.get_device_name())
    if args.model:
        result = model_forward(args)
        write_json(args.out, dict(info=info, **result))
        return
    c, n = args.c, 4
    cfg = HyperConfig(residual_mode="mhc", n_streams=n, kernel_backend="triton", phi_init="normal", bias_init="a6")
    layers = nn.ModuleList(HyperConnection(nn.Identity(), c, i, cfg) for i in range(args.sublayers))
    hc_cfg = HyperConfig(residual_mode="hc", n_streams=n, kernel_backend="triton", bias_init="hc_identity")
    hc_layers = nn.ModuleList(HyperConnection(nn.Identity(), c, i, hc_cfg) for i in range(args.sublayers))
    layers.to(dev), hc_layers.to(dev)
    params = list(layers.parameters()) + list(hc_layers.parameters())
    # --real / --bf16: the trainer's dtypes (bf16 streams, fp32 parameters: phi as 16-bit pairs, one more launch)
    bf16 = REAL or args.bf16
    x = torch.randn(2, 16, n, c, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32, requires_grad=True)

    def chained(x):
        cfg.chain_sublayers = True  # the layers share cfg: run_sublayers takes the chain only when it says so
        return run_sublayers(layers, x, 0)

    def one_at_a_time(x):
        cfg.chain_sublayers = False
        for layer in layers:
            x = layer(x)
        return x

    def hc(x):
        for layer in hc_layers:
            x = layer(x)
        return x

    # A/Bs: the eager Functions entered by Function.apply's Python wrapper; HC's operands built by the torch
    # composition outside the op (before they were made inside it)
    one_at_a_time_by_function_apply = under_config(one_at_a_time, "launch", "c_apply", False)
    hc_operands_by_torch = under_config(hc, "hc_operands", "fold", False)

    def hc_coef_then_stream_pre(x):
        # A/B: HC's sublayer as wired in round 7: hc_coef, then stream_pre, the write-back reading x itself
        for layer in hc_layers:
            h_pre, h_post, h_res = fused.hc_coefficients(
                x, layer.norm_weight, layer.w_beta, layer.w_m, layer.w_r, layer.s_alpha, layer.s_beta,
                layer.b_static, layer.am_static, layer.ar_static)
            x = fused.stream_post_res(x, layer.run_branch(fused.stream_pre(x, h_pre)), h_post, h_res)
        return x

    # HC's two parameter operands (projection weights, packed statics) built once, outside the step: what folding
    # their construction (a dozen small torch ops and autograd nodes each way) into the op could save at most
    operands = []
    for layer in hc_layers:
        w, st = fused._hc_weights(x, layer.norm_weight, layer.w_beta, layer.w_m, layer.w_r, layer.s_alpha,
                                  layer.s_beta, layer.b_static, layer.am_static, layer.ar_static)
        operands.append((w.detach().requires_grad_(), st.detach().requires_grad_()))
    params += [t for pair in operands for t in pair]

    def hc_operands_prebuilt(x):
        lead = x.shape[:-2]
        for layer, (w, st) in zip(hc_layers, operands):
            xt, u, h_pre, h_post, h_res, _, _ = ops.eager.hc_enter(x.reshape(-1, n, c), w, st, 1e-6, True)
            x = fused.stream_post_res(xt.view(x.shape), layer.run_branch(u.reshape(*lead, c)),
                                      h_post.reshape(*lead, n), h_res.reshape(*lead, n, n))
        return x

    runs = {"chain (boundary op)": chained, "one sublayer at a time (mhc_enter + stream_post_res)": one_at_a_time,
            "one sublayer at a time, by Function.apply (c_apply false; A/B)": one_at_a_time_by_function_apply,
            "HC (hc_enter + stream_post_res)": hc,
            "HC, operands by torch ops outside the op (hc_operands fold false; A/B)": hc_operands_by_torch,
            "HC, hc_coef + stream_pre + stream_post_res (round 7's wiring; A/B)": hc_coef_then_stream_pre,
            "HC, parameter operands built outside the step (bound for folding them into the op)": hc_operands_prebuilt}
    if args.dispatch:
        rows = dispatch_cost(one_at_a_time, x, params, args.steps)
        info.update(c=args.c, streams="bf16" if bf16 else "fp32")
        write_json(args.out, dict(info=info, dispatch=rows))
        return
    rows = {}
    for name, (ms, launch_ms, us_per_launch) in paired_step_ms(runs, x, params, args.steps, args.forward).items():
        rows[name] = dict(step_ms=ms, per_sublayer_ms=ms / args.sublayers)
        line = f"{name:<52} {ms:8.2f} ms per step, {1e3 * ms / args.sublayers:7.0f} us per sublayer"
        if REAL:
            rows[name].update(launch_ms=launch_ms, us_per_launch=us_per_launch)
            line += f", of which {1e3 * launch_ms / args.sublayers:5.0f} us in Triton launches"
        print(line, flush=True)
    info.update(sublayers=args.sublayers, c=args.c, forward_only=args.forward, streams="bf16" if bf16 else "fp32")
    write_json(args.out, dict(info=info, rows=rows))


if __name__ == "__main__":
    main()
