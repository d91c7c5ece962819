"""mHC (n = 4) cost over a residual transformer stack, and per-kernel bandwidth, in one process.

    python bench/bench_mhc.py [--out DIR] [--shapes 1,2] [--ref-compile] [--budget-s 420] [--config PREV/bench_mhc.json]
    python bench/bench_mhc.py --smoke        # CPU, Triton interpreter, tiny shapes: checks the script only
    python bench/bench_mhc.py --quick --sweep --out $OUT   # residual + ours eager at both shapes, per-kernel
        table, sweep of the launch variants that have not been timed yet (SWEEP_QUICK)

Stack = pre-norm causal attention (SDPA) and pre-norm SwiGLU MLP sublayers in bf16; streams are expanded
once after the input and sum-collapsed at the end. Variants: residual; mHC through the project's
HyperConnection wrapper with the reference ops (torch) and with the fused kernels (triton): chained through the
sublayer boundary op (model/recompute.py's run_sublayers, the model's path) and one sublayer at a time (its own
fused pre op and write-back), each eager and torch.compile'd; Liger-Kernel LigerMHC and lucidrains
hyper-connections when importable. One training step = forward + backward of mean(out^2), timed with CUDA events,
median of --iters after --warmup steps. Before timing, fused ops and the fused stack are checked against the
reference in the same run.
"""
import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

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
p.add_argument("--sweep-only", default=None, metavar="KERNELS",
               help="comma-separated CONFIG names: --sweep tries only these kernels' entries of the full table, then "
                    "exits (e.g. coef_bwd_tok,post_bwd)")
p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter at tiny shapes")
p.add_argument("--variants", default=None,
               help="comma-separated substrings: run only the stack variants whose name contains one (residual is kept)")
p.add_argument("--skip", default=None, help="comma-separated substrings: leave out the variants whose name contains one")
p.add_argument("--quick", action="store_true",
               help="only residual + ours (eager) per shape, per-kernel table; --sweep then tries only SWEEP_QUICK")
p.add_argument("--profile", action="store_true",
               help="per eager mHC variant: CUDA time per kernel over one training step (torch.profiler), top 25")
p.add_argument("--profile-host", nargs="?", const="", default=None, metavar="VARIANTS",
               help="per eager mHC variant: Python time per function over one step (cProfile), top 25 by own time; "
                    "VARIANTS (comma-separated): only the variants whose names contain one of them")
p.add_argument("--phi-dtype", choices=("bf16", "fp32"), default="bf16",
               help="dtype of phi (the rest is bf16): fp32 is what the trainer holds under bf16-mixed (tf32 dots)")
p.add_argument("--only-op", default=None, metavar="NAME",
               help="run one op body of the kernel table (a substring of its name) 20 times at C=1024 and exit: the "
                    "target of a kernel profiler (ncu --kernel-name ...)")
p.add_argument("--config", default=None,
               help="a previous run's bench_mhc.json: start from the launch configs it ended with (e.g. a sweep's)")
args = p.parse_args()
if args.sweep_only and (not args.sweep or args.quick):
    p.error("--sweep-only needs --sweep and no --quick (it times entries of the full table)")
if args.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

from profiling import print_rows, time_per_name  # noqa: E402  (bench/, this script's folder)
from mhc_lightning.kernels import MHCOptions  # noqa: E402
from mhc_lightning.kernels import reference as R  # noqa: E402
from mhc_lightning.kernels import fused  # noqa: E402
from mhc_lightning.kernels.fused import launch_config as K  # noqa: E402
from mhc_lightning.model.config import HyperConfig  # noqa: E402
from mhc_lightning.model.hyper_connection import HyperConnection  # noqa: E402
from mhc_lightning.model.recompute import run_sublayers  # noqa: E402

DEV = "cpu" if args.smoke else "cuda"
DT = torch.float32 if args.smoke else torch.bfloat16
PHI_DT = torch.float32 if args.phi_dtype == "fp32" else DT
N_STREAMS = 4
KERNEL_SHAPE = (64, 40) if args.smoke else (1024, 16384)  # (C, tokens) of the full sweep and --only-op
# the paper's 20 Sinkhorn iterations; --smoke takes 4 (the interpreter's backward time grows ~ iters^2, as in the tests)
SINKHORN_ITERS = 4 if args.smoke else 20
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


def hyper_layer(branch, c, index, backend, mode="mhc", rebuild=False):
    cfg = HyperConfig(residual_mode=mode, n_streams=N_STREAMS, kernel_backend=backend, phi_init="normal",
                      bias_init="a6" if mode != "hc" else "hc_identity", sinkhorn_iters=SINKHORN_ITERS,
                      rebuild_branch_input=rebuild)
    return HyperConnection(branch, c, index, cfg)


