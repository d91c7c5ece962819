"""`hc_coefficients`, HC's coefficients, unconstrained (docs/design.md §5; docs/kernels.md, "HC"): `hc_coef_fwd`
(h_pre, h_post, H^res), and the projection kernel, forward and backward that `rms_proj` (rms_proj.py, the projection
RMSNorm(x) w alone) and `hc_enter` (hc_enter.py, the coefficients and u = sum_i h_pre_i x_i) run as well.

Every HC logit of stream i is RMSNorm(x_i; g) w = RMSNorm(x_i)(diag(g) w) with w = [w_beta | w_m | W_r] ([C, n + 2],
`reference.hc_projection_weights`), so one projection of each (token, stream) row gives them all. Forward (`_hc_fwd`):
the shared projection (`projection.project_rows`, K = C) and the tail in the same program (tanh or linear, the scales
and static parts, H^res written transposed as the reference returns it); only the raw projection and 1/r are kept
([rows, n + 3] floats). Backward: `_hc_tail_bwd` per row block turns dh_pre / dh_post / dH^res into dL and d(sum x^2)
(with `hc_enter`'s <du, x_i> added to dh_pre first) and writes partial sums of the static parameters' gradient, then
the x pass on the same rows (`projection.x_pass`: dx, with h_pre_i du and the write-back's gradient of x, and dw).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import projection
from ..custom_ops import body_of, custom_op, eager_op
from ..host import c_contig, cdiv, empty, fake_like, grads_or_zeros, np2, or_
from ..launch_cache import launcher
from ..launch_config import launch_options, tiles
from ..partial_sums import sum_partials
from ..projection import forward_dot, project_rows, row_block

Tensor = torch.Tensor


@triton.jit(do_not_specialize=["R"])
def _hc_fwd(
    x_ptr, w_ptr, st_ptr, lg_ptr, rinv_ptr, hpre_ptr, hpost_ptr, hres_ptr, R, C, stride_x, stride_w, eps,
    M: tl.constexpr, MP: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    PAIRS: tl.constexpr = False, TAIL: tl.constexpr = 0, NH: tl.constexpr = 1,
):
    """x [R, C] rows: the raw projection L = x w into lg_ptr [R, M] and 1/r into rinv_ptr; TAIL (1: tanh, 2: linear)
    then also HC's coefficients from them (rows are (token, stream) pairs of NH streams; st_ptr: the statics)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    rinv = project_rows(x_ptr, w_ptr, lg_ptr, rinv_ptr, rows64, rmask, C, stride_x, stride_w, eps, M, MP, DOT, BT, BK,
                        PAIRS)
    if TAIL > 0:
        _hc_tail(lg_ptr, rinv, st_ptr, hpre_ptr, hpost_ptr, hres_ptr, rows64, rmask, M, NH, TAIL == 1)


@triton.jit
def _hc_act(y, TANH: tl.constexpr):
    if TANH:
        return 2.0 * tl.sigmoid(2.0 * y) - 1.0  # tanh
    else:
        return y


@triton.jit
def _hc_rows(lg_ptr, rinv, rows64, rmask, M: tl.constexpr, NH: tl.constexpr, TANH: tl.constexpr):
    """A block of HC's projection rows (token t, stream i = row % NH): the raw logits L (columns beta, m, then the NH
    of r) and their activations act(L / r)."""
    jj = tl.arange(0, NH)
    m2 = rmask[:, None] & (jj[None, :] < NH)
    l0 = tl.load(lg_ptr + rows64 * M, mask=rmask, other=0.0)
    l1 = tl.load(lg_ptr + rows64 * M + 1, mask=rmask, other=0.0)
    lr = tl.load(lg_ptr + rows64[:, None] * M + 2 + jj[None, :], mask=m2, other=0.0)
    return (l0, l1, lr, _hc_act(l0 * rinv, TANH), _hc_act(l1 * rinv, TANH), _hc_act(lr * rinv[:, None], TANH))


