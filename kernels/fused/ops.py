"""torch.library custom ops around the fused kernels, with fake (meta) impls and autograd.

Each op is opaque to torch.compile (fullgraph, no graph break); its fake impl gives shapes that are
symbolic in the token count N, and the Triton kernels take N as a runtime argument
(`do_not_specialize`), so a new batch or sequence length neither re-traces nor re-JITs.
Ops work on flattened [N, n, C] streams; the public wrappers in `__init__.py` reshape and fall back
to the reference for what the kernels do not cover.
"""
import functools
import json
import os
import weakref
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch

from . import coefficients, parameters, rope, stream_ends, stream_post_res, stream_pre
from .coefficients import DOT_IEEE, DOT_NATIVE, DOT_TF32
from .launch import Launcher, descriptor

Tensor = torch.Tensor
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this: outputs start as NaN, so any element a kernel fails to write fails the comparison.
POISON = False

# Launch parameters per kernel, chosen by `bench/bench_mhc.py --sweep` on an H200 (the timings behind each choice:
# docs/kernels.md, "Launch configs"). The benchmark may override them. Tiles shrink to the problem size.
CONFIG = {
    # BK: tile of the flat n*C row in the GEMM loop; BC: C tile of the fused pre op's u loop, BT * BC <= 1024 (larger
    # u tiles spill at BT = 64). split_tail: Sinkhorn in its own launch (`coef_tail`) after the GEMM programs.
    # phi_split: an fp32 phi (the trainer's) as two 16-bit parts (ops._projection), 16 mantissa bits: "interleaved"
    # (one dot on [K, 2M] hi / lo pairs; `split` tiles), "dots" (one dot per part) or false (tf32, `tf32` tiles). The
    # whole mhc_pre forward, round 7: 185 us interleaved, 217 tf32, 220 dots; trainer kernels per step 79.3 vs 80.7 ms.
    # u_inside_max_c: up to this C, u is summed in the GEMM kernel's own loop (re-reading its token block); above it,
    # stream_pre's streaming kernel computes u after the GEMM (round 6: 161 vs 186 us at C = 1024, 212 vs 184 at
    # C = 2048; with an fp32 phi 280 vs 208 at C = 1024). With phi as 16-bit parts (`split`, the trainer's) u comes
    # after the GEMM too: trainer step 81.2 / 81.4 vs 82.5 / 82.4 ms, alternating runs (round 9, docs/benchmarks.md).
    # tf32: the tiles with an fp32 phi as tf32 (phi_split false); BK = 128 at 8 warps needs 80 KiB of shared memory
    # (kernel_resources.py under Triton 3.6, round 11).
    # split (phi as 16-bit parts, the trainer's): Sinkhorn in the GEMM kernel; its own launch tied on GPU time in the
    # trainer (78.05 vs 78.29 and 79.24 vs 79.11 ms of kernels per step, round 10) and costs a launch per sublayer of
    # host time (19-35 us each on the H200's host, round 11, docs/benchmarks.md); 4 stages: 1.27 vs 1.40 ms of kernel
    # per trainer step (round 12); 5 stages (more of x in flight at two CTAs per SM): 1.144 vs 1.177 ms per trainer
    # step, 85.4 vs 86.4 us for the whole mhc_pre forward in the sweep (round 19)
    "coef_fwd": dict(BT=64, BK=128, num_warps=8, num_stages=3, BC=16, split_tail=True, phi_split="interleaved",
                     u_inside_max_c=1024, tf32=dict(BT=128, BK=64, num_warps=4, u_inside_max_c=0),
                     split=dict(BT=64, BK=64, num_warps=4, num_stages=5, u_inside_max_c=0, split_tail=False)),
    # HC's projection (`_coef_fwd`, one stream per row, K = C, no tail; with HC's tail in `hc_coef` / `hc_enter`).
    # Round 31, the HC trainer profiled (one run per tile): BT 128 at 8 warps, 3 stages, 50.5 us per call against 57.1
    # for round 5's BT 64 at 4 warps (65 against 58 % of copy; 512 programs, all resident at 4 CTAs per SM); BT 64 at
    # BK 128 55.7, at 2 stages 61.3, at BK 32 65.2; BT 32 138 (docs/benchmarks.md)
    "rms_proj": dict(BT=128, BK=64, num_warps=8, num_stages=3),
    # HC's tail backward (`_hc_tail_bwd`, per row, a few floats each; BC: C tile of hc_enter's <du, x_i>): not swept
    "hc_tail_bwd": dict(BT=128, num_warps=4, BC=64),
    "coef_tail": dict(BT=8, num_warps=2),
    # BC: C tile of the <du, x_j> loop (fused pre and boundary ops). One warp: the Sinkhorn tiles' reductions stay in
    # shuffles. Round 12 (device time, fp32 phi, C = 1024): BT 8 at one warp 64 us, BT 4 69, the old BT 8 at two warps
    # 81; BT 4 doubles the partial rows param_sum sums in one program (0.26 -> 0.48 ms per trainer step), and a loop
    # over token blocks per program to keep them (75-107 us) lost more than it saved (docs/benchmarks.md)
    # loop_stages: the software-pipelining depth of the <du, x_j> loop (tl.range num_stages: its loads become async
    # copies into shared memory; None: Triton's default, which pipelines only loads that feed a dot, none here).
    # Round 14: timed alone (the sweep), 2 stages at BC 128 took 64 us against 79 unpipelined; in the trainer, profiled
    # in one process, 1.85 ms per step against 1.80: unpipelined kept (docs/benchmarks.md)
    # interleave: odd programs run the Sinkhorn backward (18 of the kernel's 73 us alone, round 14's probe) before the
    # <du, x_j> loop (51 us alone) and even ones after it, for an SM's programs to overlap the two. Round 16, in the
    # trainer, profiled in one process: 1.836 ms per step against 1.813 in order: off (docs/benchmarks.md)
    # Round 24: the res logits' part as its own kernel on a side stream, launched by the write-back's backward and run
    # beside the branch's: this kernel 49.1 against 66.1 us per call, but the side kernel (42.5 us per call) slowed
    # the branch's GEMMs as much or more: backward device time 40.2-40.5 / 40.5-40.9 against 39.9-40.6 / 39.8-40.1 ms
    # per step in two calls, dropped
    # BT 4 since round 17, when param_sum came to sum the partial rows one program per element: in the trainer,
    # profiled in one process, 1.688 vs 1.828 ms per step at BT 8, param_sum 0.135 vs 0.123 (round 16's serial sum
    # had taken BT 4's twice as many rows from 0.285 to 0.484 ms)
    "coef_bwd_tok": dict(BT=4, num_warps=1, BC=64, loop_stages=None, interleave=False),
    # dl_split: with bf16 x, the two dots on 16-bit parts of dL and phi (_coef_bwd_x SPLIT) instead of tf32 on fp32
    # copies (round 6 ncu of the tf32 version: 176 registers, 49 KB of shared memory, one CTA per SM). The smaller
    # tiles it affords: mhc_pre bwd 276-280 vs 384 us (tf32 at BT 64, BK 128, 8 warps), 322 vs 370 with an fp32
    # phi; the phi-gradient pass 57-59 vs 79-81 us (round 6 sweep, docs/kernels.md)
    # maxnreg: a register cap. Uncapped the x pass took 187 registers, two CTAs per SM (round 11's ncu); capped at 128
    # with 2 stages: mhc_enter bwd 258 vs 288 us (device time), trainer _coef_bwd_x 4.14 vs 4.77 ms per step, step
    # medians 78.3 / 78.5 vs 79.4 ms (round 13, docs/benchmarks.md)
    # loop_stages: pipeline every load of the token loop (dx_in, du, h_pre, d(sum x^2) too: without it only x and dL,
    # the dots' operands, are async copies and the others stall each iteration). 58 KB of shared memory: 3 CTAs per
    # SM. Round 14: 240 us at 12 programs per SM, 248 at 8, unpipelined 246 (the sweep); in the trainer, profiled in
    # one process, 3.95-3.98 ms per step against 4.01 (docs/benchmarks.md)
    # dphi_first: the phi-gradient dots before dx's in the token loop (round 18): 49.7 KB of shared memory instead of
    # 57.9 with an fp32 phi, so 4 CTAs per SM instead of 3 (kernel_resources.py, Triton 3.6); in the trainer, profiled
    # in one process, 3.77 vs 3.97 ms per step (16 programs per SM: 3.78)
    # tma: x, dL, dx_in, du and dx tiles by TMA descriptor (no per-thread addresses or masks in the token loop, no
    # spill at the register cap). Round 22, the trainer profiled in one process: 128.0 vs 157.1 us per call (82 vs
    # 67 % of copy), 3.07 vs 3.77 ms per step; BT 32 with 3 stages 178 us, BT 32 capped at 96 registers 191
    "coef_bwd_x": dict(BT=64, BK=64, num_warps=4, num_stages=2, programs_per_sm=12, dl_split=True, maxnreg=128,
                       loop_stages=2, dphi_first=True, tma=True),
    # the same kernel on HC's one-stream rows (`hc_enter`, `rms_proj`'s backward: K = C). The cap as mHC's, timed on
    # HC's trainer row (round 14, one process): steps 79.7 vs 80.3 ms (medians), 80.0 vs 83.1 (means) uncapped
    "hc_bwd_x": dict(BT=64, BK=64, num_warps=4, num_stages=2, programs_per_sm=8, dl_split=True, maxnreg=128,
                     loop_stages=None, dphi_first=True),
    # without dx: BK = 128 at 8 warps was the fastest in all four sweeps of round 7 (50-54 vs 56-66 us)
    "bnd_dphi": dict(BT=64, BK=128, num_warps=8, num_stages=2, programs_per_sm=4, dl_split=True, loop_stages=None,
                     dphi_first=True, tma=False),
    "pre_fwd": dict(BT=4, BC=512, num_warps=4),
    "pre_bwd": dict(BT=4, BC=256, num_warps=4),
    "post_fwd": dict(BT=4, BC=256, num_warps=4),
    # the forward's grid (token block x C block), no C loop; per-C-block partials of dH / dh_post summed
    # afterwards (BC >= C: whole rows, written directly). rows: the tiles up to C = rows_max_c, whole rows (no
    # partials, no summing launch): trainer kernels 78.01 vs 78.05 ms per step (round 10), one launch and two
    # allocations less per sublayer of host time (round 11); one row per program at 4 warps: 3.21 vs 3.38 ms per step
    # (BT 2 at 8 warps; round 12)
    # loop_stages > 0: programs_per_sm programs per SM, each walking token blocks in a loop pipelined that deep
    # (_post_bwd_2d LOOP_STAGES: the next rows' loads in flight while this one is reduced and stored); 0: one program
    # per token block. The rows tiles since round 23, the trainer profiled in one process: 120.1 us per call at 2
    # stages and 7 programs per SM (72 registers, 18.6 KB shared: all 7 resident), 125.1 at 3 stages and 6, against
    # 135.1 one row per program (94 / 91 / 84 % of copy; docs/benchmarks.md). The partials' tiles (C > rows_max_c):
    # not timed, unlooped. u_programs_per_sm: with u written on request (HyperConfig.rebuild_branch_input) the rows
    # tile takes 96 registers (Triton 3.6, sm_90): 5 CTAs per SM resident
    "post_bwd": dict(BT=4, BC=256, num_warps=4, rows_max_c=1024, loop_stages=0, programs_per_sm=8, u_programs_per_sm=8,
                     rows=dict(BT=1, BC=1024, num_warps=4, loop_stages=2, programs_per_sm=7, u_programs_per_sm=5)),
    # post_bwd with COEF (the boundary op's dx pass); BT >= 16 for tl.dot. dl_split: dL phi^T on 16-bit parts as in
    # coef_bwd_x (tested against float64), off: 351 vs 346 us with a bf16 phi, 437 vs 354 with fp32 (round 7 sweeps).
    # xpass: the boundary's backward by the per-sublayer wiring's kernels instead (the x pass writes x_next's whole
    # gradient, the write-back's backward reads it): the same kernels and bytes as one sublayer at a time. Round 25,
    # the chained trainer profiled in one process: the 2-D pass 304.6 us per call (+ 45.3 for the phi-gradient pass)
    # against 128.8 + 120.5 for the x pass and the write-back's; BC 64 at 4 warps 350.1, BT 32 346.4 (128 registers at
    # 8 warps: 2 CTAs per SM). Its token blocks walked in post_bwd's pipelined loop (2 stages, 2 programs per SM, round
    # 26): 503.8 us per call, so the 2-D pass keeps one token block per program
    "bnd_bwd": dict(BT=16, BC=128, num_warps=8, dl_split=False, xpass=True),
    # The boundary's forward stays two kernels (`_post_fwd` writes x_next, `_coef_fwd` reads it back). In one pass it
    # was slower twice (docs/benchmarks.md): round 25's [BT, n, BC] tile 320 us per call, round 29's per-stream 2-D
    # tiles with a dot per stream 174.7 us (208 registers at BC 16, 42 % of copy), against 75.8 + 48.0 us
    # the per-sublayer parameter passes (kernels/fused/parameters.py): BL elements per program, BP partial rows per
    # step of the vectors' program; not swept (a few microseconds each)
    "param_sum": dict(BL=256, BP=256, num_warps=4),
    # HC's nine parameters made into the kernels' operands inside the eager hc_enter (`_hc_operands`, and their
    # gradients `_hc_operand_grads`): BR channels per program. fold false: the torch composition builds them outside
    # the op (autograd nodes each way; the A/B). Under torch.compile the composition always runs (inductor fuses it)
    "hc_operands": dict(BR=128, num_warps=4, fold=True),
    # RoPE on the qkv projection (kernels/fused/rope.py): BR rows (tokens) per program, one head of q, k (or v) each;
    # not swept (memory-bound elementwise passes). fused false: the reference's torch ops in eager mode too (the A/B)
    "rope": dict(BR=64, num_warps=4, fused=True),
    # the stream's ends (kernels/fused/stream_ends.py: the embedding into n streams, their sum before the final norm,
    # and each one's backward): BT rows, BC channels per program; not swept (copies). fused false: torch's ops (the A/B;
    # round 18, the trainer profiled in one process: 0.20 ms of kernels per step against about 0.61)
    "stream_ends": dict(BT=4, BC=512, num_warps=4, fused=True),
    # under torch.compile, route: the enter ops hand the write-back's gradient of x to their own x pass (`Routed`);
    # false: x itself is handed on and inductor sums the two gradients (the A/B of round 12's change)
    "enter": dict(route=True),
    # branch_dtype: the enter and boundary ops write u in the dtype its branch takes (fp32 under bf16-mixed: the
    # branch's pre-norm runs in its parameters' dtype, model/hyper_connection.py), rounded to the stream's dtype first,
    # so its values are those of torch's cast after the op; the per-token backward pass rounds the wider du back and
    # hands the x pass that copy. Outside torch.compile this replaces the cast each way (a kernel of 3 C-vectors per
    # token each, and a launch) by one wider write of u and, in the backward, a wider read of du plus a narrow write.
    # false: u in the stream's dtype and torch's cast after the op (the A/B). Under torch.compile inductor fuses that
    # cast into the norm, so the ops always return u in the stream's dtype there
    "u": dict(branch_dtype=True),
    # fast: launches skip Triton's per-call path after a kernel's first call with the same arguments' key
    # (kernels/fused/launch.py); false: every launch takes Triton's path (the A/B; docs/kernels.md). c_apply: the
    # eager Functions entered by autograd's C++ apply, without Function.apply's generic Python wrapper (`_eager_fn`);
    # false: Function.apply (the A/B)
    "launch": dict(fast=True, c_apply=True),
}