class Hyper(nn.Module):
    """chained: the model's loop (boundary op between sublayers, optional selective recompute); otherwise each
    sublayer on its own (HyperConnection.forward: fused pre op, branch, write-back)."""

    def __init__(self, c, heads, blocks, backend, chained=True, recompute=0, mode="mhc", rebuild=False):
        super().__init__()
        self.layers = nn.ModuleList(hyper_layer(f, c, i, backend, mode, rebuild)
                                    for i, f in enumerate(sublayers(c, heads, blocks)))
        self.chained = chained
        for layer in self.layers:  # the model's switch (HyperConfig.chain_sublayers)
            layer.cfg.chain_sublayers = chained
        self.recompute = recompute  # sublayers per selective-recompute block (docs/design.md §9); 0 = off

    def set_backend(self, backend):
        for layer in self.layers:
            layer.cfg.kernel_backend = backend
        return self

    def forward(self, x):
        x = x.unsqueeze(-2).expand(*x.shape[:-1], N_STREAMS, x.shape[-1]).contiguous()
        if self.chained:
            return run_sublayers(self.layers, x, self.recompute).sum(-2)  # recompute 0: no checkpoints
        for layer in self.layers:
            x = layer(x)
        return x.sum(-2)


class SummedDx(nn.Module):
    """A/B of `mhc_enter` (round 6): the stack with x handed to the write-back directly, as up to round 5, so that
    autograd sums the two stream-sized gradients of x in a kernel of its own. Patched during forward only: the
    autograd graph is recorded there."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        saved = fused.mhc_enter
        fused.mhc_enter = lambda s, *a: (s, *fused.mhc_pre(s, *a))
        try:
            return self.model(x)
        finally:
            fused.mhc_enter = saved


def hyper(c, heads, blocks, backend, chained=True, **kw):
    """A Hyper stack in bf16 on the GPU, phi in --phi-dtype (fp32: as the trainer holds it under bf16-mixed)."""
    model = Hyper(c, heads, blocks, backend, chained, **kw).to(DEV, DT)
    for mod in model.modules():
        if isinstance(mod, HyperConnection) and getattr(mod, "phi", None) is not None:
            mod.phi.data = mod.phi.data.to(PHI_DT)
    return model


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


def device_ms(fn, calls=20):
    """Mean ms of device time per call of fn: the summed own time of the kernels it launches (torch.profiler). A
    wall-clock time of back-to-back calls measures the host instead when the host needs longer to issue a call than
    the GPU to run it: on the H200's host an op body under ~150 us (round 12: mhc_pre fwd 254 us of wall time for
    about 100 us of kernels)."""
    if DEV != "cuda":
        return timed(fn, 3, 0)  # smoke: the interpreter is slow
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    return time_per_name(prof, calls)[0] / 1e3


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
    return bw, 2 * 8192**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------ checks
def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_ops(c, tokens):
    """Fused ops vs the float64 reference at the benchmark's C, bf16 activations and bf16 params: the model's path
    for two sublayers (fused pre op, boundary op, write-back), outputs and every gradient."""
    torch.manual_seed(1)
    n, m = N_STREAMS, R.mhc_logit_count(N_STREAMS)
    x = torch.randn(tokens, n, c, device=DEV, dtype=DT)
    phi = (torch.randn(n * c, m, device=DEV) * 0.02).to(PHI_DT)
    bias = torch.cat([torch.zeros(2 * n), (6 * torch.eye(n) - 3).flatten()]).to(DEV, DT)
    alpha = torch.tensor([0.5, 0.7, 0.9], device=DEV, dtype=DT)
    f = torch.randn(tokens, c, device=DEV, dtype=DT)
    leaves = [t.clone().requires_grad_() for t in (x, phi, bias, alpha, f)]
    refs = [t.double().requires_grad_() for t in (x, phi, bias, alpha, f)]
    opts = MHCOptions(sinkhorn_iters=SINKHORN_ITERS)
    res = {}
    outs = []
    for ops, ins in ((fused, leaves), (R, refs)):
        xx, ph, bb, aa, ff = ins
        u, h_pre, h_post, h_res = ops.mhc_pre(xx, ph, bb, aa, opts)
        x1, u1, h_pre1, h_post1, h_res1 = ops.mhc_boundary(xx, ff * u, h_post, h_res, ph, bb, aa, opts)
        y = ops.stream_post_res(x1, ff * u1, h_post1, h_res1)
        outs.append([h_pre, h_post, h_res, u, x1, u1, h_pre1, h_post1, h_res1, y])
    torch.manual_seed(2)
    gs = [torch.randn_like(o, dtype=torch.float64) for o in outs[1]]
    grads = []
    for o, ins in zip(outs, (leaves, refs)):
        loss = sum((a.double() * g).sum() for a, g in zip(o, gs))
        grads.append(torch.autograd.grad(loss, ins))
    names = ("h_pre", "h_post", "h_res", "u", "x_next", "u_next", "h_pre_next", "h_post_next", "h_res_next", "out")
    for name, a, b in zip(names, *outs):
        res[name] = rel_err(a, b)
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha", "df"), *grads):
        res[name] = rel_err(a, b)
    res["ok"] = all(torch.isfinite(torch.tensor(v)) and v < 2e-2 for v in res.values())
    return res


def check_stack(c, heads, blocks, b, t, chained=True):
    """The fused stack vs the same weights on the reference ops: output and gradients."""
    torch.manual_seed(3)
    model = hyper(c, heads, blocks, "triton", chained)
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
def _kernel_inputs(c, tokens, seed):
    """Random bf16 operands of every op body at one shape (never zeros: they can run faster than real data)."""
    torch.manual_seed(seed)
    n, m = N_STREAMS, R.mhc_logit_count(N_STREAMS)
    t = dict(device=DEV, dtype=DT)
    x, xn, g = torch.randn(tokens, n, c, **t), torch.randn(tokens, n, c, **t), torch.randn(tokens, n, c, **t)
    phi = (torch.randn(n * c, m, device=DEV) * 0.02).to(PHI_DT)
    bias, alpha = torch.randn(m, device=DEV).to(DT), torch.tensor([0.5, 0.7, 0.9], **t)
    f, du = torch.randn(tokens, c, **t), torch.randn(tokens, c, **t)
    h_pre, h_post, h_res, lg, rinv = K.coef_fwd.plain(x, phi, bias, alpha, *OPS_ARGS)
    dh = [torch.randn_like(h) for h in (h_pre, h_post, h_res)]
    dl, dss, _ = K.bwd_tok(x, phi, bias, alpha, lg, rinv, *dh, *BWD_ARGS, du=du)
    # HC's operands (hc_enter): projection weights [C, n + 2], the packed static parameters, the forward's outputs
    w, st = torch.randn(c, n + 2, device=DEV) / c ** 0.5, torch.randn(2 + 2 * n + n * n, device=DEV)
    hc = K.hc_enter_fwd.plain(x, w, st, 1e-6, True)  # u, h_pre, h_post, h_res, logits, 1/r
    return SimpleNamespace(x=x, xn=xn, g=g, phi=phi, bias=bias, alpha=alpha, f=f, du=du, h_pre=h_pre, h_post=h_post,
                           h_res=h_res, lg=lg, rinv=rinv, dh=dh, dl=dl, dss=dss, w=w, st=st, hc=hc,
                           hc_dh=[torch.randn_like(h) for h in hc[1:4]])


OPS_ARGS = (20, 1e-6, True, False, 1e-6, 1e-6, 2.0)  # iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult
BWD_ARGS = (20, 1e-6, True, False, 2.0)  # iters, eps, t_in, t_out, post_mult


def _calls(k):
    """Each fused op body on the model's path (kernels + allocations, no dispatcher), and its parts."""
    bnd_bwd = (k.x, k.f, k.h_post, k.h_res, k.phi, k.bias, k.alpha, k.xn, k.lg, k.rinv, k.h_pre, k.g, k.du, *k.dh,
               *BWD_ARGS)
    return {
        "mhc_pre fwd (stack entry: coef + u)": lambda: K.mhc_pre_fwd.plain(k.x, k.phi, k.bias, k.alpha, *OPS_ARGS),
        "mhc_pre bwd (stack entry)": lambda: K.mhc_pre_bwd.plain(
            k.x, k.phi, k.bias, k.alpha, k.lg, k.rinv, k.h_pre, k.du, *k.dh, *BWD_ARGS),
        "mhc_pre bwd + dx_in (mhc_enter)": lambda: K.mhc_pre_bwd.plain(
            k.x, k.phi, k.bias, k.alpha, k.lg, k.rinv, k.h_pre, k.du, *k.dh, *BWD_ARGS, dx_in=k.g),
        "  x pass (dx + dphi + dx_in)": lambda: K.bwd_x(
            k.x, k.phi, k.dl, k.dss, torch.empty_like(k.x), h_pre=k.h_pre, du=k.du, dx_in=k.g),
        "boundary fwd (post_res + coef + u)": lambda: K.bnd_fwd.plain(
            k.x, k.f, k.h_post, k.h_res, k.phi, k.bias, k.alpha, *OPS_ARGS),
        "boundary bwd (whole op)": lambda: K.bnd_bwd.plain(*bnd_bwd),
        "  per token (<du,x_next> + Sinkhorn)": lambda: K.bwd_tok(
            k.xn, k.phi, k.bias, k.alpha, k.lg, k.rinv, *k.dh, *BWD_ARGS, du=k.du),
        "  dphi pass (x_next^T dL)": lambda: K.bwd_x(k.xn, k.phi, k.dl, k.dss),
        "  2-D pass (G, dx, df, dH, dh_post)": lambda: K._post_bwd_run(
            k.g, k.x, k.f, k.h_post, k.h_res, coef=(k.xn, k.du, k.dl, k.dss, k.h_pre, k.phi)),
        "stream_post_res fwd (stack exit)": lambda: K.post_fwd.plain(k.x, k.f, k.h_post, k.h_res),
        "stream_post_res bwd (stack exit)": lambda: K.post_bwd.plain(k.g, k.x, k.f, k.h_post, k.h_res),
        "hc_enter fwd (HC: coef + u)": lambda: K.hc_enter_fwd.plain(k.x, k.w, k.st, 1e-6, True),
        "hc_enter bwd + dx_in (HC)": lambda: K.hc_enter_bwd.plain(
            *k.hc_dh, k.du, k.x, k.w, k.st, k.hc[4], k.hc[5], k.hc[1], True, dx_in=k.g),
    }


