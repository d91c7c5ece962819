"""The coefficient projection that mHC and HC share (docs/design.md §2, §5; docs/kernels.md, "The projection").

Forward (`project_rows`, inlined in each family's forward kernel before its own tail): one read of a block of rows of
x gives the raw projection L = x phi (fp32 accumulate) and 1/r from the rows' sums of squares, for the RMS norm that
the coefficients apply after the product (norm after the matmul). Both are stored: they are all the backward keeps.

Backward (`_coef_bwd_x`, the x pass): one read of x per (column block, token split) gives the split's partial
parameter gradient x^T dL (summed over splits afterwards, `partial_sums`) and dx = dL phi^T + 2 x d(sum x^2), with
more of x's gradient added in the same pass where the op has it: h_pre_j du (the op also made u = sum_j h_pre_j x_j,
HAS_U) and the gradient x received from its other consumer (ACC: the sublayer's write-back, or the next sublayer's
through the boundary op), so that autograd never sums stream-sized gradients.

Dot precision: fp32 x takes full fp32 products; 16-bit x with phi in its dtype native dots; an fp32 phi (the
trainer's parameters beside a bf16 stream) enters as hi / lo parts in x's dtype, made from the fp32 tiles in the
kernel and interleaved column by column into one dot of twice the width (PAIRS): exact products of x with both parts,
phi to 16 significant bits, more than tf32's 11. The backward's dots take dL and phi as bf16 parts likewise (SPLIT).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .host import INTERPRET, cdiv, empty, np2, num_sms, or_
from .launch_cache import descriptor, launcher
from .launch_config import launch_options, tiles

Tensor = torch.Tensor

# Dot precision modes (constexpr): native 16-bit operands, tf32 on fp32 casts, full fp32.
DOT_NATIVE, DOT_TF32, DOT_IEEE = 0, 1, 2


@triton.jit
def dot(a, b, acc, MODE: tl.constexpr):
    if MODE == 0:
        return tl.dot(a, b.to(a.dtype), acc)
    elif MODE == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def row_block(N, BT: tl.constexpr, NS: tl.constexpr):
    """This program's block of BT rows: 64-bit indices, their mask, the NS stream offsets and the [BT, NS] mask."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    nn = tl.arange(0, NS)
    return rows.to(tl.int64), rmask, nn, rmask[:, None] & (nn[None, :] < NS)


