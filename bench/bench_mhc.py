"""mHC (n = 4) cost over a residual transformer stack, and per-kernel bandwidth, in one process.

    python bench/bench_mhc.py [--out DIR] [--shapes 1,2] [--ref-compile] [--budget-s 420]
    python bench/bench_mhc.py --smoke        # CPU, Triton interpreter, tiny shapes: checks the script only
    python bench/bench_mhc.py --quick --sweep --out $OUT   # ~2-3 min on an H200: residual + ours eager at both
        shapes, per-kernel table, sweep of the launch variants that have not been timed yet (SWEEP_QUICK)

Stack = pre-norm causal attention (SDPA) and pre-norm SwiGLU MLP sublayers in bf16; streams are expanded
once after the input and sum-collapsed at the end. Variants: residual; mHC through the project's
HyperConnection wrapper with the reference ops (torch) and with the fused kernels (triton), each eager and
torch.compile'd; Liger-Kernel LigerMHC and lucidrains hyper-connections when importable. One training step =
forward + backward of mean(out^2), timed with CUDA events, median of --iters after --warmup steps.
Before timing, fused ops and the fused stack are checked against the reference in the same run.
"""
import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--out", default=os.environ.get("OUT", "."))
p.add_argument("--shapes", default="1,2", help="1: C=1024, 24 sublayers, B=8, T=2048; 2: C=2048, 16 sublayers, B=4")
p.add_argument("--iters", type=int, default=12)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--ref-compile", action="store_true", help="also compile the reference-op stack (minutes of compile)")
p.add_argument("--budget-s", type=float, default=420.0, help="skip remaining stack variants past this wall time")
p.add_argument("--no-kernels", action="store_true", help="skip the per-kernel bandwidth table")
p.add_argument("--sweep", action="store_true", help="try launch configs per kernel at the first shape, keep the best")
p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter at tiny shapes")
p.add_argument("--variants", default=None,
               help="comma-separated substrings: run only the stack variants whose name contains one (residual is kept)")
p.add_argument("--quick", action="store_true",
               help="only residual + ours (eager) per shape, per-kernel table; --sweep then tries only SWEEP_QUICK")
args = p.parse_args()
if args.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

from mhc_lightning.kernels import reference as R  # noqa: E402
from mhc_lightning.kernels import fused  # noqa: E402
from mhc_lightning.kernels.fused import ops as K  # noqa: E402
from mhc_lightning.model.config import HyperConfig  # noqa: E402
from mhc_lightning.model.hyper_connection import HyperConnection  # noqa: E402
from mhc_lightning.model.recompute import run_sublayers  # noqa: E402

DEV = "cpu" if args.smoke else "cuda"
DT = torch.float32 if args.smoke else torch.bfloat16
N_STREAMS = 4
T0 = time.time()
torch.backends.cuda.matmul.allow_tf32 = True


# ------------------------------------------------------------------------------------------------ sublayers
class Norm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads, self.norm = heads, Norm(c)
        self.wqkv = nn.Linear(c, 3 * c, bias=False)
        self.wo = nn.Linear(c, c, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.wqkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, c):
        super().__init__()
        hidden = int(8 * c / 3) // 64 * 64 or 64
        self.norm = Norm(c)
        self.w_in = nn.Linear(c, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, c, bias=False)

    def forward(self, x):
        gate, up = self.w_in(self.norm(x)).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


def sublayers(c, heads, blocks):
    return [m for _ in range(blocks) for m in (Attention(c, heads), SwiGLU(c))]


class Residual(nn.Module):
    def __init__(self, c, heads, blocks):
        super().__init__()
        self.layers = nn.ModuleList(sublayers(c, heads, blocks))

    def forward(self, x):
        for f in self.layers:
            x = x + f(x)
        return x


# ------------------------------------------------------------------------------------------------ mHC stacks
WRAPPER = "mhc_lightning.model.hyper_connection.HyperConnection"  # the model's own wiring, timed as is
L_R = {"1": 2, "2": 2}  # recompute block per shape key (set in main)