def kernel_table(c, tokens, copy_bw):
    """Time each op body back to back so that host time hides behind the GPU. Bytes = what the op must move:
    each input read once, each output written once (a part's own inputs and outputs)."""
    k = _kernel_inputs(c, tokens, 4)
    n, m = N_STREAMS, R.mhc_logit_count(N_STREAMS)
    e, f32, N = k.x.element_size(), 4, tokens
    S, U = N * n * c * e, N * c * e  # one n-stream, one C-wide activation
    small = N * (2 * n + n * n) * f32  # h_pre, h_post, h_res
    saved = N * (m + 1) * f32  # logits, 1/r
    phi = n * c * m * e
    nbytes = {
        "mhc_pre fwd (stack entry: coef + u)": S + phi + small + saved + U,
        "mhc_pre bwd (stack entry)": S + U + phi + small + saved + S + phi,
        "mhc_pre bwd + dx_in (mhc_enter)": 2 * S + U + phi + small + saved + S + phi,
        "  x pass (dx + dphi + dx_in)": 2 * S + U + saved + N * n * f32 + phi + S,  # x, dx_in, du, dL, h_pre, phi; dx
        "boundary fwd (post_res + coef + u)": S + U + small + phi + S + U + small + saved,
        "boundary bwd (whole op)": 3 * S + 2 * U + 2 * small + saved + phi + S + U + 2 * small + phi,
        "  per token (<du,x_next> + Sinkhorn)": S + U + small + 2 * saved,
        "  dphi pass (x_next^T dL)": S + saved + phi,
        "  2-D pass (G, dx, df, dH, dh_post)": 3 * S + 2 * U + saved + small + phi + S + U + small,
        "stream_post_res fwd (stack exit)": 2 * S + U + small - N * n * f32,
        "stream_post_res bwd (stack exit)": 3 * S + 2 * U + 2 * (small - N * n * f32),
        # HC: per (token, stream) row n + 2 logits and 1/r kept, h_pre / h_post per row, H^res per token
        "hc_enter fwd (HC: coef + u)": S + U + small + N * n * (n + 3) * f32,
        "hc_enter bwd + dx_in (HC)": 2 * S + U + small + N * n * (n + 3) * f32 + S,
    }
    out = []
    for name, fn in _calls(k).items():
        ms = device_ms(fn)
        gbs = nbytes[name] / (ms * 1e-3) / 1e9
        out.append(dict(kernel=name, C=c, tokens=tokens, bytes=nbytes[name], ms=ms, wall_ms=timed_batch(fn, 20, 10),
                        gb_s=gbs, pct_copy=100 * gbs / (copy_bw * 1e3)))
    return out