def _launcher(fn) -> Launcher:
    return Launcher(fn, enabled=lambda: CONFIG["launch"]["fast"])


# Every kernel as this module launches it (`_post_fwd[grid](...)`): through `Launcher` (kernels/fused/launch.py)
_coef_bwd_tok, _coef_bwd_x, _coef_fwd, _coef_tail, _hc_tail_bwd = map(_launcher, (
    coefficients._coef_bwd_tok, coefficients._coef_bwd_x, coefficients._coef_fwd, coefficients._coef_tail,
    coefficients._hc_tail_bwd))
_hc_operand_grads, _hc_operands, _param_grad_sum, _phi_pairs = map(_launcher, (
    parameters._hc_operand_grads, parameters._hc_operands, parameters._param_grad_sum, parameters._phi_pairs))
_post_bwd_2d, _post_fwd = map(_launcher, (stream_post_res._post_bwd_2d, stream_post_res._post_fwd))
_pre_bwd, _pre_fwd = map(_launcher, (stream_pre._pre_bwd, stream_pre._pre_fwd))
_rope_bwd, _rope_fwd = map(_launcher, (rope._rope_bwd, rope._rope_fwd))
_expand, _sum_streams = map(_launcher, (stream_ends._expand, stream_ends._sum_streams))

# CONFIG coef_fwd phi_split -> _coef_fwd's SPLIT (true: "dots", as before "interleaved" existed)
PHI_SPLITS = {False: 0, True: 1, "dots": 1, "interleaved": 2, "in_kernel": 3}
# The host-interleaved pairs up to this padded width M (n <= 4: M = 24, a 64-wide pair tile). At n = 8 (M = 80, a
# 256-wide pair tile) they fail the float64 checks on the H200 (mhc_enter's x_next, mhc_pre's u; round 8, the
# interpreter passes), while the same tile with the pairs made in the kernel passes them all: wider tiles take
# "in_kernel" (round 7 took tf32 there).
SPLIT_MAX_MP = 32


def _apply_overrides(text: str) -> None:
    """MHC_KERNEL_CONFIG, a JSON object {kernel: {key: value}}, merged into CONFIG at import: a launch config tried in
    a whole training run (bench/bench_ddp.py) without editing this file, e.g. '{"coef_fwd": {"phi_split": true}}'.
    A nested entry (coef_fwd's tf32 tiles) is merged key by key. Only the kernels and keys CONFIG has are accepted."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"MHC_KERNEL_CONFIG is not JSON ({exc.msg}); expected e.g. "
                         '\'{"coef_fwd": {"phi_split": true}}\'') from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError("MHC_KERNEL_CONFIG must be an object of objects, {kernel: {key: value}}")
    _merge_config(data)


def _merge_config(data: dict) -> None:
    """{kernel: {key: value}} into CONFIG, checked as MHC_KERNEL_CONFIG is (its errors name it)."""
    for name, changes in data.items():
        if name not in CONFIG:
            raise ValueError(f"MHC_KERNEL_CONFIG: unknown kernel {name!r}; allowed: {', '.join(CONFIG)}")
        for key, value in changes.items():
            if key not in CONFIG[name]:
                raise ValueError(f"MHC_KERNEL_CONFIG.{name}: unknown key {key!r}; allowed: {', '.join(CONFIG[name])}")
            if key == "phi_split" and (not isinstance(value, (bool, str)) or value not in PHI_SPLITS):
                raise ValueError(f"MHC_KERNEL_CONFIG.{name}.phi_split: {value!r}; allowed: false, true, \"dots\", "
                                 '"interleaved", "in_kernel"')
            old = CONFIG[name][key]
            CONFIG[name][key] = dict(old, **value) if isinstance(old, dict) and isinstance(value, dict) else value


# Under the Triton interpreter (the CPU tests, bench smoke runs) a kernel's programs run one after another in Python, so
# the GPU's small token tiles cost their number of programs in interpreter time (one token per program in post_bwd's
# rows tile): 32 tokens per program there, so that the op tests' 37 and 38 tokens still take two programs, the second
# one ragged (round 34: 16 -> 32 took the kernel and model tests' CPU time down 10 %). Tests of a particular tile set it
# themselves; the GPU keeps CONFIG's tiles.
INTERPRETER_TILES = {"post_bwd": dict(BT=32, rows=dict(BT=32)), "coef_bwd_tok": dict(BT=32), "pre_fwd": dict(BT=32),
                     "pre_bwd": dict(BT=32), "post_fwd": dict(BT=32), "coef_tail": dict(BT=32),
                     "stream_ends": dict(BT=32)}
if INTERPRET:
    _merge_config(INTERPRETER_TILES)
if os.environ.get("MHC_KERNEL_CONFIG"):
    _apply_overrides(os.environ["MHC_KERNEL_CONFIG"])


def _new(shape, dtype, device) -> Tensor:
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _like(t: Tensor) -> Tensor:
    """A fake impl's output for a tensor the op allocates itself: contiguous whatever t's strides (a transposed
    h_res, as HC passes, must not give its strides to dH: compiled graphs assert the fake strides)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _cfg(name: str, variant: Optional[str] = None, **limits) -> dict:
    """CONFIG[name] with its sub-entry `variant` merged in (coef_fwd's tiles for a tf32 dot, whose fp32 operand tiles
    need more registers and shared memory, or for phi as 16-bit parts, whose dot is twice as wide)."""
    cfg = dict(CONFIG[name])
    if variant:
        cfg.update(cfg.get(variant, {}))
    for k, cap in limits.items():  # never tile wider than the problem (powers of 2, dot needs >= 16)
        if k in cfg:
            cfg[k] = min(cfg[k], cap)
    return cfg


def _launch(cfg: dict) -> dict:
    # maxnreg: a register cap per thread (ptx .maxnreg) for an occupancy that registers would otherwise forbid
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages", "maxnreg") and v is not None}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def _np2(v: int, lo: int = 1) -> int:
    return max(lo, _next_pow2(v))


def _phi_rows_cap(n: int, m: int) -> int:
    """Most C columns per stream whose phi rows [n * cols, M] one program stages for a dot: <= 64 KiB as fp32 (a
    larger operand spills or outgrows shared memory at n = 8, where M = 80)."""
    cap = (1 << 16) // (n * _np2(m, 16) * 4)
    return max(16, 1 << (cap.bit_length() - 1))