def hyper_layer(branch, c, index, backend, fused_pre=False):
    cfg = HyperConfig(residual_mode="mhc", n_streams=N_STREAMS, kernel_backend=backend, phi_init="normal",
                      bias_init="a6", sinkhorn_iters=20, fused_pre=fused_pre)
    return HyperConnection(branch, c, index, cfg)


class Hyper(nn.Module):
    def __init__(self, c, heads, blocks, backend, fused_pre=False, recompute=0):
        super().__init__()
        self.layers = nn.ModuleList(hyper_layer(f, c, i, backend, fused_pre)
                                    for i, f in enumerate(sublayers(c, heads, blocks)))
        self.recompute = recompute  # sublayers per selective-recompute block (mhc-math §9); 0 = off

    def set_backend(self, backend):
        for layer in self.layers:
            layer.cfg.kernel_backend = backend
        return self

    def forward(self, x):
        x = x.unsqueeze(-2).expand(*x.shape[:-1], N_STREAMS, x.shape[-1]).contiguous()
        return run_sublayers(self.layers, x, self.recompute).sum(-2)  # recompute 0: a plain loop


class Liger(nn.Module):
    def __init__(self, c, heads, blocks):
        super().__init__()
        from liger_kernel.transformers.mhc import LigerMHC

        self.layers = nn.ModuleList(LigerMHC(f, hc=N_STREAMS, c=c, tmax=20, phi_dtype=torch.bfloat16)
                                    for f in sublayers(c, heads, blocks))

    def forward(self, x):
        x = x.unsqueeze(-2).expand(*x.shape[:-1], N_STREAMS, x.shape[-1]).contiguous()
        for layer in self.layers:
            x = layer(x)
        return x.sum(-2)


class Lucid(nn.Module):
    def __init__(self, c, heads, blocks):
        super().__init__()
        from hyper_connections import mc_get_init_and_expand_reduce_stream_functions

        init, self.expand, self.reduce = mc_get_init_and_expand_reduce_stream_functions(N_STREAMS, sinkhorn_iters=20)
        self.layers = nn.ModuleList(init(dim=c, branch=f, layer_index=i)
                                    for i, f in enumerate(sublayers(c, heads, blocks)))

    def forward(self, x):
        x = self.expand(x)
        for layer in self.layers:
            x = layer(x)
        return self.reduce(x)


# ------------------------------------------------------------------------------------------------ timing
def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters, warmup):
    """Median ms of fn() over iters calls after warmup calls (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(iters):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts)


def timed_batch(fn, batches, per_batch):
    """Median ms per call of fn(), timed over back-to-back groups of per_batch calls (GPU time, not launch latency)."""
    if DEV != "cuda":
        return timed(fn, min(batches, 3), 0)  # smoke: the interpreter is slow
    for _ in range(3):
        fn()
    sync()
    ts = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_batch):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / per_batch)
    return statistics.median(ts)


def peak_reset():
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")


def ceilings():
    if DEV != "cuda":
        return 1.0, 1.0
    a = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 20, 3)
    bw = 2 * 2**30 / (ms * 1e-3) / 1e12
    m = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn_like(m)
    ms = timed(lambda: m @ k, 10, 3)
    del a, b, m, k
    return bw, 2 * 8192**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------ checks
def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_ops(c, tokens):
    """Fused ops vs the float64 reference at the benchmark's C, bf16 activations and bf16 params."""
    torch.manual_seed(1)
    n, m = N_STREAMS, R.mhc_logit_count(N_STREAMS)
    x = torch.randn(tokens, n, c, device=DEV, dtype=DT)
    phi = (torch.randn(n * c, m, device=DEV) * 0.02).to(DT)
    bias = torch.cat([torch.zeros(2 * n), (6 * torch.eye(n) - 3).flatten()]).to(DEV, DT)
    alpha = torch.tensor([0.5, 0.7, 0.9], device=DEV, dtype=DT)
    f = torch.randn(tokens, c, device=DEV, dtype=DT)
    leaves = [t.clone().requires_grad_() for t in (x, phi, bias, alpha, f)]
    refs = [t.double().requires_grad_() for t in (x, phi, bias, alpha, f)]
    res = {}
    outs = []
    for ops, ins in ((fused, leaves), (R, refs)):
        xx, ph, bb, aa, ff = ins
        u, h_pre, h_post, h_res = ops.mhc_pre(xx, ph, bb, aa, sinkhorn_iters=20)  # the model's path
        y = ops.stream_post_res(xx, ff * u, h_post, h_res)
        outs.append([h_pre, h_post, h_res, u, y])
    torch.manual_seed(2)
    gs = [torch.randn_like(o, dtype=torch.float64) for o in outs[1]]
    grads = []
    for o, ins in zip(outs, (leaves, refs)):
        loss = sum((a.double() * g).sum() for a, g in zip(o, gs))
        grads.append(torch.autograd.grad(loss, ins))
    for name, a, b in zip(("h_pre", "h_post", "h_res", "u", "x_next"), *outs):
        res[name] = rel_err(a, b)
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha", "df"), *grads):
        res[name] = rel_err(a, b)
    res["ok"] = all(torch.isfinite(torch.tensor(v)) and v < 2e-2 for v in res.values())
    return res