# Launch configs to try (--sweep): the variants still open. The x pass and the phi pass on 16-bit parts at their
# candidate tiles (rounds 6-7: the x pass with an fp32 phi split its verdict between machines); with an fp32 phi
# (--phi-dtype fp32), the coefficient GEMM's phi_split forms and tiles. --quick tries SWEEP_QUICK at each shape (each
# keeps its own winner).
_XPASS = [(64, 128, 8, 2, 4, False), (64, 128, 8, 2, 4, True), (64, 128, 8, 3, 4, True), (64, 64, 4, 3, 8, True),
          (128, 64, 8, 2, 4, True), (32, 128, 4, 3, 8, True)]
SWEEP_QUICK = {
    name: [dict(BT=bt, BK=bk, num_warps=w, num_stages=st, programs_per_sm=pp, dl_split=sp)
           for bt, bk, w, st, pp, sp in _XPASS]
    for name in ("coef_bwd_x", "bnd_dphi")
}
# HC's tail backward with hc_enter's <du, x> loop: untimed on the GPU (round 8's reason, a spill, came from a
# kernel_resources.py compile without the launch's divisibility attributes; with them: 164 registers, no spill)
SWEEP_QUICK["hc_tail_bwd"] = [dict(BT=bt, BC=bc, num_warps=w) for bt, bc, w in
                              [(128, 64, 4), (128, 16, 4), (64, 32, 4), (32, 64, 4), (128, 64, 8)]]