@triton.jit
def _hc_tail(lg_ptr, rinv, st_ptr, hpre_ptr, hpost_ptr, hres_ptr, rows64, rmask, M: tl.constexpr, NH: tl.constexpr,
             TANH: tl.constexpr):
    """HC's coefficients (reference.hc_from_projection) from the projection rows this program has just stored:
    h_post = B_i + s_beta act_0, h_pre = A_m,i + s_alpha act_1, H^res[t, j, i] = A_r,ij + s_alpha act_2+j.
    st_ptr: fp32 [s_beta, s_alpha, B (NH), A_m (NH), A_r (NH x NH)]."""
    tl.debug_barrier()  # this CTA's stores of L, re-read in per-map shapes
    jj = tl.arange(0, NH)
    m2 = rmask[:, None] & (jj[None, :] < NH)
    i = rows64 % NH
    t = rows64 // NH
    _, _, _, a0, a1, ar = _hc_rows(lg_ptr, rinv, rows64, rmask, M, NH, TANH)
    s_beta = tl.load(st_ptr)
    s_alpha = tl.load(st_ptr + 1)
    tl.store(hpost_ptr + rows64, tl.load(st_ptr + 2 + i, mask=rmask, other=0.0) + s_beta * a0, mask=rmask)
    tl.store(hpre_ptr + rows64, tl.load(st_ptr + 2 + NH + i, mask=rmask, other=0.0) + s_alpha * a1, mask=rmask)
    a_static = tl.load(st_ptr + 2 + 2 * NH + i[:, None] * NH + jj[None, :], mask=m2, other=0.0)
    tl.store(hres_ptr + t[:, None] * (NH * NH) + jj[None, :] * NH + i[:, None], a_static + s_alpha * ar, mask=m2)


@triton.jit(do_not_specialize=["R", "NP"])
def _hc_tail_bwd(lg_ptr, rinv_ptr, st_ptr, dpre_ptr, dpost_ptr, dres_ptr, dl_ptr, dss_ptr, part_ptr, x_ptr, du_ptr,
                 dun_ptr, R, NP, C, inv_c, M: tl.constexpr, NH: tl.constexpr, TANH: tl.constexpr, BT: tl.constexpr,
                 HAS_U: tl.constexpr = False, BC: tl.constexpr = 16, HAS_DPRE: tl.constexpr = True,
                 DU_NARROW: tl.constexpr = False):
    """Backward of `_hc_tail` and of y = L / r for a block of rows: dL = dy / r and d(sum x^2) (what `_coef_bwd_x`
    turns into dx and dw), and this program's partial sums of the static parameters' gradients (part [PW, NP]: column
    pid of NP programs, rows laid out as st_ptr; summed afterwards: deterministic, no atomics).
    HAS_U (`hc_enter`, where the op also computed u = sum_i h_pre_i x_i): dh_pre of row (t, i) first gains
    <du_t, x_ti>, reading the block's rows of x (x_ptr, [R, C]) and their tokens' du (du_ptr, [R / NH, C]).
    HAS_DPRE = False: h_pre had no gradient of its own (only through u): dh_pre starts at zero, nothing is read.
    DU_NARROW (with HAS_U): du is wider than x (u in the branch's dtype): rounded to x's dtype as the cast's
    backward would, and stored at dun_ptr ([R / NH, C], by each token's stream-0 row) for the x pass."""
    pid = tl.program_id(0)
    rows64, rmask, jj, m2 = row_block(R, BT, NH)
    i = rows64 % NH
    t = rows64 // NH
    rinv = tl.load(rinv_ptr + rows64, mask=rmask, other=0.0)
    l0, l1, lr, a0, a1, ar = _hc_rows(lg_ptr, rinv, rows64, rmask, M, NH, TANH)
    s_beta = tl.load(st_ptr)
    s_alpha = tl.load(st_ptr + 1)
    g0 = tl.load(dpost_ptr + rows64, mask=rmask, other=0.0)
    if HAS_DPRE:
        g1 = tl.load(dpre_ptr + rows64, mask=rmask, other=0.0)
    else:
        g1 = tl.zeros([BT], dtype=tl.float32)
    if HAS_U:  # the NH rows of a token share its du row (cache hits after the first)
        for c0 in range(0, C, BC):
            cc = c0 + tl.arange(0, BC)
            mc = rmask[:, None] & (cc[None, :] < C)
            xv = tl.load(x_ptr + rows64[:, None] * C + cc[None, :], mask=mc, other=0.0).to(tl.float32)
            dv = tl.load(du_ptr + t[:, None] * C + cc[None, :], mask=mc, other=0.0)
            if DU_NARROW:
                dv = dv.to(x_ptr.dtype.element_ty)
                tl.store(dun_ptr + t[:, None] * C + cc[None, :], dv, mask=mc & (i == 0)[:, None])
            g1 += tl.sum(xv * dv.to(tl.float32), axis=1)
    gr = tl.load(dres_ptr + t[:, None] * (NH * NH) + jj[None, :] * NH + i[:, None], mask=m2, other=0.0)
    if TANH:
        d0, d1, dr = g0 * s_beta * (1.0 - a0 * a0), g1 * s_alpha * (1.0 - a1 * a1), gr * s_alpha * (1.0 - ar * ar)
    else:
        d0, d1, dr = g0 * s_beta, g1 * s_alpha, gr * s_alpha
    tl.store(dl_ptr + rows64 * M, d0 * rinv, mask=rmask)
    tl.store(dl_ptr + rows64 * M + 1, d1 * rinv, mask=rmask)
    tl.store(dl_ptr + rows64[:, None] * M + 2 + jj[None, :], dr * rinv[:, None], mask=m2)
    # 1/r = (sum x^2 / C + eps)^(-1/2)
    dss = (-0.5 * inv_c) * (d0 * l0 + d1 * l1 + tl.sum(dr * lr, axis=1)) * rinv * rinv * rinv
    tl.store(dss_ptr + rows64, dss, mask=rmask)
    base = part_ptr + pid
    tl.store(base, tl.sum(g0 * a0, axis=0))
    tl.store(base + NP, tl.sum(g1 * a1, axis=0) + tl.sum(tl.sum(gr * ar, axis=1), axis=0))
    onehot = (i[:, None] == jj[None, :]).to(tl.float32)  # [BT, NH]: the stream of each row
    tl.store(base + (2 + jj) * NP, tl.sum(onehot * g0[:, None], axis=0))
    tl.store(base + (2 + NH + jj) * NP, tl.sum(onehot * g1[:, None], axis=0))
    d_ar = tl.sum(onehot[:, :, None] * gr[:, None, :], axis=0)  # [i, j]
    tl.store(base + (2 + 2 * NH + jj[:, None] * NH + jj[None, :]) * NP, d_ar)


