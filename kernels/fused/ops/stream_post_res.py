"""The sublayer's write-back x_next_i = sum_j H^res_ij x_j + h_post_i f (docs/design.md §1, §8): `stream_post_res`
and its backward; with `request_u`, the backward also gives a branch its input u back (docs/design.md §9).

Forward (`_post_fwd`): reads x [N, n, C] and f [N, C] once, writes x_next [N, n, C]: (n+1)C read, nC written, the
paper's fused count. H^res = None (identity-HC) is the constexpr HAS_RES = False path.
Backward (`_post_bwd_2d`), reading dx_next, x and f once on the forward's 2-D grid (token block x C block):
  dx_j = sum_i H_ij dx_next_i,  df = sum_i h_post_i dx_next_i,
  dH_ij = <dx_next_i, x_j>,      dh_post_i = <dx_next_i, f>   (C-reductions kept in registers).
With HAS_U it also writes u = sum_j h_pre_j x_j of the sublayer whose write-back this is (its own h_pre): the stream
tiles it reads anyway, so a branch that dropped its input (HyperConfig.rebuild_branch_input) gets it back without
reading x again.
"""
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from ..custom_ops import body_of, custom_op, eager_op
from ..host import c_contig, cdiv, empty, fake_like, np2, num_sms
from ..launch_cache import launcher
from ..launch_config import CONFIG, launch_options, tiles
from ..partial_sums import sum_partials

Tensor = torch.Tensor


@triton.jit(do_not_specialize=["N"])
def _post_fwd(
    x_ptr, f_ptr, hp_ptr, hr_ptr, out_ptr, N, C, stride_xt, stride_xn, stride_ft,
    NS: tl.constexpr, HAS_RES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ii = tl.arange(0, NS)
    m2 = rmask[:, None] & (cc[None, :] < C)
    m3 = m2[:, None, :] & (ii[None, :, None] < NS)
    tokn = rmask[:, None] & (ii[None, :] < NS)
    f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    hp = tl.load(hp_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0).to(tl.float32)
    acc = hp[:, :, None] * f[:, None, :]
    if HAS_RES:
        for j in tl.static_range(NS):
            xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
            hj = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + ii[None, :] * NS + j, mask=tokn, other=0.0)
            acc += hj.to(tl.float32)[:, :, None] * xj.to(tl.float32)[:, None, :]
    else:
        x = tl.load(x_ptr + rows64[:, None, None] * stride_xt + ii[None, :, None] * stride_xn + cc[None, None, :],
                    mask=m3, other=0.0)
        acc += x.to(tl.float32)
    off = rows64[:, None, None] * (NS * C) + ii[None, :, None] * C + cc[None, None, :]
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=m3)


@triton.jit(do_not_specialize=["N"])
def _post_bwd_2d(
    x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, hu_ptr, u_ptr,
    N, C, stride_xt, stride_xn, stride_ft,
    NS: tl.constexpr, HAS_RES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LOOP_STAGES: tl.constexpr = 0,
    HAS_U: tl.constexpr = False,
):
    """Backward on the forward's 2-D grid (token block x C block), no C loop: every stream sum is a broadcast
    multiply-add and the only reductions are over this C block. dH [.., n, n] and dh_post [.., n] go to
    dhr_ptr / dhp_ptr at row (C block * N + token): with one C block (BC >= C) those are the outputs themselves
    (no partial buffer, no second launch); otherwise per-C-block partials [n_cblk, N, ...] summed afterwards.
    LOOP_STAGES > 0: fewer programs than token blocks, each walking token blocks pid, pid + programs, ... in a loop
    pipelined that deep (tl.range num_stages: the next blocks' loads are async copies in flight while this one is
    reduced and stored); 0: one token block per program.
    HAS_U: also u [N, C] (u_ptr's dtype, rounded through x's as the forward ops round it) = sum_j h_j x_j with this
    sublayer's h_pre [N, n] (hu_ptr), summed in `_pre_fwd`'s order."""
    if LOOP_STAGES > 0:
        for tb in tl.range(tl.program_id(0), tl.cdiv(N, BT), tl.num_programs(0), num_stages=LOOP_STAGES):
            _post_bwd_tile(tb, x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, hu_ptr, u_ptr, N,
                           C, stride_xt, stride_xn, stride_ft, NS, HAS_RES, BT, BC, HAS_U)
    else:
        _post_bwd_tile(tl.program_id(0), x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, hu_ptr,
                       u_ptr, N, C, stride_xt, stride_xn, stride_ft, NS, HAS_RES, BT, BC, HAS_U)