if PHI_DT == torch.float32:  # an fp32 phi (the trainer's): tf32 dots at the tf32 tiles, or phi as two 16-bit parts
    SWEEP_QUICK["coef_fwd"] = [dict(phi_split=False), dict(phi_split="interleaved"), dict(phi_split="in_kernel"),
                               dict(phi_split="in_kernel", split=dict(BT=64, BK=128, num_warps=8)),
                               dict(phi_split="in_kernel", split=dict(BT=32, BK=64, num_warps=4)),
                               dict(phi_split="interleaved", split=dict(BT=32, BK=64, num_warps=4)),
                               # u in the GEMM kernel's own loop (the default until round 9: u after it, by stream_pre's
                               # kernel, took the trainer step from 82.5 to 81.3 ms)
                               dict(phi_split="interleaved", split=dict(BT=64, BK=64, num_warps=4, u_inside_max_c=4096))]

SWEEP = dict(SWEEP_QUICK, **{  # full run, at C=1024: also the kernels every path shares
    "coef_fwd": [dict(BT=bt, BK=bk, num_warps=w, num_stages=st, BC=bc, split_tail=True) for bt, bk, w, st, bc in
                 [(64, 64, 4, 3, 16), (32, 64, 4, 3, 32), (64, 128, 8, 3, 16), (16, 128, 4, 3, 64),
                  (32, 128, 4, 4, 32), (128, 32, 8, 3, 8)]]
    if PHI_DT != torch.float32 else  # the trainer's fp32 phi as 16-bit parts: the `split` tiles, Sinkhorn inside
    [dict(split=dict(BT=bt, BK=bk, num_warps=w, num_stages=st, u_inside_max_c=0, split_tail=False))
     for bt, bk, w, st in [(64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 4), (64, 128, 8, 3), (128, 64, 8, 3),
                           (32, 128, 4, 3), (64, 32, 4, 4), (128, 64, 8, 4), (32, 64, 4, 4)]]
    # Sinkhorn in its own launch after the GEMM programs (`coef_tail`): what the tail costs inside the GEMM kernel
    + [dict(split=dict(BT=bt, BK=64, num_warps=w, num_stages=4, u_inside_max_c=0, split_tail=True))
       for bt, w in [(64, 4), (32, 4), (128, 8)]]
    # deeper pipelines: more of x in flight per SM at two CTAs per SM (round 19)
    + [dict(split=dict(BT=64, BK=64, num_warps=4, num_stages=st, u_inside_max_c=0, split_tail=False))
       for st in (5, 6)],
    "bnd_bwd": [dict(BT=bt, BC=bc, num_warps=w) for bt, bc, w in
                [(16, 128, 8), (32, 64, 8), (32, 32, 4), (64, 64, 8), (32, 128, 8), (64, 32, 8), (16, 64, 8)]],
    # round 12 (device time): BT 8 at one warp 64 us, BT 4 at one warp 69, BT 8 at two warps (the old default) 81.
    # Round 14's probe (the kernel alone): 73 us, of which the Sinkhorn backward alone 18 and the <du, x_j> loop alone
    # 51 (3.3 TB/s); loop_stages pipelines that loop's loads: 64 us here at BC 128, slower in the trainer (1.85 vs 1.80
    # ms per step, profiled in one process), so this table's ranking of it does not carry over
    "coef_bwd_tok": [dict(BT=bt, num_warps=w, BC=bc, loop_stages=ls) for bt, w, bc, ls in
                     [(8, 1, 64, None), (8, 1, 64, 2), (8, 1, 64, 3), (8, 1, 64, 4), (8, 1, 128, 2), (8, 1, 128, 3),
                      (8, 2, 128, 2), (8, 2, 128, 3), (4, 1, 128, 3), (16, 2, 64, 3)]],
    # the x pass (mhc_enter's: + dx_in) by device time. Round 13: the register cap 128 at 2 stages and 8 programs per
    # SM (the default) 258 us for the whole op; uncapped 288; 12-16 programs 262-263; caps 112 / 96 269-340; 1 stage
    # 301; BT 32 301-366; 8 warps 370-473; BT 16 516. Round 14: every load of the token loop pipelined (loop_stages;
    # without it dx_in, du, h_pre and d(sum x^2) are plain loads that stall each iteration): 3 CTAs per SM at BT 64
    # (58 KB of shared memory), 4 at BT 32 (kernel_resources.py, Triton 3.6)
    "coef_bwd_x": [dict(BT=bt, BK=bk, num_warps=w, num_stages=st, programs_per_sm=pp, maxnreg=r, loop_stages=ls)
                   for bt, bk, w, st, pp, r, ls in
                   [(64, 64, 4, 2, 8, 128, None), (64, 64, 4, 2, 8, 128, 2), (64, 64, 4, 2, 12, 128, 2),
                    (64, 64, 4, 2, 8, 168, 2), (64, 64, 4, 2, 8, None, 2), (32, 64, 4, 2, 16, 128, 2),
                    (32, 64, 4, 2, 12, 128, 2), (32, 64, 4, 2, 16, 128, 3), (32, 64, 4, 2, 16, 128, None)]],
    "coef_tail": [dict(BT=bt, num_warps=w) for bt, w in [(8, 2), (4, 1), (16, 2)]],
    "post_fwd": [dict(BT=bt, BC=bc, num_warps=w) for bt, bc, w in [(4, 256, 4), (8, 256, 8), (2, 512, 4)]],
    # rows_max_c = 0: the top-level tiles at every C; the last entry is the whole-row variant (ops.CONFIG "rows")
    "post_bwd": [dict(BT=bt, BC=bc, num_warps=w, rows_max_c=0) for bt, bc, w in
                 [(4, 256, 4), (8, 128, 4), (2, 512, 4), (4, 512, 8)]]
                + [dict(rows_max_c=1 << 30, rows=dict(BT=bt, BC=1024, num_warps=w)) for bt, w in
                   [(2, 8), (1, 4), (2, 4), (4, 8), (1, 8), (4, 4)]],
})