def _native() -> int:
    """Native 16-bit dots, never under the interpreter: its bf16 dot is wrong in triton 3.9; there fp32 dots on the
    same 16-bit values give the same exact products."""
    return DOT_IEEE if INTERPRET else DOT_NATIVE


def _phi_split(phi: Tensor) -> int:
    """`_coef_fwd`'s SPLIT for an fp32 phi beside 16-bit activations (CONFIG coef_fwd phi_split)."""
    split = PHI_SPLITS[CONFIG["coef_fwd"].get("phi_split", False)]
    if split == 2 and _np2(phi.shape[1], 16) > SPLIT_MAX_MP:
        split = 3  # wider pair tiles: the pairs made in the kernel (see SPLIT_MAX_MP)
    return split


def _takes_pairs(x_dtype: torch.dtype, phi: Tensor) -> bool:
    """True when `_projection` hands `_coef_fwd` phi as interleaved 16-bit pairs in x's dtype (made by `_phi_pairs`,
    or beforehand by `_hc_operands`)."""
    return x_dtype != torch.float32 and phi.dtype == torch.float32 and _phi_split(phi) == 2


def _projection(x: Tensor, phi: Tensor, pairs: Optional[Tensor] = None) -> tuple[Tensor, Tensor, int, int]:
    """(phi, its hi part or the interleaved parts; its lo part; DOT; SPLIT) for `_coef_fwd`'s GEMM x phi (the
    coefficients, HC's rms_proj). pairs: phi's interleaved parts when the caller made them already."""
    if x.dtype == torch.float32:
        return phi, phi, DOT_IEEE, 0  # fp32 activations: full-precision products (the fp32 test tier)
    native = _native()
    if phi.dtype == x.dtype:
        return phi, phi, native, 0
    split = _phi_split(phi)
    if phi.dtype == torch.float32 and split:
        # fp32 phi (the trainer's parameters under bf16-mixed) as hi + lo in x's dtype, native dots: at least the
        # paper's tf32 precision
        if split == 3:
            return phi, phi, native, 3  # the kernel makes the pairs from the fp32 tiles it loads
        if split == 2:
            pairs = _phi_pairs_of(phi, x.dtype) if pairs is None else pairs
            return pairs, pairs, native, 2
        hi = phi.to(x.dtype)
        return hi, (phi - hi).to(x.dtype), native, 1
    return phi, phi, DOT_TF32, 0  # bf16 x is exact in tf32; phi goes in as tf32 (the paper's precision)


def _phi_pairs_of(phi: Tensor, dtype: torch.dtype) -> Tensor:
    """phi [K, M] fp32 -> [K, 2M] in dtype, hi and lo = phi - hi of column j at columns 2j, 2j + 1 (one launch)."""
    phi = phi.contiguous()
    pairs = _new((phi.shape[0], 2 * phi.shape[1]), dtype, phi.device)
    cfg = CONFIG["param_sum"]
    _phi_pairs[(_cdiv(phi.numel(), cfg["BL"]),)](phi, pairs, phi.numel(), BL=cfg["BL"], **_launch(cfg))
    return pairs


def _sum_partials(wpart: Tensor, dw: Tensor, vpart: Optional[Tensor] = None, da: Optional[Tensor] = None,
                  db: Optional[Tensor] = None, wpart2: Optional[Tensor] = None, dw2: Optional[Tensor] = None) -> None:
    """One launch (`_param_grad_sum`): dw = wpart [S, *dw.shape] summed over S (and dw2 from wpart2 likewise); with
    vpart [PW, P] also its row sums, the first da.numel() into da and the rest into db (when given)."""
    cfg = CONFIG["param_sum"]
    l1, l2 = dw.numel(), 0 if dw2 is None else dw2.numel()
    programs = _cdiv(l1, cfg["BL"]) + _cdiv(l2, cfg["BL"])
    has_v = vpart is not None
    if not has_v:
        vpart, da, db, a = wpart, dw, dw, 0  # no vector program is launched
    else:
        programs += vpart.shape[0]  # one per vector element
        a = da.numel()
        db = da if db is None else db
    s2 = 1 if wpart2 is None else wpart2.shape[0]
    _param_grad_sum[(programs,)](
        wpart, dw, wpart.shape[0], l1, wpart if wpart2 is None else wpart2, dw if dw2 is None else dw2, s2, l2,
        vpart, da, db, vpart.shape[1], HAS_W2=dw2 is not None, HAS_V=has_v, A=a, BL=cfg["BL"],
        BS=min(16, _np2(max(wpart.shape[0], s2))), BP=cfg["BP"], **_launch(cfg))


def _grad_dots(x_dtype: torch.dtype, phi_dtype: torch.dtype, cfg: dict) -> dict:
    """DOT, SPLIT and PHI_LO of a gradient pass with dL phi^T (and x^T dL) dots: with bf16 x and the entry's
    "dl_split", dL and phi as bf16 parts in native dots; fp16 x keeps tf32 dots (dL's range does not fit fp16 parts),
    fp32 x full fp32 ones."""
    split = x_dtype == torch.bfloat16 and bool(cfg.get("dl_split"))
    dot = DOT_IEEE if x_dtype == torch.float32 else _native() if split else DOT_TF32
    return dict(DOT=dot, SPLIT=split, PHI_LO=split and phi_dtype != torch.bfloat16)


def _rows(x: Tensor) -> Tensor:
    """[N, n, C] with each token's n*C values contiguous (the coefficient GEMM reads rows of n*C)."""
    c = x.shape[2]
    return x if (x.stride(2) == 1 and x.stride(1) == c) or x.shape[0] == 0 else x.contiguous()