@triton.jit
def _post_bwd_tile(
    tb, x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, hu_ptr, u_ptr, N, C, stride_xt,
    stride_xn, stride_ft, NS: tl.constexpr, HAS_RES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    HAS_U: tl.constexpr,
):
    """`_post_bwd_2d` on token block tb and this program's C block."""
    rows = tb * BT + tl.arange(0, BT)
    cb = tl.program_id(1)
    cc = cb * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    prow = cb.to(tl.int64) * N + rows64  # row of the (partial) dH / dh_post outputs
    ii = tl.arange(0, NS)
    m2 = rmask[:, None] & (cc[None, :] < C)
    m3 = m2[:, None, :] & (ii[None, :, None] < NS)
    tokn = rmask[:, None] & (ii[None, :] < NS)
    off3 = rows64[:, None, None] * (NS * C) + ii[None, :, None] * C + cc[None, None, :]  # contiguous [N, n, C]
    # the gradient reaching x_next, all n streams of this block: G [BT, n, BC]
    g = tl.load(g_ptr + off3, mask=m3, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    hp = tl.load(hp_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0).to(tl.float32)
    tl.store(df_ptr + rows64[:, None] * C + cc[None, :], tl.sum(hp[:, :, None] * g, axis=1).to(df_ptr.dtype.element_ty),
             mask=m2)
    tl.store(dhp_ptr + prow[:, None] * NS + ii[None, :], tl.sum(g * f[:, None, :], axis=2), mask=tokn)
    u = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_RES:
        for j in tl.static_range(NS):
            # column j of H: dx_j = sum_i H_ij G_i, dH_ij = <G_i, x_j> over this C block
            hj = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + ii[None, :] * NS + j, mask=tokn, other=0.0)
            dxj = tl.sum(hj.to(tl.float32)[:, :, None] * g, axis=1)
            tl.store(dx_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], dxj.to(dx_ptr.dtype.element_ty),
                     mask=m2)
            xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
            tl.store(dhr_ptr + prow[:, None] * (NS * NS) + ii[None, :] * NS + j,
                     tl.sum(g * xj.to(tl.float32)[:, None, :], axis=2), mask=tokn)
            if HAS_U:
                hj_u = tl.load(hu_ptr + rows64 * NS + j, mask=rmask, other=0.0).to(tl.float32)
                u += hj_u[:, None] * xj.to(tl.float32)
    else:
        tl.store(dx_ptr + off3, g.to(dx_ptr.dtype.element_ty), mask=m3)
        if HAS_U:  # H^res = I reads no x: the stream tiles for u alone
            for j in tl.static_range(NS):
                xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
                hj_u = tl.load(hu_ptr + rows64 * NS + j, mask=rmask, other=0.0).to(tl.float32)
                u += hj_u[:, None] * xj.to(tl.float32)
    if HAS_U:
        tl.store(u_ptr + rows64[:, None] * C + cc[None, :], u.to(x_ptr.dtype.element_ty).to(u_ptr.dtype.element_ty),
                 mask=m2)