def check_stack(c, heads, blocks, b, t, fused_pre=False):
    """The fused stack vs the same weights on the reference ops: output and gradients."""
    torch.manual_seed(3)
    model = Hyper(c, heads, blocks, "triton", fused_pre).to(DEV, DT)
    ref = copy.deepcopy(model).set_backend("torch")
    x = torch.randn(b, t, c, device=DEV, dtype=DT)
    res = {}
    outs = []
    for m in (model, ref):
        y = m(x)
        y.float().square().mean().backward()
        outs.append(y)
    res["out"] = rel_err(outs[0], outs[1])
    pa = dict(model.named_parameters())
    worst = 0.0
    for name, q in ref.named_parameters():
        worst = max(worst, rel_err(pa[name].grad, q.grad))
    res["grads_worst"] = worst
    res["ok"] = res["out"] < 2e-2 and worst < 5e-2
    del model, ref
    return res


# ------------------------------------------------------------------------------------------------ per kernel
def kernel_table(c, tokens, copy_bw):
    """Time each fused op body (its kernels and allocations, no dispatcher) on bf16 activations, back to back so that
    host time hides behind the GPU; bytes = each input read once, each output written once."""
    torch.manual_seed(4)
    n, m = N_STREAMS, R.mhc_logit_count(N_STREAMS)
    x = torch.randn(tokens, n, c, device=DEV, dtype=DT)
    phi = (torch.randn(n * c, m, device=DEV) * 0.02).to(DT)
    bias = torch.randn(m, device=DEV).to(DT)
    alpha = torch.tensor([0.5, 0.7, 0.9], device=DEV, dtype=DT)
    f = torch.randn(tokens, c, device=DEV, dtype=DT)
    opts = (20, 1e-6, True, False, 1e-6, 1e-6, 2.0)
    h_pre, h_post, h_res, lg, rinv = K.coef_fwd.plain(x, phi, bias, alpha, *opts)
    dh = [torch.randn_like(h) for h in (h_pre, h_post, h_res)]
    g = torch.randn_like(x)
    du = torch.randn_like(f)
    dl, dss, _ = K.bwd_tok(x, phi, bias, alpha, lg, rinv, *dh, 20, 1e-6, True, False, 2.0)
    dx = torch.empty_like(x)
    e, f32 = x.element_size(), 4
    N, NC = tokens, n * c
    small = N * (2 * n + n * n) * f32  # h_pre, h_post, h_res
    pre_bwd_args = (x, phi, bias, alpha, lg, rinv, h_pre, du, *dh, 20, 1e-6, True, False, 2.0)
    rows = [
        # the model's path: fused pre op (coefficients + u from one read of x; one dx in the backward)
        ("mhc_pre fwd (coef + u)", lambda: K.mhc_pre_fwd.plain(x, phi, bias, alpha, *opts),
         N * NC * e + NC * m * e + small + N * (m + 1) * f32 + N * c * e),
        ("mhc_pre bwd, per token (<du,x>+Sinkhorn)",
         lambda: K.bwd_tok(x, phi, bias, alpha, lg, rinv, *dh, 20, 1e-6, True, False, 2.0, du=du),
         N * NC * e + N * c * e + small + 2 * N * (m + 1) * f32),
        ("mhc_pre bwd (whole op)", lambda: K.mhc_pre_bwd.plain(*pre_bwd_args),
         2 * N * NC * e + 2 * N * c * e + 2 * NC * m * e + small + N * (m + 1) * f32),
        ("coef fwd (GEMM+rms+sigma+Sinkhorn)", lambda: K.coef_fwd.plain(x, phi, bias, alpha, *opts),
         N * NC * e + NC * m * e + small + N * (m + 1) * f32),
        ("coef bwd, per token (Sinkhorn bwd)",
         lambda: K.bwd_tok(x, phi, bias, alpha, lg, rinv, *dh, 20, 1e-6, True, False, 2.0),
         small + 2 * N * (m + 1) * f32),
        ("coef bwd, x pass (dx + dphi)", lambda: K.bwd_x(x, phi, dl, dss, dx),
         2 * N * NC * e + 2 * NC * m * e + N * (m + 1) * f32),
        ("coef bwd (whole op)",
         lambda: K.coef_bwd.plain(x, phi, bias, alpha, lg, rinv, *dh, 20, 1e-6, True, False, 2.0),
         2 * N * NC * e + 2 * NC * m * e + small + N * (m + 1) * f32),
        ("stream_pre fwd", lambda: K.pre_fwd.plain(x, h_pre), N * NC * e + N * n * f32 + N * c * e),
        ("stream_pre bwd", lambda: K.pre_bwd.plain(du, x, h_pre), 2 * N * NC * e + N * c * e + 2 * N * n * f32),
        ("stream_post_res fwd", lambda: K.post_fwd.plain(x, f, h_post, h_res), 2 * N * NC * e + N * c * e + small - N * n * f32),
        ("stream_post_res bwd", lambda: K.post_bwd.plain(g, x, f, h_post, h_res),
         3 * N * NC * e + 2 * N * c * e + 2 * (small - N * n * f32)),
    ]
    out = []
    for name, fn, nbytes in rows:
        ms = timed_batch(fn, 20, 10)
        gbs = nbytes / (ms * 1e-3) / 1e9
        out.append(dict(kernel=name, C=c, tokens=tokens, bytes=nbytes, ms=ms, gb_s=gbs, pct_copy=100 * gbs / (copy_bw * 1e3)))
    return out


