"""RoPE on the attention's qkv projection in one pass each way (docs/design.md §13, docs/kernels.md "RoPE"): not an
mHC op, but every residual mode's attention runs it. Eager only: under torch.compile the reference's torch ops run,
which inductor fuses with their neighbours.

Forward (`_rope_fwd`): reads q and k straight out of the projection's output qkv [B*T, 3C] and writes them rotated,
as the [B, H, T, D] tensors attention takes; v stays a view of qkv. Backward (`_rope_bwd`): rotates dq and dk back
(the inverse rotation: sin negated) and writes them, with dv, into one d(qkv) [B*T, 3C] in the projection's layout.
In torch the same step is eight strided elementwise kernels and two concatenations each way plus the gradient's
stack and copy. Products in fp32 (the tables as stored, usually fp32), one rounding to the output dtype.
"""
import torch
import triton
import triton.language as tl

from ..host import c_contig, cdiv, empty, np2
from ..launch_cache import launcher
from ..launch_config import launch_options, tiles

Tensor = torch.Tensor


@triton.jit
def _program_tile(R, T, H, HALF: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr):
    """This program's part (q = 0, k = 1, v = 2), head, rows r = b * T + t of its token block, b, t, the half-head
    channel offsets j and the [BR, BH] mask."""
    which = tl.program_id(1) // H
    h = tl.program_id(1) - which * H
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rows64 = rows.to(tl.int64)
    j = tl.arange(0, BH)
    return which, h, rows64, rows64 // T, rows64 % T, j, (rows < R)[:, None] & (j[None, :] < HALF)


@triton.jit(do_not_specialize=["R"])
def _rope_fwd(qkv_ptr, cos_ptr, sin_ptr, out_ptr, R, T, H, C, stride_row,
              HALF: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr):
    """Program (row block, head of q or k): out [2, B, H, T, D] at (which, b, h, t), rows r = b * T + t."""
    which, h, rows64, b, t, j, m = _program_tile(R, T, H, HALF, BH, BR)
    src = qkv_ptr + rows64[:, None] * stride_row + which * C + h * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t[:, None] * HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t[:, None] * HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    B = R // T
    dst = out_ptr + (((which * B + b) * H + h) * T + t)[:, None] * (2 * HALF) + j[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, (x1 * s + x2 * c).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _grad_tile(g_ptr, b, h, t, sb, sh, st, j, m, HALF: tl.constexpr):
    base = g_ptr + b[:, None] * sb + h * sh + t[:, None] * st + j[None, :]
    return tl.load(base, mask=m, other=0.0).to(tl.float32), tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["R"])
def _rope_bwd(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, dqkv_ptr, R, T, H, C,
              sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
              HALF: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr):
    """Program (row block, head of q, k or v): d(qkv) [R, 3C] at rows r, columns which * C + h * D + channel. dq, dk,
    dv [B, H, T, D] with any (b, h, t) strides and contiguous channels."""
    which, h, rows64, b, t, j, m = _program_tile(R, T, H, HALF, BH, BR)
    dst = dqkv_ptr + rows64[:, None] * (3 * C) + which * C + h * (2 * HALF) + j[None, :]
    if which == 2:
        g1, g2 = _grad_tile(dv_ptr, b, h, t, svb, svh, svt, j, m, HALF)
        o1, o2 = g1, g2
    else:
        if which == 0:
            g1, g2 = _grad_tile(dq_ptr, b, h, t, sqb, sqh, sqt, j, m, HALF)
        else:
            g1, g2 = _grad_tile(dk_ptr, b, h, t, skb, skh, skt, j, m, HALF)
        c = tl.load(cos_ptr + t[:, None] * HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t[:, None] * HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        o1 = g1 * c + g2 * s  # the transpose of the rotation: the angle negated
        o2 = g2 * c - g1 * s
    tl.store(dst, o1.to(dqkv_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, o2.to(dqkv_ptr.dtype.element_ty), mask=m)


class RopeQKV(torch.autograd.Function):
    """qkv [B, T, 3C] -> q, k rotated ([B, H, T, D], contiguous) and v (a view of qkv); the backward writes d(qkv)
    once, in qkv's layout. cos, sin: fp32 tables [T, D / 2], contiguous."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int):
        B, T, C3 = qkv.shape
        C, H = C3 // 3, n_heads
        half = C // (2 * H)
        rows = c_contig(qkv.reshape(B * T, C3))  # the kernel reads channels contiguously
        qk = empty((2, B, H, T, 2 * half), qkv.dtype, qkv.device)
        cfg = tiles("rope")
        if B * T:
            launcher(_rope_fwd)[(cdiv(B * T, cfg["BR"]), 2 * H)](
                qkv_ptr=rows, cos_ptr=cos, sin_ptr=sin, out_ptr=qk, R=B * T, T=T, H=H, C=C, stride_row=rows.stride(0),
                HALF=half, BH=np2(half), BR=cfg["BR"], **launch_options(cfg))
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
        dqkv = empty((B, T, C3), ctx.dtype, cos.device)
        grads = [torch.zeros((B, H, T, 2 * half), dtype=ctx.dtype, device=cos.device) if g is None else c_contig(g)
                 for g in (dq, dk, dv)]
        cfg = tiles("rope")
        if B * T:
            (sqb, sqh, sqt), (skb, skh, skt), (svb, svh, svt) = (g.stride()[:3] for g in grads)
            launcher(_rope_bwd)[(cdiv(B * T, cfg["BR"]), 3 * H)](
                dq_ptr=grads[0], dk_ptr=grads[1], dv_ptr=grads[2], cos_ptr=cos, sin_ptr=sin, dqkv_ptr=dqkv, R=B * T,
                T=T, H=H, C=C, sqb=sqb, sqh=sqh, sqt=sqt, skb=skb, skh=skh, skt=skt, svb=svb, svh=svh, svt=svt,
                HALF=half, BH=np2(half), BR=cfg["BR"], **launch_options(cfg))
        return dqkv, None, None, None
