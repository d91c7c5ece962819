"""The branch's input u = sum_j h_pre_j x_j (docs/design.md §1, §8): `stream_pre` and its backward.

Forward (`_pre_fwd`): one read of x [N, n, C], one write of u [N, C] (fp32 accumulate, rounded to x's dtype and
stored in u's, which may be wider: the branch's). The coefficient ops write u with the same kernel (`write_u`) where
their own kernel does not, and `rebuild_u` runs it again for a branch that dropped its input, so u's bits agree.
Backward (`_pre_bwd`), one kernel per token block: reads du and x once, writes dx_j = h_pre_j du and reduces
dh_pre_j = <du, x_j> over C in registers.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..custom_ops import body_of, custom_op, eager_op
from ..host import c_contig, cdiv, empty, fake_like, np2
from ..launch_cache import launcher
from ..launch_config import launch_options, tiles

Tensor = torch.Tensor


@triton.jit(do_not_specialize=["N"])
def _pre_fwd(
    x_ptr, h_ptr, u_ptr, N, C, stride_xt, stride_xn,
    NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    m2 = rmask[:, None] & (cc[None, :] < C)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(NS):
        h = tl.load(h_ptr + rows64 * NS + j, mask=rmask, other=0.0).to(tl.float32)
        xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
        acc += h[:, None] * xj.to(tl.float32)
    # rounded to x's dtype first: a wider u (the branch's dtype) holds the values a cast of x's would
    tl.store(u_ptr + rows64[:, None] * C + cc[None, :], acc.to(x_ptr.dtype.element_ty).to(u_ptr.dtype.element_ty),
             mask=m2)


@triton.jit(do_not_specialize=["N"])
def _pre_bwd(
    x_ptr, h_ptr, du_ptr, dx_ptr, dh_ptr, N, C, stride_xt, stride_xn,
    NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    nn = tl.arange(0, NS)
    h = tl.load(h_ptr + rows64[:, None] * NS + nn[None, :], mask=rmask[:, None] & (nn[None, :] < NS), other=0.0)
    h = h.to(tl.float32)
    dh = tl.zeros([BT, NS], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cc = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cc[None, :] < C)
        du = tl.load(du_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        for j in tl.static_range(NS):
            hj = tl.sum(tl.where(nn[None, :] == j, h, 0.0), axis=1)  # column j of the register tile
            off = rows64[:, None] * (NS * C) + j * C + cc[None, :]
            tl.store(dx_ptr + off, (hj[:, None] * du).to(dx_ptr.dtype.element_ty), mask=m2)
            xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
            dj = tl.sum(du * xj.to(tl.float32), axis=1)
            dh += tl.where(nn[None, :] == j, dj[:, None], 0.0)
    tl.store(dh_ptr + rows64[:, None] * NS + nn[None, :], dh, mask=rmask[:, None] & (nn[None, :] < NS))


def write_u(x: Tensor, h_pre: Tensor, u: Tensor) -> None:
    """u [N, C] = sum_j h_pre_j x_j of x [N, n, C] (N > 0), in u's dtype, by the streaming kernel."""
    N, n, C = x.shape
    x, h_pre = c_contig(x), h_pre.contiguous()
    cfg = tiles("pre_fwd", BC=np2(C, 16))
    grid = (cdiv(N, cfg["BT"]), cdiv(C, cfg["BC"]))
    launcher(_pre_fwd)[grid](
        x_ptr=x, h_ptr=h_pre, u_ptr=u, N=N, C=C, stride_xt=x.stride(0), stride_xn=x.stride(1), NS=n, BT=cfg["BT"],
        BC=cfg["BC"], **launch_options(cfg))


def pre_u(x: Tensor, h_pre: Tensor, u_dtype: Optional[torch.dtype] = None) -> Tensor:
    """u [N, C] of x [N, n, C] by the streaming kernel, stored in u_dtype (None: x's), no autograd."""
    u = empty((x.shape[0], x.shape[2]), u_dtype or x.dtype, x.device)
    if x.shape[0] > 0:
        write_u(x, h_pre, u)
    return u


def _pre_fwd_body(x: Tensor, h_pre: Tensor) -> Tensor:
    return pre_u(x, h_pre)


pre_fwd = custom_op("stream_pre", _pre_fwd_body)


@pre_fwd.register_fake
def _(x, h_pre):
    return x.new_empty((x.shape[0], x.shape[2]))


def _pre_bwd_body(du: Tensor, x: Tensor, h_pre: Tensor) -> tuple[Tensor, Tensor]:
    N, n, C = x.shape
    dx = empty((N, n, C), x.dtype, x.device)
    dh = empty((N, n), torch.float32, x.device)
    if N > 0:
        x, h_pre, du = c_contig(x), h_pre.contiguous(), du.contiguous()
        cfg = tiles("pre_bwd", BC=np2(C, 16))
        launcher(_pre_bwd)[(cdiv(N, cfg["BT"]),)](
            x_ptr=x, h_ptr=h_pre, du_ptr=du, dx_ptr=dx, dh_ptr=dh, N=N, C=C, stride_xt=x.stride(0),
            stride_xn=x.stride(1), NS=n, BT=cfg["BT"], BC=cfg["BC"], **launch_options(cfg))
    return dx, dh.to(h_pre.dtype)


pre_bwd = custom_op("stream_pre_bwd", _pre_bwd_body)


@pre_bwd.register_fake
def _(du, x, h_pre):
    return fake_like(x), fake_like(h_pre)


def _pre_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pre_backward(ctx, du):
    x, h_pre = ctx.saved_tensors
    return body_of(ctx, pre_bwd)(du, x, h_pre)


pre_fwd.register_autograd(_pre_backward, setup_context=_pre_setup)

stream_pre_eager = eager_op(pre_fwd, _pre_setup, _pre_backward)