# --quick --sweep: only what no GPU run has timed yet (the new kernels / variants), at C=1024 and C=2048 (each
# shape keeps its own winner when --quick: they differ for post_bwd whole-row tiles).
SWEEP_QUICK = {
    "post_bwd": [dict(BT=bt, BC=bc, num_warps=w, impl=impl) for bt, bc, w, impl in
                 [(2, 256, 4, "loop"), (4, 256, 4, "2d"), (2, 512, 4, "2d"), (1, 4096, 4, "2d"), (1, 4096, 8, "2d"),
                  (2, 4096, 8, "2d")]],
    "coef_fwd": [dict(BT=bt, BK=bk, num_warps=w, num_stages=st, BC=bc, split_tail=sp) for bt, bk, w, st, bc, sp in
                 [(64, 64, 4, 3, 16, False), (64, 64, 4, 3, 16, True), (32, 128, 4, 3, 32, True),
                  (16, 128, 4, 3, 64, True), (32, 128, 4, 3, 32, False)]],
    "coef_tail": [dict(BT=bt, num_warps=w) for bt, w in [(16, 4), (32, 4), (8, 2)]],
    "coef_bwd_tok": [dict(BT=bt, num_warps=w, BC=bc) for bt, w, bc in [(64, 4, 16), (32, 4, 32), (16, 4, 64)]],
}