def project(x: Tensor, w: Tensor, eps: float, lg: Tensor, rinv: Tensor, tail: Optional[tuple] = None) -> None:
    """`_hc_fwd` on x [R, C] rows (R > 0): the raw projection x w into lg and 1/r into rinv; with tail = (statics,
    h_pre, h_post, h_res, n, tanh) also HC's coefficients."""
    R, C = x.shape
    x, w = c_contig(x), c_contig(w)
    dot_mode, pairs = forward_dot(x, w)
    cfg = tiles("rms_proj", BK=np2(C, 16))
    statics, h_pre, h_post, h_res, n, tanh = tail if tail is not None else (w, lg, lg, lg, 1, False)
    launcher(_hc_fwd)[(cdiv(R, cfg["BT"]),)](
        x_ptr=x, w_ptr=w, st_ptr=statics, lg_ptr=lg, rinv_ptr=rinv, hpre_ptr=h_pre, hpost_ptr=h_post, hres_ptr=h_res,
        R=R, C=C, stride_x=x.stride(0), stride_w=w.stride(0), eps=eps, M=w.shape[1], MP=np2(w.shape[1], 16),
        DOT=dot_mode, BT=cfg["BT"], BK=cfg["BK"], PAIRS=pairs, TAIL=0 if tail is None else 1 if tanh else 2, NH=n,
        **launch_options(cfg))


def hc_statics(s_alpha: Tensor, s_beta: Tensor, b_static: Tensor, am_static: Tensor, ar_static: Tensor) -> Tensor:
    """HC's static parameters as its kernels take them: fp32 [s_beta, s_alpha, B (n), A_m (n), A_r (n x n)], one
    autograd-tracked concatenation (its backward splits the op's one gradient vector back onto the parameters)."""
    return torch.cat([s_beta.reshape(1).float(), s_alpha.reshape(1).float(), b_static.float(), am_static.float(),
                      ar_static.float().flatten()])