@triton.jit
def project_rows(x_ptr, phi_ptr, lg_ptr, rinv_ptr, rows64, rmask, K, stride_x, stride_phi, rms_eps, M: tl.constexpr,
                 MP: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PAIRS: tl.constexpr):
    """The rows' raw projection L = x phi into lg_ptr [rows, M] and 1/r = (sum(x^2) / K + rms_eps)^(-1/2) of their K
    values into rinv_ptr, from one pass over them; returns 1/r [BT]. PAIRS: phi (fp32) as hi = phi in x's dtype and
    lo = phi - hi, interleaved into a [BK, 2 MP] tile (columns 2j, 2j + 1): one dot of twice the width, the pairs
    summed after the loop."""
    cols = tl.arange(0, MP)
    cmask = cols < M
    W: tl.constexpr = 2 * MP if PAIRS else MP
    acc = tl.zeros([BT, W], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):  # the projection and the sum of squares share every load
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        xt = tl.load(x_ptr + rows64[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        pt = tl.load(phi_ptr + kk[:, None] * stride_phi + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                     other=0.0)
        xf = xt.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        if PAIRS:
            hi = pt.to(xt.dtype)
            pt = tl.reshape(tl.join(hi, (pt - hi.to(tl.float32)).to(xt.dtype)), [BK, W])
        acc = dot(xt, pt, acc, DOT)
    if PAIRS:
        hi, lo = tl.split(tl.reshape(acc, [BT, MP, 2]))
        acc = hi + lo
    rinv = 1.0 / tl.sqrt(ss / K + rms_eps)
    tl.store(lg_ptr + rows64[:, None] * M + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    tl.store(rinv_ptr + rows64, rinv, mask=rmask)
    return rinv


@triton.jit
def _dphi_dots(acc, xt, dlt, SPLIT: tl.constexpr, DOT: tl.constexpr):
    """acc += x^T dL for one token block (dL fp32; SPLIT: as its two bf16 parts, x as stored)."""
    if SPLIT:
        dh = dlt.to(tl.bfloat16)
        acc = dot(tl.trans(xt), dh, acc, DOT)
        return dot(tl.trans(xt), (dlt - dh.to(tl.float32)).to(tl.bfloat16), acc, DOT)
    return dot(tl.trans(xt.to(tl.float32)), dlt, acc, DOT)


@triton.jit(do_not_specialize=["N", "tok_per_split"])
def _coef_bwd_x(
    x_ptr, phi_ptr, dl_ptr, dss_ptr, dx_ptr, dphi_ptr, hpre_ptr, du_ptr, dxin_ptr,
    N, K, C, stride_x, stride_phi, tok_per_split,
    NS: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, DOT: tl.constexpr, HAS_U: tl.constexpr,
    ALIGNED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr = False,
    SPLIT: tl.constexpr = False, PHI_LO: tl.constexpr = False, U_ROWS: tl.constexpr = 1,
    LOOP_STAGES: tl.constexpr = None, TMA: tl.constexpr = False,
):
    """x [N, K] rows (K = n C). ACC: dx also adds dxin [N, K], the gradient x received from its other consumer.
    U_ROWS: rows of x per row of du (HC's rows are (token, stream) pairs, NS = 1: U_ROWS = n, h_pre one per row).
    SPLIT (bf16 x): dL (fp32) enters both dots as two bf16 parts hi + lo, phi as its bf16 part (+ its lo part with
    PHI_LO, for an fp32 phi), and x as it is stored: 16-bit operands (no fp32 copies of x tiles in shared memory),
    exact products in the fp32 accumulator, 16 mantissa bits of dL and phi.
    LOOP_STAGES: the token loop's pipelining depth (every load of the loop an async copy into shared memory); None,
    Triton's default, pipelines only the dots' operands (x, dL), not dx_in, du, h_pre, dss.
    The phi-gradient dots come before dx's, so that dL's 16-bit copies in shared memory are dead when dx's store
    converts its layout through shared memory and the two share one buffer (one more CTA per SM).
    TMA: x, dL, dx_in, du and dx are host tensor descriptors (block [BT, BK], dL's [BT, MP]) instead of pointers: the
    copy engine moves whole tiles, with no per-thread addresses or masks in the loop; rows and columns past the
    tensors' ends read as zero and are not written. Token splits are whole token blocks (`x_pass`), so a block never
    reaches into the next split's rows. Needs U_ROWS = 1 and, with HAS_U, ALIGNED."""
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    kk = pid_k * BK + tl.arange(0, BK)
    kmask = kk < K
    cols = tl.arange(0, MP)
    cmask = cols < M
    if HAS_U:  # flat column k of x is stream k // C, channel k % C
        if ALIGNED:  # BK divides C: one stream per program, a [BT] gate and contiguous du columns
            s0 = (pid_k * BK) // C
            cidx = kk - s0 * C
        else:
            sidx = kk // C
            cidx = kk - sidx * C
    phi_t = tl.load(phi_ptr + kk[:, None] * stride_phi + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
    phi_t = phi_t.to(tl.float32)
    if SPLIT:
        phi_hi = phi_t.to(tl.bfloat16)
        phi_lo = (phi_t - phi_hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.zeros([BK, MP], dtype=tl.float32)
    t_lo = pid_s * tok_per_split
    t_hi = tl.minimum(N, t_lo + tok_per_split)
    for t0 in tl.range(t_lo, t_hi, BT, num_stages=LOOP_STAGES):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < t_hi
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & kmask[None, :]
        if TMA:
            xt = x_ptr.load([t0, pid_k * BK])
            dlt = dl_ptr.load([t0, 0])
        else:
            xt = tl.load(x_ptr + rows64[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
            dlt = tl.load(dl_ptr + rows64[:, None] * M + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        xf = xt.to(tl.float32)
        acc = _dphi_dots(acc, xt, dlt, SPLIT, DOT)
        dss = tl.load(dss_ptr + rows, mask=rmask, other=0.0)
        dx0 = 2.0 * xf * dss[:, None]
        if ACC:
            if TMA:
                dx0 += dxin_ptr.load([t0, pid_k * BK]).to(tl.float32)
            else:
                dx0 += tl.load(dxin_ptr + rows64[:, None] * K + kk[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_U:  # dx_j += h_pre_j du: one dx for the whole op
            if TMA:
                duv = du_ptr.load([t0, pid_k * BK - s0 * C])
            else:
                duv = tl.load(du_ptr + (rows64 // U_ROWS)[:, None] * C + cidx[None, :], mask=m2, other=0.0)
            if ALIGNED:
                hpj = tl.load(hpre_ptr + rows64 * NS + s0, mask=rmask, other=0.0)
                dx0 += hpj[:, None] * duv.to(tl.float32)
            else:
                hpj = tl.load(hpre_ptr + rows64[:, None] * NS + sidx[None, :], mask=m2, other=0.0)
                dx0 += hpj * duv.to(tl.float32)
        if SPLIT:
            dl_hi = dlt.to(tl.bfloat16)
            dl_lo = (dlt - dl_hi.to(tl.float32)).to(tl.bfloat16)
            dx = dot(dl_hi, tl.trans(phi_hi), dx0, DOT)
            dx = dot(dl_lo, tl.trans(phi_hi), dx, DOT)
            if PHI_LO:
                dx = dot(dl_hi, tl.trans(phi_lo), dx, DOT)
        else:
            dx = dot(dlt, tl.trans(phi_t), dx0, DOT)
        if TMA:
            dx_ptr.store([t0, pid_k * BK], dx.to(dx_ptr.dtype))
        else:
            tl.store(dx_ptr + rows64[:, None] * K + kk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
    tl.store(dphi_ptr + (pid_s * K + kk[:, None]).to(tl.int64) * M + cols[None, :], acc,
             mask=kmask[:, None] & cmask[None, :])


def native_dot() -> int:
    """Native 16-bit dots, never under the interpreter: its bf16 dot is wrong in triton 3.9; there fp32 dots on the
    same 16-bit values give the same exact products."""
    return DOT_IEEE if INTERPRET else DOT_NATIVE


def forward_dot(x: Tensor, phi: Tensor) -> tuple[int, bool]:
    """(DOT, PAIRS) of the projection x phi (module docstring)."""
    if x.dtype == torch.float32:
        return DOT_IEEE, False  # fp32 activations: full-precision products (the fp32 test tier)
    if phi.dtype == x.dtype:
        return native_dot(), False
    if phi.dtype == torch.float32:
        return native_dot(), True
    return DOT_TF32, False  # a phi of another 16-bit dtype: both exact in tf32


def forward_tiles(name: str, dot_mode: int, pairs: bool, **caps) -> dict:
    """The launch table's tiles for a projection at this dot: an fp32 phi as pairs, or as tf32, has tiles of its own
    (a dot twice as wide; fp32 operand tiles)."""
    return tiles(name, "pairs" if pairs else "tf32" if dot_mode == DOT_TF32 else None, **caps)


def grad_dots(x_dtype: torch.dtype, phi_dtype: torch.dtype) -> dict:
    """DOT, SPLIT and PHI_LO of a gradient pass with dL phi^T (and x^T dL) dots: bf16 x takes dL and phi as bf16
    parts in native dots; fp16 x keeps tf32 dots (dL's range does not fit fp16 parts), fp32 x full fp32 ones."""
    split = x_dtype == torch.bfloat16
    dot_mode = DOT_IEEE if x_dtype == torch.float32 else native_dot() if split else DOT_TF32
    return dict(DOT=dot_mode, SPLIT=split, PHI_LO=split and phi_dtype != torch.bfloat16)


def x_pass(x: Tensor, phi: Tensor, dl: Tensor, dss: Tensor, dx: Tensor, h_pre: Optional[Tensor] = None,
           du: Optional[Tensor] = None, dx_in: Optional[Tensor] = None, u_rows: int = 1) -> Tensor:
    """One pass over x [N, n, C] (rows contiguous): writes dx = dL phi^T + 2 x d(sum x^2) (+ h_pre_j du when du is
    given, + dx_in when given) into dx and returns the split-partials [splits, nC, M] of dphi = x^T dL. u_rows: rows
    of x per row of du (HC's (token, stream) rows)."""
    N, n, C = x.shape
    K, M = n * C, phi.shape[1]
    entry = "hc_bwd_x" if n == 1 else "coef_bwd_x"  # one-stream rows (HC, rms_proj, n = 1) have tiles of their own
    cx = tiles(entry, BK=np2(K, 16))
    BT, BK, MP = cx["BT"], cx["BK"], np2(M, 16)
    kblocks = cdiv(K, BK)
    want = max(1, cx["programs_per_sm"] * num_sms(x.device) // kblocks)
    tok = max(BT, cdiv(cdiv(N, want), BT) * BT)  # whole token blocks per split (the kernel's TMA relies on it)
    splits = cdiv(N, tok)
    dphi_part = empty((splits, K, M), torch.float32, x.device)
    with_u, aligned = du is not None, C % BK == 0
    du = du.contiguous() if with_u else None
    # the [N, K] / [N, C] / [N, M] tensors the loop tiles, as TMA descriptors where every one qualifies: mHC's streams
    # (one-stream rows keep pointer loads: their tiles were timed so)
    tiled = dict(x=x, dl=dl, dx=dx, dx_in=dx_in, du=du)
    tma = entry == "coef_bwd_x" and N > 0 and (aligned or not with_u)
    if tma:
        descs = {k: t if t is None else rows_descriptor(t, (BT, MP) if k == "dl" else (BT, BK))
                 for k, t in tiled.items()}
        tma = all(d is not None for k, d in descs.items() if tiled[k] is not None)
        tiled = descs if tma else tiled
    launcher(_coef_bwd_x)[(kblocks, splits)](
        x_ptr=tiled["x"], phi_ptr=phi, dl_ptr=tiled["dl"], dss_ptr=dss, dx_ptr=tiled["dx"], dphi_ptr=dphi_part,
        hpre_ptr=h_pre.contiguous() if with_u else dss, du_ptr=or_(tiled["du"], dss), dxin_ptr=or_(tiled["dx_in"], dss),
        N=N, K=K, C=C, stride_x=x.stride(0), stride_phi=phi.stride(0), tok_per_split=tok, NS=n, M=M, MP=MP,
        HAS_U=with_u, ACC=dx_in is not None, ALIGNED=aligned, BT=BT, BK=BK, U_ROWS=u_rows,
        **grad_dots(x.dtype, phi.dtype), LOOP_STAGES=cx["loop_stages"], TMA=tma, **launch_options(cx))
    return dphi_part


def rows_descriptor(t: Tensor, block: tuple[int, int]):
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