SWEEP = {  # full run: around the round-2 winners (ops.CONFIG), at C=1024, on the model's path (mhc_pre op)
    "coef_fwd": [dict(BT=bt, BK=bk, num_warps=w, num_stages=st, BC=bc, split_tail=True) for bt, bk, w, st, bc in
                 [(64, 64, 4, 3, 16), (32, 64, 4, 3, 32), (64, 128, 8, 3, 16), (32, 128, 4, 4, 32)]],
    "coef_tail": [dict(BT=bt, num_warps=w) for bt, w in [(8, 2), (4, 1), (16, 2)]],
    "coef_bwd_tok": [dict(BT=bt, num_warps=w, BC=bc) for bt, w, bc in [(16, 4, 64), (8, 4, 128), (16, 2, 64), (32, 4, 64)]],
    "coef_bwd_x": [dict(BT=bt, BK=bk, num_warps=w, num_stages=st, programs_per_sm=pp) for bt, bk, w, st, pp in
                   [(64, 128, 8, 2, 4), (64, 64, 4, 3, 4), (32, 128, 4, 3, 4), (64, 128, 8, 2, 8)]],
    "pre_fwd": [dict(BT=bt, BC=bc, num_warps=w) for bt, bc, w in [(4, 512, 4), (8, 256, 4)]],
    "pre_bwd": [dict(BT=bt, BC=bc, num_warps=w) for bt, bc, w in [(4, 256, 4), (8, 256, 8)]],
    "post_fwd": [dict(BT=bt, BC=bc, num_warps=w) for bt, bc, w in [(4, 256, 4), (8, 256, 8), (2, 512, 4)]],
    "post_bwd": [dict(BT=bt, BC=bc, num_warps=w, impl="2d") for bt, bc, w in
                 [(4, 256, 4), (8, 256, 8), (4, 512, 8), (2, 256, 4)]],
}