def _c_contig(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _sms(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 1


def _op(name: str, body):
    """Register body as the custom op mhc_lightning::name (what torch.compile sees); keep body for the eager path."""
    op = torch.library.custom_op(f"mhc_lightning::{name}", body, mutates_args=())
    op.plain = body
    return op


def _impl(ctx, op):
    """In a backward: the custom op when autograd recorded the op (compiled graphs), its body when recorded by the
    eager path (see `eager` at the end of this file)."""
    return op.plain if getattr(ctx, "eager", False) else op


class Routed(NamedTuple):
    """x as `mhc_enter` / `hc_enter` hand it to the sublayer's write-back under torch.compile, where an op may not
    return an alias of its input: x itself, and `route`, an output of the enter op with x's shape and no storage
    (one broadcast element). The write-back reads x and returns its gradient of x as route's, so that it reaches
    the enter op's backward, whose x pass adds it into the one dx it writes (`ACC`, as eager's alias does) instead
    of inductor summing two stream-sized gradients (docs/kernels.md, "How the model calls them")."""
    x: Tensor
    route: Tensor


def _route_of(x: Tensor) -> Tensor:
    return x.new_empty((1, 1, 1)).expand(x.shape)


def _register_routed(op, setup, backward) -> None:
    """Autograd of a routed enter op (its outputs: the plain op's, then the route): the plain op's setup and backward,
    the route's gradient given to the backward as the write-back's gradient of x (contiguous for the x pass; a zero
    gradient materialised for the storage-less route would not be)."""
    def routed_backward(ctx, *grads):
        *grads, d_route = grads
        return backward(ctx, *grads, dx_next=None if d_route is None else d_route.contiguous())

    op.register_autograd(routed_backward, setup_context=lambda ctx, inputs, output: setup(ctx, inputs, output[:-1]))


# ---------------------------------------------------------------------------------------------------------------
# coefficients
# ---------------------------------------------------------------------------------------------------------------
def _fwd(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, with_u, u_dtype=None):
    """Coefficients (and u = sum_j h_pre_j x_j when with_u, in u_dtype or x's) in one launch, plus the optional split
    tail. Returns (u or None, h_pre, h_post, h_res, logits, 1/r)."""
    N, n, C = x.shape
    M = phi.shape[1]
    has_res = M == n * n + 2 * n
    dev = x.device
    h_pre, h_post = _new((N, n), torch.float32, dev), _new((N, n), torch.float32, dev)
    h_res = _new((N, n, n) if has_res else (N, 0, 0), torch.float32, dev)
    lg, rinv = _new((N, M), torch.float32, dev), _new((N,), torch.float32, dev)
    u = _new((N, C), u_dtype or x.dtype, dev) if with_u else None
    if N == 0:
        return u, h_pre, h_post, h_res, lg, rinv
    x, phi = _rows(x), _c_contig(phi)
    phi, phi_lo, dot, two = _projection(x, phi)
    cfg = _cfg("coef_fwd", "tf32" if dot == DOT_TF32 else "split" if two else None, BK=_np2(n * C, 16),
               BC=_np2(C, 16))
    bias, alpha = bias.contiguous(), alpha.contiguous()
    split = bool(cfg.get("split_tail", False)) and has_res
    u_inside = with_u and C <= cfg.get("u_inside_max_c", 1 << 30)
    _coef_fwd[(_cdiv(N, cfg["BT"]),)](
        x, phi, phi_lo, bias, alpha, lg, rinv, h_pre, h_post, h_res, u if u_inside else h_pre,
        N, C, x.stride(0), phi.stride(0), iters, eps, rms_eps, pre_eps, post_mult,
        NS=n, M=M, MP=_np2(M, 16), HAS_RES=has_res, SINK=not split, HAS_U=u_inside, T_IN=t_in, T_OUT=t_out,
        DOT=dot, BT=cfg["BT"], BK=cfg["BK"], BC=cfg["BC"], SPLIT=two, **_launch(cfg),
    )
    if with_u and not u_inside:  # u by the streaming kernel of stream_pre: x read again, at copy speed
        _pre_launch(x, h_pre, u)
    if split:
        ct = _cfg("coef_tail")
        _coef_tail[(_cdiv(N, ct["BT"]),)](
            lg, rinv, bias, alpha, h_res, N, iters, eps, NS=n, M=M, T_IN=t_in, T_OUT=t_out, BT=ct["BT"], **_launch(ct))
    return u, h_pre, h_post, h_res, lg, rinv


def _coef_fwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    rms_eps: float, pre_eps: float, post_mult: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C] -> h_pre [N, n], h_post [N, n], h_res [N, n, n] (or [N, 0, 0]), raw logits [N, M], 1/r [N]."""
    return _fwd(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, False)[1:]


coef_fwd = _op("coef_fwd", _coef_fwd_body)


def _coef_fake(x, phi):
    N, n, C = x.shape
    M = phi.shape[1]
    f32 = dict(dtype=torch.float32)
    res = (N, n, n) if M == n * n + 2 * n else (N, 0, 0)
    return (x.new_empty((N, n), **f32), x.new_empty((N, n), **f32), x.new_empty(res, **f32),
            x.new_empty((N, M), **f32), x.new_empty((N,), **f32))


@coef_fwd.register_fake
def _(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult):
    return _coef_fake(x, phi)


def bwd_tok(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult, du=None):
    """Per token: dh_* (+ <du, x_j> into dh_pre when du is given) -> dL [N, M], d(sum x^2) [N], per-program bias /
    alpha partials [M + 3, programs], and du as the x pass takes it: in x's dtype, rounded here when it came wider
    (u in the branch's dtype, CONFIG "u"). d_pre None: zero (read by no one)."""
    N, n, C = x.shape
    M = phi.shape[1]
    has_res = M == n * n + 2 * n
    dev = x.device
    ct = _cfg("coef_bwd_tok", BC=_np2(C, 16))
    n_prog = _cdiv(N, ct["BT"])
    pw = M + 3
    dl, dss = _new((N, M), torch.float32, dev), _new((N,), torch.float32, dev)
    part = _new((pw, n_prog), torch.float32, dev)
    # Sinkhorn replay scratch: 2*iters - 1 reciprocal sums of n floats per token (written before it is read)
    sc = torch.empty(((2 * iters - 1) * N * n) if has_res else 1, dtype=torch.float32, device=dev)
    with_u = du is not None
    narrow = with_u and du.dtype != x.dtype
    dun = _new(du.shape, x.dtype, dev) if narrow else None
    _coef_bwd_tok[(n_prog,)](
        lg, rinv, bias.contiguous(), alpha.contiguous(), lg if d_pre is None else d_pre.contiguous(), d_post.contiguous(),
        d_res.contiguous(), dl, dss, part, sc, x, du.contiguous() if with_u else x, _or(dun, x), N, n_prog, n * C, C,
        x.stride(0), iters, eps, post_mult, NS=n, M=M, HAS_RES=has_res, T_IN=t_in, T_OUT=t_out, HAS_U=with_u,
        HAS_DPRE=d_pre is not None, BT=ct["BT"], BC=min(ct.get("BC", 16), _np2(C, 16)), LOOP_STAGES=ct.get("loop_stages"),
        INTERLEAVE=bool(ct.get("interleave")), DU_NARROW=narrow, **_launch(ct),
    )
    return dl, dss, part, _or(dun, du)


def bwd_x(x, phi, dl, dss, dx=None, h_pre=None, du=None, dx_in=None, u_rows=1):
    """One pass over x: returns split-partials [splits, nC, M] of dphi = x^T dL; with dx given, also writes
    dx = dL phi^T + 2 x d(sum x^2) (+ h_pre_j du when du is given, + dx_in when given) into it. u_rows: rows of x per
    row of du (HC's (token, stream) rows)."""
    N, n, C = x.shape
    K, M = n * C, phi.shape[1]
    cx = _cfg("bnd_dphi" if dx is None else "hc_bwd_x" if n == 1 else "coef_bwd_x", BK=_np2(K, 16))
    BT, BK, MP = cx["BT"], cx["BK"], _np2(M, 16)
    kblocks = _cdiv(K, BK)
    want = max(1, cx["programs_per_sm"] * _num_sms(x.device) // kblocks)
    tok = max(BT, _cdiv(_cdiv(N, want), BT) * BT)  # whole token blocks per split (the kernel's TMA relies on it)
    splits = _cdiv(N, tok)
    dphi_part = _new((splits, K, M), torch.float32, x.device)
    with_u, aligned = du is not None, C % BK == 0
    dot_kw = _grad_dots(x.dtype, phi.dtype, cx)
    du = du.contiguous() if with_u else None
    # the [N, K] / [N, C] / [N, M] tensors the loop tiles, then as TMA descriptors where every one qualifies
    tiled = dict(x=x, dl=dl, dx=dx, dx_in=dx_in, du=du)
    tma = cx.get("tma", False) and N > 0 and u_rows == 1 and (aligned or not with_u)
    if tma:
        descs = {k: t if t is None else _rows_desc(t, (BT, MP) if k == "dl" else (BT, BK)) for k, t in tiled.items()}
        tma = all(d is not None for k, d in descs.items() if tiled[k] is not None)
        tiled = descs if tma else tiled
    _coef_bwd_x[(kblocks, splits)](
        tiled["x"], phi, tiled["dl"], dss, _or(tiled["dx"], dss), dphi_part, h_pre.contiguous() if with_u else dss,
        _or(tiled["du"], dss), _or(tiled["dx_in"], dss), N, K, C, x.stride(0), phi.stride(0), tok,
        NS=n, M=M, MP=MP, HAS_U=with_u, HAS_DX=dx is not None, ACC=dx_in is not None,
        ALIGNED=aligned, BT=BT, BK=BK, U_ROWS=u_rows, **dot_kw,
        LOOP_STAGES=cx.get("loop_stages"), DPHI_FIRST=cx["dphi_first"], TMA=tma, **_launch(cx),
    )
    return dphi_part


def _or(t, fallback):
    return fallback if t is None else t


def _rows_desc(t: Tensor, block: tuple[int, int]):
    """A TMA descriptor of t as the 2-D [rows, row length] the x pass tiles (each row's values contiguous, base and
    row stride 16-byte aligned), or None where t cannot be one. Built from t's strides directly: a descriptor per
    tensor per sublayer is host time in every eager backward."""
    shape, strides = t.shape, t.stride()
    length, inner = 1, 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if stride != inner and size != 1:
            return None
        length *= size
        inner = length
    if t.data_ptr() % 16 or (strides[0] * t.element_size()) % 16 or len(shape) < 2:
        return None
    return descriptor(t, [shape[0], length], [strides[0], 1], list(block))


def _param_grads(phi, bias, alpha, dphi_part, part):
    """dphi, dbias, dalpha from the kernels' partial sums, in the parameters' dtypes, in one launch."""
    dphi, dbias, dalpha = (_new(t.shape, t.dtype, t.device) for t in (phi, bias, alpha))
    _sum_partials(dphi_part, dphi, part, dbias, dalpha)
    return dphi, dbias, dalpha


def _bwd(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult, h_pre=None, du=None,
         dx_in=None):
    N, n, C = x.shape
    dx = _new((N, n, C), x.dtype, x.device)
    if N == 0:
        return dx, torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)
    x, dx_in = _rows(x), None if dx_in is None else _rows(dx_in)
    phi = _c_contig(phi)
    dl, dss, part, du = bwd_tok(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out,
                                post_mult, du=du)
    dphi_part = bwd_x(x, phi, dl, dss, dx, h_pre=h_pre, du=du, dx_in=dx_in)
    return (dx, *_param_grads(phi, bias, alpha, dphi_part, part))


def _coef_bwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, lg: Tensor, rinv: Tensor,
    d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    post_mult: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _bwd(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult)


coef_bwd = _op("coef_bwd", _coef_bwd_body)


@coef_bwd.register_fake
def _(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult):
    return _like(x), _like(phi), _like(bias), _like(alpha)


def _coef_setup(ctx, inputs, output):
    x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult = inputs
    _, _, _, lg, rinv = output
    ctx.save_for_backward(x, phi, bias, alpha, lg, rinv)
    ctx.opts = (iters, eps, t_in, t_out, post_mult)
    ctx.mark_non_differentiable(lg, rinv)


def _or_zeros(device, d_pre, *grads_and_shapes) -> tuple[Optional[Tensor], ...]:
    """The coefficient gradients: d_pre as autograd gave it (None when h_pre was read only through u, as the model
    does; the kernels then take it as zero without a tensor, `HAS_DPRE`), the others or fp32 zeros of their shapes
    where autograd left them out (an output nothing used)."""
    return (d_pre, *(torch.zeros(shape, dtype=torch.float32, device=device) if g is None else g
                     for g, shape in grads_and_shapes))


def _dh_zeros(x, phi, d_pre, d_post, d_res):
    N, n = x.shape[0], x.shape[1]
    res = (N, n, n) if phi.shape[1] == n * n + 2 * n else (N, 0, 0)
    return _or_zeros(x.device, d_pre, (d_post, (N, n)), (d_res, res))


def _coef_backward(ctx, d_pre, d_post, d_res, _dlg, _drinv):
    x, phi, bias, alpha, lg, rinv = ctx.saved_tensors
    dh = _dh_zeros(x, phi, d_pre, d_post, d_res)
    dx, dphi, dbias, dalpha = _impl(ctx, coef_bwd)(x, phi, bias, alpha, lg, rinv, *dh, *ctx.opts)
    return dx, dphi, dbias, dalpha, None, None, None, None, None, None, None


coef_fwd.register_autograd(_coef_backward, setup_context=_coef_setup)


# ---------------------------------------------------------------------------------------------------------------
# fused pre: coefficients + u = sum_j h_pre_j x_j in one op, one dx in its backward
# ---------------------------------------------------------------------------------------------------------------
def _mhc_pre_fwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    rms_eps: float, pre_eps: float, post_mult: float, u_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C] -> u [N, C] (u_dtype, None: x.dtype), h_pre, h_post, h_res, raw logits, 1/r (as coef_fwd)."""
    return _fwd(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, True, u_dtype)


mhc_pre_fwd = _op("mhc_pre", _mhc_pre_fwd_body)


def _u_fake(x: Tensor, u_dtype: Optional[torch.dtype]) -> Tensor:
    return x.new_empty((x.shape[0], x.shape[2]), dtype=u_dtype or x.dtype)


@mhc_pre_fwd.register_fake
def _(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype=None):
    return (_u_fake(x, u_dtype),) + _coef_fake(x, phi)


def _mhc_pre_bwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, lg: Tensor, rinv: Tensor, h_pre: Tensor, du: Tensor,
    d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    post_mult: float, dx_in: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx_in: the gradient x received from its other consumer (`mhc_enter`), added into dx by the same kernel."""
    return _bwd(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult,
                h_pre=h_pre, du=du, dx_in=dx_in)


mhc_pre_bwd = _op("mhc_pre_bwd", _mhc_pre_bwd_body)


@mhc_pre_bwd.register_fake
def _(x, phi, bias, alpha, lg, rinv, h_pre, du, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult, dx_in=None):
    return _like(x), _like(phi), _like(bias), _like(alpha)


def _mhc_pre_setup(ctx, inputs, output):
    x, phi, bias, alpha, iters, eps, t_in, t_out, _rms_eps, _pre_eps, post_mult = inputs[:11]
    _, h_pre, _, _, lg, rinv = output
    ctx.save_for_backward(x, phi, bias, alpha, lg, rinv, h_pre)
    ctx.opts = (iters, eps, t_in, t_out, post_mult)
    ctx.mark_non_differentiable(lg, rinv)


def _mhc_pre_backward(ctx, du, d_pre, d_post, d_res, _dlg, _drinv, dx_next=None):
    """dx_next (`mhc_enter`): the gradient of the x handed on to the write-back, added in the x pass. du comes in u's
    dtype (`bwd_tok` rounds a wider one)."""
    x, phi, bias, alpha, lg, rinv, h_pre = ctx.saved_tensors
    dh = _dh_zeros(x, phi, d_pre, d_post, d_res)
    if du is None:
        grads = _impl(ctx, coef_bwd)(x, phi, bias, alpha, lg, rinv, *dh, *ctx.opts)
        if dx_next is not None:
            grads = (grads[0] + dx_next, *grads[1:])
    else:
        grads = _impl(ctx, mhc_pre_bwd)(x, phi, bias, alpha, lg, rinv, h_pre, du, *dh, *ctx.opts, dx_in=dx_next)
    return (*grads, None, None, None, None, None, None, None, None)


mhc_pre_fwd.register_autograd(_mhc_pre_backward, setup_context=_mhc_pre_setup)


def _mhc_enter_backward(ctx, dx_next, *grads):
    """`eager.mhc_enter`: mhc_pre's outputs plus x handed on to the sublayer's write-back, whose gradient dx_next
    joins this backward's dx in the x pass (no separate sum of two stream-sized gradients)."""
    return _mhc_pre_backward(ctx, *grads, dx_next=dx_next)


def _mhc_enter_fwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    rms_eps: float, pre_eps: float, post_mult: float, u_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mhc_pre's outputs and x's route to the write-back (`Routed`): `mhc_enter` as torch.compile sees it."""
    return (*_mhc_pre_fwd_body(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype),
            _route_of(x))


mhc_enter_fwd = _op("mhc_enter", _mhc_enter_fwd_body)


@mhc_enter_fwd.register_fake
def _(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype=None):
    return (_u_fake(x, u_dtype),) + _coef_fake(x, phi) + (_route_of(x),)


_register_routed(mhc_enter_fwd, _mhc_pre_setup, _mhc_pre_backward)


# ---------------------------------------------------------------------------------------------------------------
# rms_proj: HC's projection y = RMSNorm(x) w (the coefficient kernels with one stream per row and no tail)
# ---------------------------------------------------------------------------------------------------------------
def _row_proj_launch(x: Tensor, w: Tensor, eps: float, lg: Tensor, rinv: Tensor, hc: Optional[tuple] = None,
                     pairs: Optional[Tensor] = None) -> None:
    """`_coef_fwd` with one stream per row (x [R, C] rows, K = C, no mHC tail): the raw projection x w into lg and 1/r
    into rinv; with hc = (statics, h_pre, h_post, h_res, n, tanh) also HC's coefficients (`HC_TAIL`). pairs: w's
    16-bit pairs, when made already (`_hc_operands`)."""
    R, C = x.shape
    x, w = _c_contig(x), _c_contig(w)
    cfg = _cfg("rms_proj", BK=_np2(C, 16))
    w_hi, w_lo, dot, two = _projection(x, w, pairs)
    statics, h_pre, h_post, h_res, n, tanh = hc if hc is not None else (w, lg, lg, lg, 1, False)
    _coef_fwd[(_cdiv(R, cfg["BT"]),)](
        x, w_hi, w_lo, statics, statics, lg, rinv, h_pre, h_post, h_res, lg, R, C, x.stride(0), w_hi.stride(0), 1,
        0.0, eps, 0.0, 0.0, NS=1, M=w.shape[1], MP=_np2(w.shape[1], 16), HAS_RES=False, SINK=False, HAS_U=False,
        T_IN=False, T_OUT=False, DOT=dot, BT=cfg["BT"], BK=cfg["BK"], BC=16, TAIL=False, SPLIT=two,
        HC_TAIL=0 if hc is None else 1 if tanh else 2, NH=n, **_launch(cfg))


def _rms_proj_fwd_body(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, C] rows, w [C, M] -> y = L / r [R, M] fp32, the raw projection L = x w and 1/r [R] (r: RMS of the row)."""
    R = x.shape[0]
    lg, rinv = _new((R, w.shape[1]), torch.float32, x.device), _new((R,), torch.float32, x.device)
    if R > 0:
        _row_proj_launch(x, w, eps, lg, rinv)
    return lg * rinv[:, None], lg, rinv


rms_proj_fwd = _op("rms_proj", _rms_proj_fwd_body)


@rms_proj_fwd.register_fake
def _(x, w, eps):
    f32 = dict(dtype=torch.float32)
    return x.new_empty((x.shape[0], w.shape[1]), **f32), x.new_empty((x.shape[0], w.shape[1]), **f32), \
        x.new_empty((x.shape[0],), **f32)


def _rms_proj_bwd_body(dy: Tensor, x: Tensor, w: Tensor, lg: Tensor, rinv: Tensor) -> tuple[Tensor, Tensor]:
    """dx = dL w^T + 2 x d(sum x^2) and dw = x^T dL (`_coef_bwd_x`), with dL = dy / r, d(sum x^2) from d(1/r)."""
    R, C = x.shape
    dx = _new((R, C), x.dtype, x.device)
    if R == 0:
        return dx, torch.zeros_like(w)
    dl = (dy * rinv[:, None]).contiguous()
    dss = (-0.5 / C) * (dy * lg).sum(1) * rinv.pow(3)  # 1/r = (sum x^2 / C + eps)^(-1/2)
    part = bwd_x(_c_contig(x).view(R, 1, C), _c_contig(w), dl, dss.contiguous(), dx.view(R, 1, C))
    dw = _new(w.shape, w.dtype, w.device)
    _sum_partials(part, dw)
    return dx, dw


rms_proj_bwd = _op("rms_proj_bwd", _rms_proj_bwd_body)


@rms_proj_bwd.register_fake
def _(dy, x, w, lg, rinv):
    return _like(x), _like(w)


def _rms_proj_setup(ctx, inputs, output):
    x, w, _ = inputs
    _, lg, rinv = output
    ctx.save_for_backward(x, w, lg, rinv)
    ctx.mark_non_differentiable(lg, rinv)


def _rms_proj_backward(ctx, dy, _dlg, _drinv):
    x, w, lg, rinv = ctx.saved_tensors
    if dy is None:
        return None, None, None
    dx, dw = _impl(ctx, rms_proj_bwd)(dy.contiguous(), x, w, lg, rinv)
    return dx, dw, None


rms_proj_fwd.register_autograd(_rms_proj_backward, setup_context=_rms_proj_setup)


# ---------------------------------------------------------------------------------------------------------------
# stream_pre
# ---------------------------------------------------------------------------------------------------------------
def _pre_launch(x: Tensor, h_pre: Tensor, u: Tensor) -> None:
    N, n, C = x.shape
    x, h_pre = _c_contig(x), h_pre.contiguous()
    cfg = _cfg("pre_fwd", BC=_np2(C, 16))
    grid = (_cdiv(N, cfg["BT"]), _cdiv(C, cfg["BC"]))
    _pre_fwd[grid](x, h_pre, u, N, C, x.stride(0), x.stride(1), NS=n, BT=cfg["BT"], BC=cfg["BC"], **_launch(cfg))


def pre_u(x: Tensor, h_pre: Tensor, u_dtype: Optional[torch.dtype] = None) -> Tensor:
    """u [N, C] of x [N, n, C] by the streaming kernel, stored in u_dtype (None: x's), no autograd."""
    u = _new((x.shape[0], x.shape[2]), u_dtype or x.dtype, x.device)
    if x.shape[0] > 0:
        _pre_launch(x, h_pre, u)
    return u


def _pre_fwd_body(x: Tensor, h_pre: Tensor) -> Tensor:
    return pre_u(x, h_pre)


pre_fwd = _op("stream_pre", _pre_fwd_body)


@pre_fwd.register_fake
def _(x, h_pre):
    return x.new_empty((x.shape[0], x.shape[2]))


def _pre_bwd_body(du: Tensor, x: Tensor, h_pre: Tensor) -> tuple[Tensor, Tensor]:
    N, n, C = x.shape
    dx = _new((N, n, C), x.dtype, x.device)
    dh = _new((N, n), torch.float32, x.device)
    if N > 0:
        x, h_pre, du = _c_contig(x), h_pre.contiguous(), du.contiguous()
        cfg = _cfg("pre_bwd", BC=_np2(C, 16))
        _pre_bwd[(_cdiv(N, cfg["BT"]),)](
            x, h_pre, du, dx, dh, N, C, x.stride(0), x.stride(1), NS=n, BT=cfg["BT"], BC=cfg["BC"], **_launch(cfg))
    return dx, dh.to(h_pre.dtype)


pre_bwd = _op("stream_pre_bwd", _pre_bwd_body)


@pre_bwd.register_fake
def _(du, x, h_pre):
    return _like(x), _like(h_pre)


def _pre_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pre_backward(ctx, du):
    x, h_pre = ctx.saved_tensors
    return _impl(ctx, pre_bwd)(du, x, h_pre)


pre_fwd.register_autograd(_pre_backward, setup_context=_pre_setup)


# ---------------------------------------------------------------------------------------------------------------
# stream_post_res
# ---------------------------------------------------------------------------------------------------------------
def _post_fwd_body(x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, route: Optional[Tensor] = None) -> Tensor:
    """h_res [N, n, n], or [N, 0, 0] for H^res = I. route (`Routed`, under torch.compile): not read; the backward
    returns x's gradient as route's."""
    N, n, C = x.shape
    out = _new((N, n, C), x.dtype, x.device)
    if N == 0:
        return out
    x, f = _c_contig(x), _c_contig(f)
    has_res = h_res.shape[-1] != 0
    cfg = _cfg("post_fwd", BC=_np2(C, 16))
    grid = (_cdiv(N, cfg["BT"]), _cdiv(C, cfg["BC"]))
    _post_fwd[grid](
        x, f, h_post.contiguous(), h_res.contiguous(), out, N, C, x.stride(0), x.stride(1), f.stride(0),
        NS=n, HAS_RES=has_res, BT=cfg["BT"], BC=cfg["BC"], **_launch(cfg))
    return out


post_fwd = _op("stream_post_res", _post_fwd_body)


@post_fwd.register_fake
def _(x, f, h_post, h_res, route=None):
    return _like(x)


def _post_bwd_run(g, x, f, h_post, h_res, coef=None, hu=None, u_out=None):
    """Launch `_post_bwd_2d`: (dx, df, dh_post, dh_res). coef = (x_next, du, dL, d(sum x^2), h_pre_next, phi): the
    boundary op's backward, whose dx also carries what x_next received through the next coefficients and u.
    hu, u_out: this sublayer's h_pre [N, n] and a [N, C] buffer the kernel writes its u into (`request_u`)."""
    N, n, C = x.shape
    has_res = h_res.shape[-1] != 0
    dev = x.device
    dx, df = _new((N, n, C), x.dtype, dev), _new((N, C), f.dtype, dev)
    dhp = _new((N, n), torch.float32, dev)
    dhr = _new((N, n, n) if has_res else (N, 0, 0), torch.float32, dev)
    if N == 0:
        return dx, df, dhp, dhr
    x, f, g = _c_contig(x), _c_contig(f), g.contiguous()
    if coef is None:
        cfg = _cfg("post_bwd", "rows" if C <= CONFIG["post_bwd"]["rows_max_c"] else None, BC=_np2(C, 16))
    else:
        cfg = _cfg("bnd_bwd", BC=min(_np2(C, 16), _phi_rows_cap(n, coef[5].shape[1])))
    n_cblk = _cdiv(C, cfg["BC"])
    if n_cblk == 1:  # whole rows per program: the kernel writes dh_post / dH directly
        php, phr = dhp, dhr
    else:
        php = _new((n_cblk, N, n), torch.float32, dev)
        phr = _new((n_cblk, N, n, n) if has_res else (1,), torch.float32, dev)
    if coef is None:
        xn, du, dl, dss, hpre, phi = g, g, g, g, g, g  # unused pointers
        M, dots = 1, dict(DOT=DOT_IEEE)
    else:
        xn, du, dl, dss, hpre, phi = coef
        xn, du, hpre, phi = _rows(xn), du.contiguous(), hpre.contiguous(), _c_contig(phi)
        M, dots = phi.shape[1], _grad_dots(x.dtype, phi.dtype, cfg)
    blocks, stages = _cdiv(N, cfg["BT"]), cfg.get("loop_stages") or 0
    has_u = u_out is not None
    if stages:
        per_sm = cfg["u_programs_per_sm" if has_u else "programs_per_sm"]
        blocks = min(blocks, max(1, per_sm * _num_sms(dev) // n_cblk))
    hu, u_out = (hu.contiguous(), u_out) if has_u else (g, g)  # unused pointers without u
    _post_bwd_2d[(blocks, n_cblk)](
        x, f, h_post.contiguous(), h_res.contiguous(), g, dx, df, php, phr, xn, du, dl, dss, hpre, phi, hu, u_out,
        N, C, x.stride(0), x.stride(1), f.stride(0), phi.stride(0),
        NS=n, HAS_RES=has_res, COEF=coef is not None, M=M, MP=_np2(M, 16), BT=cfg["BT"], BC=cfg["BC"], **dots,
        LOOP_STAGES=stages, HAS_U=has_u, **_launch(cfg))
    if n_cblk > 1:  # the per-C-block partials summed in one launch
        _sum_partials(php, dhp, wpart2=phr if has_res else None, dw2=dhr if has_res else None)
    return dx, df, dhp, dhr


def _post_bwd_body(g: Tensor, x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _post_bwd_u(g, x, f, h_post, h_res)


def _post_bwd_u(g, x, f, h_post, h_res, hu=None, u_out=None):
    """The write-back's backward; hu, u_out (eager only, `request_u`): also this sublayer's u into u_out."""
    dx, df, dhp, dhr = _post_bwd_run(g, x, f, h_post, h_res, hu=hu, u_out=u_out)
    return dx, df, dhp.to(h_post.dtype), dhr.to(h_res.dtype)


post_bwd = _op("stream_post_res_bwd", _post_bwd_body)


@post_bwd.register_fake
def _(g, x, f, h_post, h_res):
    return _like(x), _like(f), _like(h_post), _like(h_res)


class URequest:
    """A branch's request (HyperConfig.rebuild_branch_input): the backward of the write-back that reads the stream x
    also writes the branch's input u = sum_j h_pre_j x_j (stored in `dtype`), into `u`, from the stream tiles it reads
    anyway. The branch's saved-tensor recipe holds the request; `_REQUESTS` only a weak reference."""

    __slots__ = ("h_pre", "dtype", "u", "__weakref__")

    def __init__(self, h_pre: Tensor, dtype: torch.dtype):
        self.h_pre, self.dtype, self.u = h_pre, dtype, None


_REQUESTS: "weakref.WeakValueDictionary[int, URequest]" = weakref.WeakValueDictionary()


def request_u(x: Tensor, h_pre: Tensor, dtype: torch.dtype) -> URequest:
    """x [N, n, C]: the stream a write-back op will read (keyed by its address, unique while its graph holds it)."""
    req = _REQUESTS[x.data_ptr()] = URequest(h_pre, dtype)
    return req


def _requested_u(ctx, x: Tensor) -> tuple:
    """In an eager write-back's backward: (hu, u_out) when a branch asked for the u of this stream x, else ()."""
    if not _REQUESTS or not getattr(ctx, "eager", False):
        return ()
    req = _REQUESTS.pop(x.data_ptr(), None)
    if req is None or tuple(req.h_pre.shape) != tuple(x.shape[:2]):
        return ()
    req.u = _new((x.shape[0], x.shape[2]), req.dtype, x.device)
    return req.h_pre, req.u


def _post_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.inputs, ctx.routed = len(inputs), len(inputs) > 4 and inputs[4] is not None


def _post_backward(ctx, g):
    x, f, h_post, h_res = ctx.saved_tensors
    wanted = _requested_u(ctx, x)  # eager only: the plain body, with the u buffer
    dx, df, dhp, dhr = (_post_bwd_u(g, x, f, h_post, h_res, *wanted) if wanted else
                        _impl(ctx, post_bwd)(g, x, f, h_post, h_res))
    return ((None, df, dhp, dhr, dx) if ctx.routed else (dx, df, dhp, dhr, None))[:ctx.inputs]


post_fwd.register_autograd(_post_backward, setup_context=_post_setup)


# ---------------------------------------------------------------------------------------------------------------
# sublayer boundary: stream_post_res of sublayer l + coefficients and u of sublayer l + 1, x_next written once
# ---------------------------------------------------------------------------------------------------------------
def _bnd_fwd_body(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int,
    eps: float, t_in: bool, t_out: bool, rms_eps: float, pre_eps: float, post_mult: float,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C], f [N, C], h_post [N, n], h_res [N, n, n] or [N, 0, 0] (H^res = I) of sublayer l -> x_next, then
    u (u_dtype, None: x.dtype), h_pre, h_post, h_res, raw logits, 1/r of sublayer l + 1 (as mhc_pre on x_next)."""
    x_next = _post_fwd_body(x, f, h_post, h_res)  # its own streaming kernel; the coefficients read it back
    return (x_next, *_fwd(x_next, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, True,
                          u_dtype))


bnd_fwd = _op("mhc_boundary", _bnd_fwd_body)


@bnd_fwd.register_fake
def _(x, f, h_post, h_res, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype=None):
    return (_like(x), _u_fake(x, u_dtype)) + _coef_fake(x, phi)


def _bnd_bwd_body(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, x_next: Tensor,
    lg: Tensor, rinv: Tensor, h_pre2: Tensor, g: Tensor, du: Tensor, d_pre: Optional[Tensor], d_post: Tensor,
    d_res: Tensor,
    iters: int, eps: float, t_in: bool, t_out: bool, post_mult: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, df, dh_post, dh_res, dphi, dbias, dalpha): one dx, from the per-token coefficient backward (dL, d(sum x^2))
    and one 2-D pass that builds x_next's whole gradient in registers and runs the write-back's backward on it."""
    return _bnd_bwd_u(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, d_pre, d_post, d_res,
                      iters, eps, t_in, t_out, post_mult)


def _bnd_bwd_u(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, d_pre, d_post, d_res, iters,
               eps, t_in, t_out, post_mult, hu=None, u_out=None):
    """`_bnd_bwd_body`; hu, u_out (eager only, `request_u`): the write-back's pass also writes sublayer l's u."""
    if x.shape[0] == 0:
        dx, df, dhp, dhr = _post_bwd_run(g, x, f, h_post, h_res, hu=hu, u_out=u_out)
        return dx, df, dhp, dhr, torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)
    if CONFIG["bnd_bwd"]["xpass"]:
        # the per-sublayer wiring's kernels: x_next's whole gradient by the x pass (g added in), then the write-back's
        G, dphi, dbias, dalpha = _bwd(x_next, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out,
                                      post_mult, h_pre=h_pre2, du=du, dx_in=g)
        dx, df, dhp, dhr = _post_bwd_run(G, x, f, h_post, h_res, hu=hu, u_out=u_out)
        return dx, df, dhp.to(h_post.dtype), dhr.to(h_res.dtype), dphi, dbias, dalpha
    x_next, phi = _rows(x_next), _c_contig(phi)
    dl, dss, part, du = bwd_tok(x_next, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out,
                                post_mult, du=du)
    dphi_part = bwd_x(x_next, phi, dl, dss)
    dx, df, dhp, dhr = _post_bwd_run(g, x, f, h_post, h_res, coef=(x_next, du, dl, dss, h_pre2, phi), hu=hu,
                                     u_out=u_out)
    return (dx, df, dhp.to(h_post.dtype), dhr.to(h_res.dtype), *_param_grads(phi, bias, alpha, dphi_part, part))


bnd_bwd = _op("mhc_boundary_bwd", _bnd_bwd_body)


@bnd_bwd.register_fake
def _(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, d_pre, d_post, d_res, iters, eps, t_in,
      t_out, post_mult):
    return _like(x), _like(f), _like(h_post), _like(h_res), _like(phi), _like(bias), _like(alpha)


def _bnd_setup(ctx, inputs, output):
    x, f, h_post, h_res, phi, bias, alpha, iters, eps, t_in, t_out, _rms_eps, _pre_eps, post_mult = inputs[:14]
    x_next, _, h_pre2, _, _, lg, rinv = output
    # x_next is also the next op's input: saving it here keeps no extra copy
    ctx.save_for_backward(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2)
    ctx.opts = (iters, eps, t_in, t_out, post_mult)
    ctx.mark_non_differentiable(lg, rinv)


def _bnd_backward(ctx, g, du, d_pre, d_post, d_res, _dlg, _drinv):
    x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2 = ctx.saved_tensors
    dh = _dh_zeros(x_next, phi, d_pre, d_post, d_res)
    g = torch.zeros_like(x_next) if g is None else g
    du = torch.zeros((x.shape[0], x.shape[2]), dtype=x.dtype, device=x.device) if du is None else du
    args = (x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, *dh, *ctx.opts)
    wanted = _requested_u(ctx, x)  # eager only: the plain body, with the u buffer
    grads = _bnd_bwd_u(*args, *wanted) if wanted else _impl(ctx, bnd_bwd)(*args)
    return (*grads, None, None, None, None, None, None, None, None)


bnd_fwd.register_autograd(_bnd_backward, setup_context=_bnd_setup)


# ---------------------------------------------------------------------------------------------------------------
# hc_coef: HC's coefficients, its projection RMSNorm(x) w and the per-token tail in one op (reference.hc_coefficients)
# ---------------------------------------------------------------------------------------------------------------
def hc_statics(s_alpha: Tensor, s_beta: Tensor, b_static: Tensor, am_static: Tensor, ar_static: Tensor) -> Tensor:
    """HC's static parameters as `hc_coef` takes them: fp32 [s_beta, s_alpha, B (n), A_m (n), A_r (n x n)], one
    autograd-tracked concatenation (its backward splits the op's one gradient vector back onto the parameters)."""
    return torch.cat([s_beta.reshape(1).float(), s_alpha.reshape(1).float(), b_static.float(), am_static.float(),
                      ar_static.float().flatten()])


def _hc_coef_fwd_body(x: Tensor, w: Tensor, statics: Tensor, n: int, eps: float,
                      tanh: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [R, C] rows (token, stream i = row % n), w [C, n + 2], statics (`hc_statics`) -> h_pre [R], h_post [R],
    h_res [R / n, n, n] fp32 (h_res[t, j, i] = A_r,ij + s_alpha act(y_i,2+j)), the raw projection [R, n + 2] and
    1/r [R], in one launch."""
    return _hc_coefs(x, w, statics, n, eps, tanh)


def _hc_coefs(x: Tensor, w: Tensor, statics: Tensor, n: int, eps: float, tanh: bool,
              pairs: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    R = x.shape[0]
    f32 = torch.float32
    h_pre, h_post, h_res = _new((R,), f32, x.device), _new((R,), f32, x.device), _new((R // n, n, n), f32, x.device)
    lg, rinv = _new((R, w.shape[1]), f32, x.device), _new((R,), f32, x.device)
    if R > 0:
        _row_proj_launch(x, w, eps, lg, rinv, hc=(statics, h_pre, h_post, h_res, n, tanh), pairs=pairs)
    return h_pre, h_post, h_res, lg, rinv


hc_coef_fwd = _op("hc_coef", _hc_coef_fwd_body)


@hc_coef_fwd.register_fake
def _(x, w, statics, n, eps, tanh):
    R = x.shape[0]
    f32 = dict(dtype=torch.float32)
    return (x.new_empty((R,), **f32), x.new_empty((R,), **f32), x.new_empty((R // n, n, n), **f32),
            x.new_empty((R, w.shape[1]), **f32), x.new_empty((R,), **f32))


def _hc_bwd(d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, x: Tensor, w: Tensor, statics: Tensor, lg: Tensor,
            rinv: Tensor, n: int, tanh: bool, h_pre: Optional[Tensor] = None, du: Optional[Tensor] = None,
            dx_in: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dw and the statics' gradient: the tail's backward per row (`_hc_tail_bwd`: dL and d(sum x^2), partial
    sums of the statics' gradient per row block), then the x pass of the coefficient kernels (`_coef_bwd_x`:
    dx = dL w^T + 2 x d(sum x^2), dw = x^T dL). With du (`hc_enter`: u = sum_i h_pre_i x_i was computed too): dh_pre
    gains <du, x_i> in the tail pass and dx gains h_pre_i du (+ dx_in) in the x pass: one dx for the whole op."""
    R, C = x.shape
    M = w.shape[1]
    dx = _new((R, C), x.dtype, x.device)
    if R == 0:
        return dx, torch.zeros_like(w), torch.zeros_like(statics)
    x = _c_contig(x)
    with_u = du is not None
    du = du.contiguous() if with_u else None
    narrow = with_u and du.dtype != x.dtype  # u in the branch's dtype (CONFIG "u"): the tail pass rounds du back
    dun = _new(du.shape, x.dtype, x.device) if narrow else None
    cfg = _cfg("hc_tail_bwd", BC=_np2(C, 16))
    programs = _cdiv(R, cfg["BT"])
    dl, dss = _new((R, M), torch.float32, x.device), _new((R,), torch.float32, x.device)
    part = _new((statics.shape[0], programs), torch.float32, x.device)
    _hc_tail_bwd[(programs,)](
        lg, rinv, statics, lg if d_pre is None else d_pre.contiguous(), d_post.contiguous(), d_res.contiguous(), dl, dss,
        part, x, du if with_u else x, _or(dun, x), R, programs, C, 1.0 / C, M=M, NH=n, TANH=tanh, BT=cfg["BT"],
        HAS_U=with_u, BC=cfg["BC"], HAS_DPRE=d_pre is not None, DU_NARROW=narrow, **_launch(cfg))
    du = _or(dun, du)
    dw = bwd_x(x.view(R, 1, C), _c_contig(w), dl, dss, dx.view(R, 1, C), h_pre=h_pre if with_u else None, du=du,
               dx_in=None if dx_in is None else _c_contig(dx_in).view(R, 1, C), u_rows=n)
    dw_sum, dstatics = _new(w.shape, w.dtype, w.device), _new((part.shape[0],), torch.float32, x.device)
    _sum_partials(dw, dw_sum, part, dstatics)
    return dx, dw_sum, dstatics


def _hc_coef_bwd_body(d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, x: Tensor, w: Tensor, statics: Tensor,
                      lg: Tensor, rinv: Tensor, n: int, tanh: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _hc_bwd(d_pre, d_post, d_res, x, w, statics, lg, rinv, n, tanh)


hc_coef_bwd = _op("hc_coef_bwd", _hc_coef_bwd_body)


@hc_coef_bwd.register_fake
def _(d_pre, d_post, d_res, x, w, statics, lg, rinv, n, tanh):
    return _like(x), _like(w), _like(statics)


def _hc_coef_setup(ctx, inputs, output):
    x, w, statics, n, _, tanh = inputs
    ctx.save_for_backward(x, w, statics, output[3], output[4])
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.n, ctx.tanh = n, tanh


def _hc_dh_zeros(rows: int, n: int, device, d_pre, d_post, d_res) -> tuple[Optional[Tensor], ...]:
    return _or_zeros(device, d_pre, (d_post, (rows,)), (d_res, (rows // n, n, n)))


def _hc_coef_backward(ctx, d_pre, d_post, d_res, _dlg, _drinv):
    x, w, statics, lg, rinv = ctx.saved_tensors
    dh = _hc_dh_zeros(x.shape[0], ctx.n, x.device, d_pre, d_post, d_res)
    dx, dw, dst = _impl(ctx, hc_coef_bwd)(*dh, x, w, statics, lg, rinv, ctx.n, ctx.tanh)
    return dx, dw, dst, None, None, None


hc_coef_fwd.register_autograd(_hc_coef_backward, setup_context=_hc_coef_setup)


# ---------------------------------------------------------------------------------------------------------------
# hc_enter: HC's coefficients and u = sum_i h_pre_i x_i in one op, one dx in its backward (as mhc_enter for mHC)
# ---------------------------------------------------------------------------------------------------------------
def _hc_enter_fwd_body(x: Tensor, w: Tensor, statics: Tensor, eps: float, tanh: bool,
                       u_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C] -> u [N, C] (u_dtype, None: x.dtype), then hc_coef's outputs on x's rows: h_pre [N n], h_post [N n],
    h_res [N, n, n], the raw projection [N n, n + 2], 1/r [N n]. u by stream_pre's streaming kernel (x read again)."""
    return _hc_enter_run(x, w, statics, eps, tanh, u_dtype=u_dtype)


def _hc_enter_run(x: Tensor, w: Tensor, statics: Tensor, eps: float, tanh: bool, pairs: Optional[Tensor] = None,
                  u_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    N, n, C = x.shape
    x = _rows(x)
    coefs = _hc_coefs(x.view(N * n, C), w, statics, n, eps, tanh, pairs)
    u = _new((N, C), u_dtype or x.dtype, x.device)
    if N > 0:
        _pre_launch(x, coefs[0].view(N, n), u)
    return (u, *coefs)


hc_enter_fwd = _op("hc_enter", _hc_enter_fwd_body)


@hc_enter_fwd.register_fake
def _hc_enter_fake(x, w, statics, eps, tanh, u_dtype=None):
    N, n, C = x.shape
    f32 = dict(dtype=torch.float32)
    return (_u_fake(x, u_dtype), x.new_empty((N * n,), **f32), x.new_empty((N * n,), **f32),
            x.new_empty((N, n, n), **f32), x.new_empty((N * n, w.shape[1]), **f32), x.new_empty((N * n,), **f32))


def _hc_enter_bwd_body(d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, du: Optional[Tensor], x: Tensor, w: Tensor,
                       statics: Tensor, lg: Tensor, rinv: Tensor, h_pre: Tensor, tanh: bool,
                       dx_in: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dx [N, n, C] (with h_pre_i du and dx_in, the write-back's gradient of x, added in the same pass), dw, dstatics."""
    N, n, C = x.shape
    dx, dw, dst = _hc_bwd(d_pre, d_post, d_res, _rows(x).view(N * n, C), w, statics, lg, rinv, n, tanh,
                          h_pre=h_pre, du=du, dx_in=None if dx_in is None else dx_in.reshape(N * n, C))
    return dx.view(N, n, C), dw, dst


hc_enter_bwd = _op("hc_enter_bwd", _hc_enter_bwd_body)


@hc_enter_bwd.register_fake
def _(d_pre, d_post, d_res, du, x, w, statics, lg, rinv, h_pre, tanh, dx_in=None):
    return _like(x), _like(w), _like(statics)


def _hc_enter_setup(ctx, inputs, output):
    x, w, statics, _, tanh = inputs[:5]
    _, h_pre, _, _, lg, rinv = output
    ctx.save_for_backward(x, w, statics, lg, rinv, h_pre)
    ctx.mark_non_differentiable(lg, rinv)
    ctx.tanh = tanh


def _hc_enter_op_backward(ctx, du, d_pre, d_post, d_res, _dlg, _drinv, dx_next=None):
    x, w, statics, lg, rinv, h_pre = ctx.saved_tensors
    N, n, _ = x.shape
    dh = _hc_dh_zeros(N * n, n, x.device, d_pre, d_post, d_res)
    dx, dw, dst = _impl(ctx, hc_enter_bwd)(*dh, du, x, w, statics, lg, rinv, h_pre, ctx.tanh, dx_in=dx_next)
    return dx, dw, dst, None, None, None


hc_enter_fwd.register_autograd(_hc_enter_op_backward, setup_context=_hc_enter_setup)


def _hc_enter_routed_body(x: Tensor, w: Tensor, statics: Tensor, eps: float, tanh: bool,
                          u_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                          Tensor]:
    """hc_enter's outputs and x's route to the write-back (`Routed`): `hc_enter` as torch.compile sees it."""
    return (*_hc_enter_fwd_body(x, w, statics, eps, tanh, u_dtype), _route_of(x))


hc_enter_routed = _op("hc_enter_routed", _hc_enter_routed_body)


@hc_enter_routed.register_fake
def _(x, w, statics, eps, tanh, u_dtype=None):
    return (*_hc_enter_fake(x, w, statics, eps, tanh, u_dtype), _route_of(x))


_register_routed(hc_enter_routed, _hc_enter_setup, _hc_enter_op_backward)


def _hc_enter_backward(ctx, dx_next, *grads):
    """`eager.hc_enter`: the gradient of the x handed on to the write-back joins dx in the x pass."""
    return _hc_enter_op_backward(ctx, *grads, dx_next=dx_next)


def hc_operands(x_dtype: torch.dtype, g: Tensor, w_beta: Tensor, w_m: Tensor, w_r: Tensor, s_alpha: Tensor,
                s_beta: Tensor, b_static: Tensor, am_static: Tensor,
                ar_static: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """HC's nine parameters as its kernels take them, in one launch (`_hc_operands`): W = diag(g) [w_beta | w_m | W_r]
    [C, n + 2] fp32 (reference.hc_projection_weights), the statics (`hc_statics`' layout) and, where `_coef_fwd`
    takes W as 16-bit pairs for activations of x_dtype, those pairs (else None)."""
    (C, n), dev = w_r.shape, w_r.device
    M, pw = n + 2, 2 + 2 * n + n * n
    w = _new((C, M), torch.float32, dev)
    statics = _new((pw,), torch.float32, dev)
    pairs = _new((C, 2 * M), x_dtype, dev) if _takes_pairs(x_dtype, w) else None
    cfg = CONFIG["hc_operands"]
    _hc_operands[(max(1, _cdiv(C, cfg["BR"])),)](
        g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static, w, w if pairs is None else pairs,
        statics, C, NH=n, M=M, MP=_np2(M), PW=pw, PWP=_np2(pw), PAIRS=pairs is not None, BR=cfg["BR"],
        **_launch(cfg))
    return w, statics, pairs


def hc_operand_grads(dw: Tensor, dstatics: Tensor, g: Tensor, w_beta: Tensor, w_m: Tensor, w_r: Tensor,
                     s_alpha: Tensor, s_beta: Tensor, b_static: Tensor, am_static: Tensor,
                     ar_static: Tensor) -> tuple[Tensor, ...]:
    """The nine parameters' gradients from dW and the statics' gradient, in one launch (`_hc_operand_grads`), each in
    its parameter's dtype and shape."""
    params = (g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static)
    grads = tuple(_new(p.shape, p.dtype, p.device) for p in params)
    (C, n), cfg = w_r.shape, CONFIG["hc_operands"]
    pw = dstatics.shape[0]
    dg, dwb, dwm, dwr, dsa, dsb, db, dam, dar = grads
    _hc_operand_grads[(max(1, _cdiv(C, cfg["BR"])),)](
        dw, dstatics, g, w_beta, w_m, w_r, dg, dwb, dwm, dwr, dsa, dsb, db, dam, dar, C, NH=n, M=n + 2,
        MP=_np2(n + 2), PW=pw, PWP=_np2(pw), BR=cfg["BR"], **_launch(cfg))
    return grads


class HCEnterFolded(torch.autograd.Function):
    """`hc_enter` on HC's nine raw parameters (eager only; under torch.compile the wrapper builds the operands with
    torch ops, which inductor fuses): the operands are made inside the op (`hc_operands`, one launch, also W's 16-bit
    pairs) and the backward turns dW and the statics' gradient into the nine parameter gradients in one launch
    (`hc_operand_grads`), instead of the torch composition's three forward launches and a dozen autograd nodes each
    way. Outputs as `eager.hc_enter`'s: x (the alias its write-back reads), then the op's."""

    @staticmethod
    def forward(ctx, x, g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static, eps, tanh, u_dtype=None):
        params = (g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static)
        w, statics, pairs = hc_operands(x.dtype, *params)
        out = _hc_enter_run(x, w, statics, eps, tanh, pairs, u_dtype)
        ctx.set_materialize_grads(False)
        _, h_pre, _, _, lg, rinv = out
        ctx.save_for_backward(x, w, statics, lg, rinv, h_pre, *params)
        ctx.mark_non_differentiable(lg, rinv)
        ctx.tanh = tanh
        return (x, *out)

    @staticmethod
    def backward(ctx, dx_next, du, d_pre, d_post, d_res, _dlg, _drinv):
        x, w, statics, lg, rinv, h_pre, *params = ctx.saved_tensors
        N, n, _ = x.shape
        dh = _hc_dh_zeros(N * n, n, x.device, d_pre, d_post, d_res)
        dx, dw, dst = _hc_enter_bwd_body(*dh, du, x, w, statics, lg, rinv, h_pre, ctx.tanh, dx_in=dx_next)
        return (dx, *hc_operand_grads(dw, dst, *params), None, None, None)


# ---------------------------------------------------------------------------------------------------------------
# RoPE on the qkv projection: eager only (under torch.compile the reference's torch ops are fused by inductor)
# ---------------------------------------------------------------------------------------------------------------
class RopeQKV(torch.autograd.Function):
    """qkv [B, T, 3C] -> q, k rotated ([B, H, T, D], contiguous) and v (a view of qkv); the backward writes d(qkv)
    once, in qkv's layout. cos, sin: fp32 tables [T, D / 2], contiguous."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int):
        B, T, C3 = qkv.shape
        C, H = C3 // 3, n_heads
        half = C // (2 * H)
        rows = _c_contig(qkv.reshape(B * T, C3))  # the kernel reads channels contiguously
        qk = _new((2, B, H, T, 2 * half), qkv.dtype, qkv.device)
        cfg = CONFIG["rope"]
        if B * T:
            _rope_fwd[(_cdiv(B * T, cfg["BR"]), 2 * H)](
                rows, cos, sin, qk, B * T, T, H, C, rows.stride(0), HALF=half, BH=_np2(half), BR=cfg["BR"],
                **_launch(cfg))
        ctx.save_for_backward(cos, sin)
        ctx.shape, ctx.dtype, ctx.n_heads = (B, T, C3), qkv.dtype, H
        ctx.set_materialize_grads(False)
        v = qkv.view(B, T, 3, H, 2 * half).permute(2, 0, 3, 1, 4)[2]
        return qk[0], qk[1], v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        (B, T, C3), H = ctx.shape, ctx.n_heads
        C = C3 // 3
        half = C // (2 * H)
        dqkv = _new((B, T, C3), ctx.dtype, cos.device)
        grads = [torch.zeros((B, H, T, 2 * half), dtype=ctx.dtype, device=cos.device) if g is None else _c_contig(g)
                 for g in (dq, dk, dv)]
        cfg = CONFIG["rope"]
        if B * T:
            strides = [st for g in grads for st in g.stride()[:3]]
            _rope_bwd[(_cdiv(B * T, cfg["BR"]), 3 * H)](
                *grads, cos, sin, dqkv, B * T, T, H, C, *strides, HALF=half, BH=_np2(half), BR=cfg["BR"],
                **_launch(cfg))
        return dqkv, None, None, None


def _ends_launch(kernel, src: Tensor, out: Tensor, N: int, C: int, n: int) -> Tensor:
    """One of the stream's-ends kernels over an [N, C] grid of rows (src and out contiguous); returns out."""
    if N:
        cfg = _cfg("stream_ends", BC=_np2(C, 16))
        kernel[(_cdiv(N, cfg["BT"]), _cdiv(C, cfg["BC"]))](src, out, N, C, NS=n, BT=cfg["BT"], BC=cfg["BC"],
                                                           **_launch(cfg))
    return out


def expand_rows(h: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """[..., C] -> [..., n, C] in dtype, every stream a copy of h (`_expand`)."""
    C = h.shape[-1]
    rows = h.reshape(-1, C).contiguous()
    return _ends_launch(_expand, rows, _new((*h.shape[:-1], n, C), dtype, h.device), rows.shape[0], C, n)


def sum_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., n, C] -> [..., C] in dtype, the n streams summed in fp32 (`_sum_streams`)."""
    n, C = x.shape[-2], x.shape[-1]
    out = _new((*x.shape[:-2], C), dtype, x.device)
    return _ends_launch(_sum_streams, x.contiguous(), out, out.numel() // max(C, 1), C, n)


class ExpandStreams(torch.autograd.Function):
    """x_0 = 1_n h in the stream's dtype; backward: the n streams' gradients summed into h's dtype."""

    @staticmethod
    def forward(ctx, h: Tensor, n: int, dtype: torch.dtype):
        ctx.h_dtype = h.dtype
        return expand_rows(h, n, dtype)

    @staticmethod
    def backward(ctx, g):
        return sum_rows(g, ctx.h_dtype), None, None


class SumStreams(torch.autograd.Function):
    """The streams summed into dtype; backward: the gradient copied to every stream in the stream's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, dtype: torch.dtype):
        ctx.x_dtype, ctx.n = x.dtype, x.shape[-2]
        return sum_rows(x, dtype)

    @staticmethod
    def backward(ctx, g):
        return expand_rows(g, ctx.n, ctx.x_dtype), None


# ---------------------------------------------------------------------------------------------------------------
# eager path
# ---------------------------------------------------------------------------------------------------------------
# A Python custom op costs tens of microseconds of host time per call (dispatcher, argument defaults, a
# dynamo-disable frame, the autograd wrapper); an eager training step calls four of them per sublayer, and on a
# slow host the GPU then waits for launches. Outside torch.compile the same bodies run under one plain
# autograd.Function with the same setup / backward functions; under compile (or on fake / traced tensors) the
# registered custom ops are used, so graphs still see opaque ops with fake implementations.
def _eager_fn(op, setup, backward, routed=None):
    """routed (the enter ops): the Function also returns its first input x, as its first output (an alias autograd
    tracks), and backward receives that output's gradient first; under compile the op `routed` (op's outputs and a
    route) runs instead, and the first output is the `Routed` pair of x and its route."""
    through = routed is not None

    def forward(ctx, *args):
        out = op.plain(*args)
        ctx.eager = True
        ctx.set_materialize_grads(False)  # unused outputs' grads arrive as None, as with the custom op
        setup(ctx, args, out)
        return (args[0], *out) if through else out

    # named at creation: autograd names the backward node after the class (e.g. post_fwd_eagerBackward)
    name = op.plain.__name__.replace("_body", "").strip("_") + ("_through" if through else "") + "_eager"
    Fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    # Function.apply is a Python wrapper around the C++ apply: it binds default arguments (only for Functions with a
    # setup_context; this one has none), checks for functorch transforms, and unwraps dead functorch wrappers by a
    # generator over every argument (a dozen here): about 7 of its 14 us per call on a CPU (docs/kernels.md). The
    # same steps, on the tensor arguments only; under a functorch transform the wrapper runs, so torch's error for a
    # Function without setup_context still stops it:
    c_apply = super(torch.autograd.Function, Fn).apply
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead

    def apply(*args):
        if not CONFIG["launch"]["c_apply"] or torch._C._are_functorch_transforms_active():
            return Fn.apply(*args)
        return c_apply(*[unwrap_if_dead(a) if type(a) is Tensor else a for a in args])

    def call(*args):
        if torch.compiler.is_compiling() or type(args[0]) is not Tensor:
            if not through:
                return op(*args)
            if not CONFIG["enter"]["route"]:
                return (args[0], *op(*args))
            *out, route = routed(*args)
            return (Routed(args[0], route), *out)
        return apply(*args)

    return call


eager = SimpleNamespace(
    coef=_eager_fn(coef_fwd, _coef_setup, _coef_backward),
    mhc_pre=_eager_fn(mhc_pre_fwd, _mhc_pre_setup, _mhc_pre_backward),
    mhc_enter=_eager_fn(mhc_pre_fwd, _mhc_pre_setup, _mhc_enter_backward, routed=mhc_enter_fwd),
    stream_pre=_eager_fn(pre_fwd, _pre_setup, _pre_backward),
    stream_post_res=_eager_fn(post_fwd, _post_setup, _post_backward),
    boundary=_eager_fn(bnd_fwd, _bnd_setup, _bnd_backward),
    rms_proj=_eager_fn(rms_proj_fwd, _rms_proj_setup, _rms_proj_backward),
    hc_coef=_eager_fn(hc_coef_fwd, _hc_coef_setup, _hc_coef_backward),
    hc_enter=_eager_fn(hc_enter_fwd, _hc_enter_setup, _hc_enter_backward, routed=hc_enter_routed),
)