def coefficients(x: Tensor, w: Tensor, statics: Tensor, n: int, eps: float,
                 tanh: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [R, C] rows (token, stream i = row % n), w [C, n + 2], statics (`hc_statics`) -> h_pre [R], h_post [R],
    h_res [R / n, n, n] fp32 (h_res[t, j, i] = A_r,ij + s_alpha act(y_i,2+j)), the raw projection [R, n + 2] and
    1/r [R], in one launch."""
    R = x.shape[0]
    f32 = torch.float32
    h_pre, h_post, h_res = empty((R,), f32, x.device), empty((R,), f32, x.device), empty((R // n, n, n), f32, x.device)
    lg, rinv = empty((R, w.shape[1]), f32, x.device), empty((R,), f32, x.device)
    if R > 0:
        project(x, w, eps, lg, rinv, tail=(statics, h_pre, h_post, h_res, n, tanh))
    return h_pre, h_post, h_res, lg, rinv


def _hc_coef_fwd_body(x: Tensor, w: Tensor, statics: Tensor, n: int, eps: float,
                      tanh: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return coefficients(x, w, statics, n, eps, tanh)


hc_coef_fwd = custom_op("hc_coefficients", _hc_coef_fwd_body)


@hc_coef_fwd.register_fake
def _(x, w, statics, n, eps, tanh):
    R = x.shape[0]
    f32 = dict(dtype=torch.float32)
    return (x.new_empty((R,), **f32), x.new_empty((R,), **f32), x.new_empty((R // n, n, n), **f32),
            x.new_empty((R, w.shape[1]), **f32), x.new_empty((R,), **f32))


def backward(d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, x: Tensor, w: Tensor, statics: Tensor,
             lg: Tensor, rinv: Tensor, n: int, tanh: bool, h_pre: Optional[Tensor] = None, du: Optional[Tensor] = None,
             dx_in: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dw and the statics' gradient of x [R, C] rows: the tail's backward per row (`_hc_tail_bwd`), then the x
    pass. With du (`hc_enter`: u = sum_i h_pre_i x_i was computed too): dh_pre gains <du, x_i> in the tail pass and dx
    gains h_pre_i du (+ dx_in) in the x pass: one dx for the whole op."""
    R, C = x.shape
    M = w.shape[1]
    dx = empty((R, C), x.dtype, x.device)
    if R == 0:
        return dx, torch.zeros_like(w), torch.zeros_like(statics)
    x = c_contig(x)
    with_u = du is not None
    du = du.contiguous() if with_u else None
    narrow = with_u and du.dtype != x.dtype  # u in the branch's dtype: the tail pass rounds du back
    dun = empty(du.shape, x.dtype, x.device) if narrow else None
    cfg = tiles("hc_tail_bwd", BC=np2(C, 16))
    programs = cdiv(R, cfg["BT"])
    dl, dss = empty((R, M), torch.float32, x.device), empty((R,), torch.float32, x.device)
    part = empty((statics.shape[0], programs), torch.float32, x.device)
    launcher(_hc_tail_bwd)[(programs,)](
        lg_ptr=lg, rinv_ptr=rinv, st_ptr=statics, dpre_ptr=lg if d_pre is None else d_pre.contiguous(),
        dpost_ptr=d_post.contiguous(), dres_ptr=d_res.contiguous(), dl_ptr=dl, dss_ptr=dss, part_ptr=part, x_ptr=x,
        du_ptr=du if with_u else x, dun_ptr=or_(dun, x), R=R, NP=programs, C=C, inv_c=1.0 / C, M=M, NH=n, TANH=tanh,
        BT=cfg["BT"], HAS_U=with_u, BC=cfg["BC"], HAS_DPRE=d_pre is not None, DU_NARROW=narrow, **launch_options(cfg))
    du = or_(dun, du)
    dw = projection.x_pass(x.view(R, 1, C), c_contig(w), dl, dss, dx.view(R, 1, C), h_pre=h_pre if with_u else None,
                           du=du, dx_in=None if dx_in is None else c_contig(dx_in).view(R, 1, C), u_rows=n)
    dw_sum, dstatics = empty(w.shape, w.dtype, w.device), empty((part.shape[0],), torch.float32, x.device)
    sum_partials(dw, dw_sum, part, dstatics)
    return dx, dw_sum, dstatics


def _hc_coef_bwd_body(d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, x: Tensor, w: Tensor, statics: Tensor,
                      lg: Tensor, rinv: Tensor, n: int, tanh: bool) -> tuple[Tensor, Tensor, Tensor]:
    return backward(d_pre, d_post, d_res, x, w, statics, lg, rinv, n, tanh)


hc_coef_bwd = custom_op("hc_coefficients_bwd", _hc_coef_bwd_body)


@hc_coef_bwd.register_fake
def _(d_pre, d_post, d_res, x, w, statics, lg, rinv, n, tanh):
    return fake_like(x), fake_like(w), fake_like(statics)


def _hc_coef_setup(ctx, inputs, output):
    x, w, statics, n, _, tanh = inputs
    ctx.save_for_backward(x, w, statics, output[3], output[4])
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.n, ctx.tanh = n, tanh


def coefficient_grads(rows: int, n: int, device, d_pre, d_post, d_res) -> tuple[Optional[Tensor], ...]:
    """The op's incoming coefficient gradients, zeros of their shapes where autograd gave none (`grads_or_zeros`)."""
    return grads_or_zeros(device, d_pre, (d_post, (rows,)), (d_res, (rows // n, n, n)))


def _hc_coef_backward(ctx, d_pre, d_post, d_res, _dlg, _drinv):
    x, w, statics, lg, rinv = ctx.saved_tensors
    dh = coefficient_grads(x.shape[0], ctx.n, x.device, d_pre, d_post, d_res)
    dx, dw, dst = body_of(ctx, hc_coef_bwd)(*dh, x, w, statics, lg, rinv, ctx.n, ctx.tanh)
    return dx, dw, dst, None, None, None


hc_coef_fwd.register_autograd(_hc_coef_backward, setup_context=_hc_coef_setup)


# the op as the public wrappers call it (custom_ops.eager_op)
hc_coef_eager = eager_op(hc_coef_fwd, _hc_coef_setup, _hc_coef_backward)