def sweep(c, tokens, table=None):
    """Time every config of each kernel in table (default SWEEP), keep the fastest in K.CONFIG; returns the log."""
    torch.manual_seed(5)
    n, m = N_STREAMS, R.mhc_logit_count(N_STREAMS)
    x = torch.randn(tokens, n, c, device=DEV, dtype=DT)
    phi = (torch.randn(n * c, m, device=DEV) * 0.02).to(DT)
    bias, alpha = torch.randn(m, device=DEV).to(DT), torch.tensor([0.5, 0.7, 0.9], device=DEV, dtype=DT)
    f, du, g = torch.randn(tokens, c, device=DEV, dtype=DT), torch.randn(tokens, c, device=DEV, dtype=DT), torch.randn_like(x)
    opts = (20, 1e-6, True, False, 1e-6, 1e-6, 2.0)
    h_pre, h_post, h_res, lg, rinv = K.coef_fwd.plain(x, phi, bias, alpha, *opts)
    dh = [torch.randn_like(h) for h in (h_pre, h_post, h_res)]
    dl, dss, _ = K.bwd_tok(x, phi, bias, alpha, lg, rinv, *dh, 20, 1e-6, True, False, 2.0)
    dx = torch.empty_like(x)
    # coefficient kernels are timed on the model's path: the fused pre op (u in the forward, du in the backward)
    calls = {
        "coef_fwd": lambda: K.mhc_pre_fwd.plain(x, phi, bias, alpha, *opts),
        "coef_tail": lambda: K.mhc_pre_fwd.plain(x, phi, bias, alpha, *opts),
        "coef_bwd_tok": lambda: K.bwd_tok(x, phi, bias, alpha, lg, rinv, *dh, 20, 1e-6, True, False, 2.0, du=du),
        "coef_bwd_x": lambda: K.bwd_x(x, phi, dl, dss, dx, h_pre=h_pre, du=du),
        "pre_fwd": lambda: K.pre_fwd.plain(x, h_pre),
        "pre_bwd": lambda: K.pre_bwd.plain(du, x, h_pre),
        "post_fwd": lambda: K.post_fwd.plain(x, f, h_post, h_res),
        "post_bwd": lambda: K.post_bwd.plain(g, x, f, h_post, h_res),
    }
    log = {}
    for name, cfgs in (table or SWEEP).items():
        if name == "coef_tail" and not K.CONFIG["coef_fwd"].get("split_tail"):
            continue  # only matters when the split tail won
        res = []
        for cfg in cfgs:
            K.CONFIG[name] = cfg
            try:
                res.append((timed_batch(calls[name], 10, 5), cfg))
            except Exception as exc:
                print(f"  sweep {name} {cfg}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
        res.sort(key=lambda r: r[0])
        K.CONFIG[name] = res[0][1]
        log[name] = [dict(us=1e3 * t, **cfg) for t, cfg in res]
        print(f"  sweep {name}: " + ", ".join(f"{1e3 * t:.0f}us {cfg}" for t, cfg in res[:3]), flush=True)
    return log


# ------------------------------------------------------------------------------------------------ main
STATE = {}


def dump():
    """Write what exists so far: a run cut short by its time limit still leaves its numbers."""
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_mhc.json")
    with open(path, "w") as fh:
        json.dump(dict(STATE, wrapper=WRAPPER, config=K.CONFIG), fh, indent=1)
    return path


def run_variant(name, make, x, rows, base):
    if time.time() - T0 > args.budget_s:
        rows.append(dict(base, variant=name, skipped="time budget"))
        print(f"  {name}: skipped (time budget)", flush=True)
        return
    torch.manual_seed(0)
    t = time.time()
    try:
        with torch.device(DEV):  # initialise on the device: seconds of CPU init per variant otherwise
            model = make()
        params = [q for q in model.parameters()]

        def step():
            for q in params:
                q.grad = None
            model(x).float().square().mean().backward()

        step()  # first call: compile / JIT, outside both the timing and the peak
        peak_reset()
        ms = timed(step, args.iters, args.warmup)
        r = dict(base, variant=name, ms=ms, peak_gib=peak_gib(), wall_s=time.time() - t)
    except Exception as exc:  # a missing peer or a failed compile is reported, not fatal
        r = dict(base, variant=name, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    rows.append(r)
    print(f"  {r}", flush=True)
    dump()
    model = None
    if DEV == "cuda":
        torch.cuda.empty_cache()


def main():
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, python=sys.version.split()[0], command=" ".join(sys.argv))
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    info["gpu"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    bw, mm = ceilings()
    info.update(copy_tb_s=bw, bf16_mm_tflops=mm)
    print(info, flush=True)
    shapes = {"1": (1024, 16, 12, 8, 2048), "2": (2048, 16, 8, 4, 2048)}
    L_R.update({"1": 4, "2": 3})  # L_r* of mhc-math §9 for 24 and 16 sublayers at n = 4
    if args.smoke:
        shapes = {"1": (64, 4, 1, 2, 16), "2": (96, 4, 1, 1, 24)}
    rows, checks, kernels = [], {}, []
    STATE.update(info=info, checks=checks, stack=rows, kernels=kernels)
    STATE["sweep"] = {}
    if args.sweep and not args.quick:
        STATE["sweep"] = sweep(*((1024, 16384) if not args.smoke else (64, 40)))
    for key in args.shapes.split(","):
        c, heads, blocks, b, t = shapes[key]
        print(f"== C={c} sublayers={2 * blocks} B={b} T={t}", flush=True)
        if args.sweep and args.quick:  # per shape: the winners (CONFIG) then apply to this shape's stack
            STATE["sweep"][f"C{c}"] = sweep(c, b * t if not args.smoke else 40, SWEEP_QUICK)
            STATE.setdefault("config_per_shape", {})[f"C{c}"] = copy.deepcopy(K.CONFIG)
        checks[f"C{c}_ops"] = check_ops(c, min(b * t, 4096))
        checks[f"C{c}_stack"] = check_stack(c, heads, min(blocks, 2), 1, min(t, 512))
        checks[f"C{c}_stack_mhc_pre"] = check_stack(c, heads, min(blocks, 2), 1, min(t, 512), fused_pre=True)
        print("  checks", {k: v for k, v in checks.items() if k.startswith(f"C{c}_")}, flush=True)
        if not args.no_kernels:
            kernels += kernel_table(c, b * t, bw)
        x = torch.randn(b, t, c, device=DEV, dtype=DT)
        base = dict(C=c, sublayers=2 * blocks, B=b, T=t, n=N_STREAMS)
        variants = [  # most important first: the time budget cuts from the end
            ("residual", lambda: Residual(c, heads, blocks).to(DEV, DT)),
            ("ours (fused)", lambda: Hyper(c, heads, blocks, "triton").to(DEV, DT)),
            ("ours (fused, mhc_pre op)", lambda: Hyper(c, heads, blocks, "triton", fused_pre=True).to(DEV, DT)),
            ("residual+compile", lambda: torch.compile(Residual(c, heads, blocks).to(DEV, DT))),
            ("ours (fused)+compile", lambda: torch.compile(Hyper(c, heads, blocks, "triton").to(DEV, DT))),
            ("ours (fused, mhc_pre op)+compile",
             lambda: torch.compile(Hyper(c, heads, blocks, "triton", fused_pre=True).to(DEV, DT))),
            (f"ours (mhc_pre op), recompute L_r={L_R[key]}",
             lambda: Hyper(c, heads, blocks, "triton", fused_pre=True, recompute=L_R[key]).to(DEV, DT)),
            (f"ours (mhc_pre op)+compile, recompute L_r={L_R[key]}",
             lambda: torch.compile(Hyper(c, heads, blocks, "triton", fused_pre=True, recompute=L_R[key]).to(DEV, DT))),
            ("liger 0.8.5", lambda: Liger(c, heads, blocks).to(DEV, DT)),
            ("reference ops", lambda: Hyper(c, heads, blocks, "torch").to(DEV, DT)),
            ("lucidrains 0.4.11", lambda: Lucid(c, heads, blocks).to(DEV, DT)),
        ]
        if args.ref_compile and key == "1":  # minutes of compile: first shape only, as the peer harness
            variants.append(("reference ops+compile", lambda: torch.compile(Hyper(c, heads, blocks, "torch").to(DEV, DT))))
        if args.smoke:
            variants = [v for v in variants if "compile" not in v[0] and "liger" not in v[0] and "lucid" not in v[0]]
        if args.quick:
            variants = [v for v in variants if v[0] in ("residual", "ours (fused)", "ours (fused, mhc_pre op)")]
        if args.variants:
            keep = [k.strip() for k in args.variants.split(",")]
            variants = [v for v in variants if v[0] == "residual" or any(k in v[0] for k in keep)]
        for name, make in variants:
            run_variant(name, make, x, rows, base)
    for c in sorted({r["C"] for r in rows}):
        ref = {r["variant"]: r for r in rows if r["C"] == c and "ms" in r}
        for r in rows:
            if r["C"] != c or "ms" not in r:
                continue
            if "residual" in ref:
                r["x_residual"] = r["ms"] / ref["residual"]["ms"]
                r["x_residual_peak"] = r["peak_gib"] / ref["residual"]["peak_gib"]
            if "residual+compile" in ref:
                r["x_residual_compiled"] = r["ms"] / ref["residual+compile"]["ms"]
    path = dump()
    print(f"\n{info['gpu']}  torch {info['torch']}  triton {info.get('triton')}  copy {bw:.2f} TB/s  bf16 mm {mm:.0f} TFLOP/s")
    print(f"{'C':>5} {'variant':<38} {'ms/step':>8} {'x resid':>8} {'x res.comp':>10} {'peak GiB':>9} {'x peak':>7}")
    for r in rows:
        if "ms" in r:
            print(f"{r['C']:>5} {r['variant']:<38} {r['ms']:8.1f} {r.get('x_residual', float('nan')):8.3f} "
                  f"{r.get('x_residual_compiled', float('nan')):10.3f} {r['peak_gib']:9.2f} {r.get('x_residual_peak', float('nan')):7.2f}")
        else:
            print(f"{r['C']:>5} {r['variant']:<38} {r.get('error', r.get('skipped'))}")
    if kernels:
        print(f"\n{'kernel':<38} {'C':>5} {'MB moved':>9} {'us':>8} {'GB/s':>7} {'% copy':>7}")
        for k in kernels:
            print(f"{k['kernel']:<38} {k['C']:>5} {k['bytes'] / 1e6:9.1f} {1e3 * k['ms']:8.1f} {k['gb_s']:7.0f} {k['pct_copy']:7.1f}")
    print("checks:", json.dumps(checks))
    print("mHC wrapper:", WRAPPER)
    print("wrote", path)


if __name__ == "__main__":
    main()