def post_backward(g: Tensor, x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, hu: Optional[Tensor] = None,
                  u_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The write-back's backward: (dx, df, dh_post, dh_res), the coefficients' gradients in fp32. hu, u_out: this
    sublayer's h_pre [N, n] and a [N, C] buffer the kernel writes its u into (`request_u`)."""
    N, n, C = x.shape
    has_res = h_res.shape[-1] != 0
    dev = x.device
    dx, df = empty((N, n, C), x.dtype, dev), empty((N, C), f.dtype, dev)
    dhp = empty((N, n), torch.float32, dev)
    dhr = empty((N, n, n) if has_res else (N, 0, 0), torch.float32, dev)
    if N == 0:
        return dx, df, dhp, dhr
    x, f, g = c_contig(x), c_contig(f), g.contiguous()
    # whole rows per program up to rows_max_c (no partials to sum: one launch and two allocations less)
    cfg = tiles("post_bwd", "rows" if C <= CONFIG["post_bwd"]["rows_max_c"] else None, BC=np2(C, 16))
    n_cblk = cdiv(C, cfg["BC"])
    if n_cblk == 1:  # whole rows per program: the kernel writes dh_post / dH directly
        php, phr = dhp, dhr
    else:
        php = empty((n_cblk, N, n), torch.float32, dev)
        phr = empty((n_cblk, N, n, n) if has_res else (1,), torch.float32, dev)
    blocks, stages = cdiv(N, cfg["BT"]), cfg["loop_stages"]
    has_u = u_out is not None
    if stages:
        per_sm = cfg["u_programs_per_sm" if has_u else "programs_per_sm"]
        blocks = min(blocks, max(1, per_sm * num_sms(dev) // n_cblk))
    hu, u_out = (hu.contiguous(), u_out) if has_u else (g, g)  # unused pointers without u
    launcher(_post_bwd_2d)[(blocks, n_cblk)](
        x_ptr=x, f_ptr=f, hp_ptr=h_post.contiguous(), hr_ptr=h_res.contiguous(), g_ptr=g, dx_ptr=dx, df_ptr=df,
        dhp_ptr=php, dhr_ptr=phr, hu_ptr=hu, u_ptr=u_out, N=N, C=C, stride_xt=x.stride(0), stride_xn=x.stride(1),
        stride_ft=f.stride(0), NS=n, HAS_RES=has_res, BT=cfg["BT"], BC=cfg["BC"], LOOP_STAGES=stages, HAS_U=has_u,
        **launch_options(cfg))
    if n_cblk > 1:  # the per-C-block partials summed in one launch
        sum_partials(php, dhp, wpart2=phr if has_res else None, dw2=dhr if has_res else None)
    return dx, df, dhp, dhr


def post_forward(x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """x_next [N, n, C] of x [N, n, C], f [N, C], h_post [N, n] and h_res [N, n, n] (or [N, 0, 0] for H^res = I)."""
    N, n, C = x.shape
    out = empty((N, n, C), x.dtype, x.device)
    if N == 0:
        return out
    x, f = c_contig(x), c_contig(f)
    cfg = tiles("post_fwd", BC=np2(C, 16))
    grid = (cdiv(N, cfg["BT"]), cdiv(C, cfg["BC"]))
    launcher(_post_fwd)[grid](
        x_ptr=x, f_ptr=f, hp_ptr=h_post.contiguous(), hr_ptr=h_res.contiguous(), out_ptr=out, N=N, C=C,
        stride_xt=x.stride(0), stride_xn=x.stride(1), stride_ft=f.stride(0), NS=n, HAS_RES=h_res.shape[-1] != 0,
        BT=cfg["BT"], BC=cfg["BC"], **launch_options(cfg))
    return out


def _post_fwd_body(x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, route: Optional[Tensor] = None) -> Tensor:
    """route (`Routed`, under torch.compile): not read; the backward returns x's gradient as route's."""
    return post_forward(x, f, h_post, h_res)


post_fwd = custom_op("stream_post_res", _post_fwd_body)


@post_fwd.register_fake
def _(x, f, h_post, h_res, route=None):
    return fake_like(x)


def post_backward_in_dtypes(g, x, f, h_post, h_res, hu=None, u_out=None):
    """`post_backward` with dh_post and dh_res in their coefficients' dtypes."""
    dx, df, dhp, dhr = post_backward(g, x, f, h_post, h_res, hu=hu, u_out=u_out)
    return dx, df, dhp.to(h_post.dtype), dhr.to(h_res.dtype)


def _post_bwd_body(g: Tensor, x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor) -> tuple[Tensor, Tensor, Tensor,
                                                                                            Tensor]:
    return post_backward_in_dtypes(g, x, f, h_post, h_res)


post_bwd = custom_op("stream_post_res_bwd", _post_bwd_body)


@post_bwd.register_fake
def _(g, x, f, h_post, h_res):
    return fake_like(x), fake_like(f), fake_like(h_post), fake_like(h_res)


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


def requested_u(ctx, x: Tensor) -> tuple:
    """In an eager write-back's backward: (hu, u_out) when a branch asked for the u of this stream x, else ()."""
    if not _REQUESTS or not getattr(ctx, "eager", False):
        return ()
    req = _REQUESTS.pop(x.data_ptr(), None)
    if req is None or tuple(req.h_pre.shape) != tuple(x.shape[:2]):
        return ()
    req.u = empty((x.shape[0], x.shape[2]), req.dtype, x.device)
    return req.h_pre, req.u


def _post_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.inputs, ctx.routed = len(inputs), len(inputs) > 4 and inputs[4] is not None


def _post_backward(ctx, g):
    x, f, h_post, h_res = ctx.saved_tensors
    wanted = requested_u(ctx, x)  # eager only: the plain body, with the u buffer
    dx, df, dhp, dhr = (post_backward_in_dtypes(g, x, f, h_post, h_res, *wanted) if wanted else
                        body_of(ctx, post_bwd)(g, x, f, h_post, h_res))
    return ((None, df, dhp, dhr, dx) if ctx.routed else (dx, df, dhp, dhr, None))[:ctx.inputs]


post_fwd.register_autograd(_post_backward, setup_context=_post_setup)

stream_post_res_eager = eager_op(post_fwd, _post_setup, _post_backward)