def sweep(c, tokens, table=None):
    """Time every config of each kernel in table (default SWEEP) by device time, keep the fastest in K.CONFIG; returns
    the log."""
    k = _kernel_inputs(c, tokens, 5)
    calls = _calls(k)
    by_kernel = {  # the op (part) each config entry is timed on
        "coef_fwd": "mhc_pre fwd (stack entry: coef + u)", "coef_tail": "boundary fwd (post_res + coef + u)",
        "bnd_bwd": "  2-D pass (G, dx, df, dH, dh_post)", "bnd_dphi": "  dphi pass (x_next^T dL)",
        "coef_bwd_tok": "  per token (<du,x_next> + Sinkhorn)", "coef_bwd_x": "mhc_pre bwd + dx_in (mhc_enter)",
        "post_fwd": "stream_post_res fwd (stack exit)", "post_bwd": "stream_post_res bwd (stack exit)",
        "hc_tail_bwd": "hc_enter bwd + dx_in (HC)",
    }
    log = {}
    for name, cfgs in (table or SWEEP).items():
        res = []
        base = dict(K.CONFIG[name])  # what a config leaves out (the tf32 tiles, phi_split) stays as it was
        for cfg in cfgs:
            K.CONFIG[name] = dict(base, **cfg)
            try:
                res.append((device_ms(calls[by_kernel[name]]), cfg))
            except Exception as exc:
                print(f"  sweep {name} {cfg}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
        res.sort(key=lambda r: r[0])
        K.CONFIG[name] = dict(base, **res[0][1])
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


def host_ms(step, steps=5):
    """Median ms the host needs to issue one step (no synchronisation inside): near the step time, the GPU waits."""
    ts = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        ts.append(1e3 * (time.perf_counter() - t))
    sync()
    return statistics.median(ts)


def profile_host(step, steps=3, top=25):
    """Where the host's time per step goes: cProfile over steps, functions by own time (ms per step)."""
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    sync()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():
        rows.append(dict(function=f"{os.path.basename(file)}:{line}:{fn}", calls_per_step=ncalls / steps,
                         own_ms=1e3 * tottime / steps, cum_ms=1e3 * cumtime / steps))
    rows.sort(key=lambda r: -r["own_ms"])
    for r in rows[:top]:
        print(f"    {r['own_ms']:8.2f} ms own {r['cum_ms']:8.2f} cum  x{r['calls_per_step']:<6.0f} {r['function'][:90]}",
              flush=True)
    return rows[:60]


def graphed(model, x):
    """The model's forward and backward captured as CUDA graphs (torch.cuda.make_graphed_callables): one launch per
    direction replays every kernel, so the step no longer waits on the host."""
    return torch.cuda.make_graphed_callables(model, (x,), num_warmup_iters=3)


def profile_step(step, steps=3):
    """CUDA time per kernel name over one training step (mean of steps), largest first: where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    total, rows = time_per_name(prof, steps)
    print_rows(rows, total)
    return dict(total_us=total, top=rows[:40])


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
        # --smoke: one step each for the host time and its profile (a step takes seconds under the interpreter)
        steps = 1 if args.smoke else None
        r = dict(base, variant=name, ms=ms, peak_gib=peak_gib(), host_ms=host_ms(step, steps or 5),
                 wall_s=time.time() - t)
        if args.profile and DEV == "cuda" and "compile" not in name and not name.startswith(("liger", "lucid", "ref")):
            try:
                r["profile"] = profile_step(step)
            except Exception as exc:  # the profile is extra: never lose the timing for it
                r["profile"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if args.profile_host is not None and "compile" not in name and "cudagraph" not in name and (
                not args.profile_host or any(k.strip() in name for k in args.profile_host.split(","))):
            try:
                r["host_profile"] = profile_host(step, steps or 3)
            except Exception as exc:
                r["host_profile"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    except Exception as exc:  # a missing peer or a failed compile is reported, not fatal
        r = dict(base, variant=name, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    rows.append(r)
    print(f"  {({k: v for k, v in r.items() if k not in ('profile', 'host_profile')})}", flush=True)
    dump()
    model = None
    if DEV == "cuda":
        torch.cuda.empty_cache()


def main():
    unknown = sorted(set(args.sweep_only.split(",")) - set(SWEEP)) if args.sweep_only else []
    if unknown:  # before the ceilings and checks run
        p.error(f"--sweep-only: {', '.join(unknown)} not in the sweep table; allowed: {', '.join(SWEEP)}")
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, python=sys.version.split()[0], command=" ".join(sys.argv))
    if args.config:
        with open(args.config) as fh:
            K.CONFIG.update(json.load(fh)["config"])
    if args.only_op:
        calls = _calls(_kernel_inputs(*KERNEL_SHAPE, 4))
        name = next(k for k in calls if args.only_op in k)
        for _ in range(20):
            calls[name]()
        sync()
        print("ran", name, "x20")
        return
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
    L_R.update({"1": 4, "2": 3})  # L_r* of docs/design.md §9 for 24 and 16 sublayers at n = 4
    if args.smoke:
        shapes = {"1": (64, 4, 1, 2, 16), "2": (96, 4, 1, 1, 24)}
    rows, checks, kernels = [], {}, []
    STATE.update(info=info, checks=checks, stack=rows, kernels=kernels)
    STATE["sweep"] = {}
    if args.sweep and not args.quick:
        only = args.sweep_only and args.sweep_only.split(",")
        STATE["sweep"] = sweep(*KERNEL_SHAPE, {k: SWEEP[k] for k in only} if only else None)
        if only:
            print("wrote", dump())
            return
    for key in args.shapes.split(","):
        c, heads, blocks, b, t = shapes[key]
        print(f"== C={c} sublayers={2 * blocks} B={b} T={t}", flush=True)
        if args.sweep and args.quick:  # per shape: the winners (CONFIG) then apply to this shape's stack
            STATE["sweep"][f"C{c}"] = sweep(c, b * t if not args.smoke else 40, SWEEP_QUICK)
            STATE.setdefault("config_per_shape", {})[f"C{c}"] = copy.deepcopy(K.CONFIG)
        checks[f"C{c}_ops"] = check_ops(c, min(b * t, 4096))
        checks[f"C{c}_stack"] = check_stack(c, heads, min(blocks, 2), 1, min(t, 512))
        checks[f"C{c}_stack_per_sublayer"] = check_stack(c, heads, min(blocks, 2), 1, min(t, 512), chained=False)
        print("  checks", {k: v for k, v in checks.items() if k.startswith(f"C{c}_")}, flush=True)
        if not args.no_kernels:
            kernels += kernel_table(c, b * t, bw)
        x = torch.randn(b, t, c, device=DEV, dtype=DT)
        base = dict(C=c, sublayers=2 * blocks, B=b, T=t, n=N_STREAMS)
        variants = [  # most important first: the time budget cuts from the end
            ("residual", lambda: Residual(c, heads, blocks).to(DEV, DT)),
            ("ours (fused)", lambda: hyper(c, heads, blocks, "triton")),
            ("residual+compile", lambda: torch.compile(Residual(c, heads, blocks).to(DEV, DT))),
            ("ours (fused)+compile", lambda: torch.compile(hyper(c, heads, blocks, "triton"))),
            ("ours (per-sublayer ops)", lambda: hyper(c, heads, blocks, "triton", chained=False)),
            ("ours (per-sublayer, dx summed)", lambda: SummedDx(hyper(c, heads, blocks, "triton", chained=False))),
            ("ours (per-sublayer ops)+compile",
             lambda: torch.compile(hyper(c, heads, blocks, "triton", chained=False))),
            ("residual+cudagraph", lambda: graphed(Residual(c, heads, blocks).to(DEV, DT), x)),
            ("ours (fused)+cudagraph", lambda: graphed(hyper(c, heads, blocks, "triton"), x)),
            ("ours (per-sublayer ops)+cudagraph",
             lambda: graphed(hyper(c, heads, blocks, "triton", chained=False), x)),
            ("ours (per-sublayer, dx summed)+cudagraph",
             lambda: graphed(SummedDx(hyper(c, heads, blocks, "triton", chained=False)), x)),
            (f"ours+compile, recompute L_r={L_R[key]}",
             lambda: torch.compile(hyper(c, heads, blocks, "triton", recompute=L_R[key]))),
            (f"ours, recompute L_r={L_R[key]}", lambda: hyper(c, heads, blocks, "triton", recompute=L_R[key])),
            ("ours (u rebuilt)", lambda: hyper(c, heads, blocks, "triton", rebuild=True)),
            ("hc (hc_enter + write-back)",
             lambda: hyper(c, heads, blocks, "triton", chained=False, mode="hc")),
            ("liger 0.8.5", lambda: Liger(c, heads, blocks).to(DEV, DT)),
            ("reference ops", lambda: hyper(c, heads, blocks, "torch")),
            ("lucidrains 0.4.11", lambda: Lucid(c, heads, blocks).to(DEV, DT)),
        ]
        if args.ref_compile and key == "1":  # minutes of compile: first shape only, as the peer harness
            variants.append(("reference ops+compile", lambda: torch.compile(hyper(c, heads, blocks, "torch"))))
        if args.smoke:
            variants = [v for v in variants if not any(k in v[0] for k in ("compile", "cudagraph", "liger", "lucid"))]
        if args.quick:
            variants = [v for v in variants if v[0] in ("residual", "ours (fused)", "ours (per-sublayer ops)",
                                                        "ours (per-sublayer, dx summed)")]
        if args.variants:
            keep = [k.strip() for k in args.variants.split(",")]
            variants = [v for v in variants if v[0] == "residual" or any(k in v[0] for k in keep)]
        if args.skip:
            drop = [k.strip() for k in args.skip.split(",")]
            variants = [v for v in variants if v[0] == "residual" or not any(k in v[0] for k in drop)]
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
            if "residual+cudagraph" in ref:
                r["x_residual_cudagraph"] = r["ms"] / ref["residual+cudagraph"]["ms"]
    path = dump()
    print(f"\n{info['gpu']}  torch {info['torch']}  triton {info.get('triton')}  copy {bw:.2f} TB/s  bf16 mm {mm:.0f} TFLOP/s")
    print(f"{'C':>5} {'variant':<38} {'ms/step':>8} {'host ms':>8} {'x resid':>8} {'x res.comp':>10} {'x res.graph':>11} "
          f"{'peak GiB':>9} {'x peak':>7}")
    for r in rows:
        if "ms" in r:
            nan = float("nan")
            print(f"{r['C']:>5} {r['variant']:<38} {r['ms']:8.1f} {r.get('host_ms', nan):8.1f} {r.get('x_residual', nan):8.3f} "
                  f"{r.get('x_residual_compiled', nan):10.3f} {r.get('x_residual_cudagraph', nan):11.3f} "
                  f"{r['peak_gib']:9.2f} {r.get('x_residual_peak', nan):7.2f}")
        else:
            print(f"{r['C']:>5} {r['variant']:<38} {r.get('error', r.get('skipped'))}")
    if kernels:
        # us: the kernels' device time per call (GB/s and % of copy from it); wall us: back-to-back calls, which
        # include the host's time where it is the longer one
        print(f"\n{'kernel':<38} {'C':>5} {'MB moved':>9} {'us':>8} {'wall us':>8} {'GB/s':>7} {'% copy':>7}")
        for k in kernels:
            print(f"{k['kernel']:<38} {k['C']:>5} {k['bytes'] / 1e6:9.1f} {1e3 * k['ms']:8.1f} "
                  f"{1e3 * k['wall_ms']:8.1f} {k['gb_s']:7.0f} {k['pct_copy']:7.1f}")
    print("checks:", json.dumps(checks))
    print("mHC wrapper:", WRAPPER)
    print("wrote", path)


if __name__ == "__main__":
    main()
