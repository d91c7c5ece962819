"""`mhc_coefficients` (docs/design.md §2-3, §10; docs/kernels.md, "mHC's coefficients and the sublayer's entry"):
`coef_fwd` (h_pre, h_post, H^res), and the forward and backward that `mhc_pre` (mhc_pre.py), `mhc_enter`
(mhc_enter.py) and `mhc_boundary` (mhc_boundary.py) run with u.

Forward, one kernel (`_coef_fwd`): one read of x [N, n, C] yields the raw projection L = x phi [N, M]
(M = n^2 + 2n) and sum(x^2) (`projection`); the per-token tail (norm after the product, gates, bias, sigmoid / 2
sigmoid, Sinkhorn) runs in fp32 registers. Only L and 1/r (M + 1 floats per token) are kept for the backward. With
HAS_U the same kernel writes u while the token block it has just streamed is still in L2 (up to
CONFIG["coef_fwd"]["u_inside_max_c"]); otherwise u comes from stream_pre's streaming kernel after it.

Backward, two kernels: `_coef_bwd_tok` per token turns dh_pre / dh_post / dh_res into dL (the gradient of the raw
projection) and d(sum x^2), with Sinkhorn's backward for the res logits (`sinkhorn.res_backward`) and, with HAS_U,
dh_pre += <du, x_j> first (one read of du and x); bias and alpha gradients go to per-program partial sums. Then the
projection's x pass (`projection.x_pass`) writes the op's one dx and the phi gradient's partials.

Token and Sinkhorn counts are runtime arguments (never specialised); strides depend on C only.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import projection
from ..custom_ops import body_of, custom_op, eager_op, with_options
from ..host import c_contig, cdiv, empty, fake_like, grads_or_zeros, np2, or_, token_rows
from ..launch_cache import launcher
from ..launch_config import launch_options, tiles
from ..partial_sums import sum_partials
from ..projection import forward_dot, forward_tiles, project_rows, row_block
from ..sinkhorn import _coef_tail, res_backward, res_tail
from .stream_pre import write_u

Tensor = torch.Tensor


@triton.jit(do_not_specialize=["N", "iters"])
def _coef_fwd(
    x_ptr, phi_ptr, bias_ptr, alpha_ptr, lg_ptr, rinv_ptr, hpre_ptr, hpost_ptr, hres_ptr, u_ptr,
    N, C, stride_x, stride_phi, iters, eps, rms_eps, pre_eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, HAS_RES: tl.constexpr, SINK: tl.constexpr,
    HAS_U: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr,
    DOT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, PAIRS: tl.constexpr = False,
):
    """x [N, n*C] rows (stride_x); BK: tile of the flat row in the projection loop, BC: C tile of the u loop.
    SINK: H^res here (else `_coef_tail` computes it afterwards)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    rinv = project_rows(x_ptr, phi_ptr, lg_ptr, rinv_ptr, rows64, rmask, NS * C, stride_x, stride_phi, rms_eps, M, MP,
                        DOT, BT, BK, PAIRS)
    nn = tl.arange(0, NS)
    tok = rmask[:, None] & (nn[None, :] < NS)
    # Re-read the projection in per-map shapes (a register tile cannot be sliced); the barrier makes this CTA's
    # stores visible to all its threads.
    tl.debug_barrier()
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    l_pre = tl.load(lg_ptr + rows64[:, None] * M + nn[None, :], mask=tok, other=0.0)
    l_post = tl.load(lg_ptr + rows64[:, None] * M + NS + nn[None, :], mask=tok, other=0.0)
    y_pre = a_pre * rinv[:, None] * l_pre + tl.load(bias_ptr + nn).to(tl.float32)[None, :]
    y_post = a_post * rinv[:, None] * l_post + tl.load(bias_ptr + NS + nn).to(tl.float32)[None, :]
    h_pre = tl.sigmoid(y_pre) + pre_eps
    tl.store(hpre_ptr + rows64[:, None] * NS + nn[None, :], h_pre, mask=tok)
    tl.store(hpost_ptr + rows64[:, None] * NS + nn[None, :], post_mult * tl.sigmoid(y_post), mask=tok)
    if HAS_U:
        # u = sum_j h_pre_j x_j: this block of x was just streamed by the same program (L2 hits)
        for c0 in range(0, C, BC):
            cc = c0 + tl.arange(0, BC)
            m2 = rmask[:, None] & (cc[None, :] < C)
            u = tl.zeros([BT, BC], dtype=tl.float32)
            for j in tl.static_range(NS):
                hj = tl.sum(tl.where(nn[None, :] == j, h_pre, 0.0), axis=1)
                xj = tl.load(x_ptr + rows64[:, None] * stride_x + j * C + cc[None, :], mask=m2, other=0.0)
                u += hj[:, None] * xj.to(tl.float32)
            # rounded to the stream's dtype first: a wider u (the branch's dtype) holds the values a cast would
            u = u.to(x_ptr.dtype.element_ty).to(u_ptr.dtype.element_ty)
            tl.store(u_ptr + rows64[:, None] * C + cc[None, :], u, mask=m2)
    if HAS_RES and SINK:
        res_tail(lg_ptr, bias_ptr, alpha_ptr, hres_ptr, rows64, rmask, rinv, iters, eps, NS, M, T_IN, T_OUT)


@triton.jit
def _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS: tl.constexpr, BC: tl.constexpr,
              LOOP_STAGES: tl.constexpr, DU_NARROW: tl.constexpr):
    """dh_pre_j + <du, x_j> for the block's tokens (u = sum_j h_pre_j x_j; one read of du and x). DU_NARROW: du came
    in wider than x (u handed to the branch in its dtype): each tile is rounded to x's dtype, as the cast's backward
    would have, and stored at dun_ptr for the x pass."""
    for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):
        cc = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cc[None, :] < C)
        du = tl.load(du_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0)
        if DU_NARROW:
            du = du.to(x_ptr.dtype.element_ty)
            tl.store(dun_ptr + rows64[:, None] * C + cc[None, :], du, mask=m2)
        du = du.to(tl.float32)
        for j in tl.static_range(NS):
            xj = tl.load(x_ptr + rows64[:, None] * stride_x + j * C + cc[None, :], mask=m2, other=0.0)
            dh_pre += tl.where(nn[None, :] == j, tl.sum(du * xj.to(tl.float32), axis=1)[:, None], 0.0)
    return dh_pre


@triton.jit(do_not_specialize=["N", "NP", "iters"])
def _coef_bwd_tok(
    lg_ptr, rinv_ptr, bias_ptr, alpha_ptr, dpre_ptr, dpost_ptr, dres_ptr, dl_ptr, dss_ptr, part_ptr, sc_ptr,
    x_ptr, du_ptr, dun_ptr, N, NP, K, C, stride_x, iters, eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, HAS_RES: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr,
    HAS_U: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_DPRE: tl.constexpr = True,
    LOOP_STAGES: tl.constexpr = None, DU_NARROW: tl.constexpr = False,
):
    """Per token block: dL [N, M], d(sum x^2) [N], and this program's column of the bias / alpha partial sums
    (part_ptr [M + 3, NP]). HAS_DPRE = False: h_pre had no gradient of its own (the model reads it only through u):
    dh_pre starts at zero, no zero tensor is made for it. LOOP_STAGES: the <du, x_j> loop's pipelining depth (None:
    Triton's default, which pipelines only a dot's operands, so none of this loop's loads). DU_NARROW (with HAS_U):
    du is wider than x; its copy in x's dtype goes to dun_ptr."""
    pid = tl.program_id(0)
    rows64, rmask, nn, tok = row_block(N, BT, NS)
    rinv = tl.load(rinv_ptr + rows64, mask=rmask, other=0.0)
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    # masked rows load dh = 0, so they contribute nothing to any reduction below
    l_pre = tl.load(lg_ptr + rows64[:, None] * M + nn[None, :], mask=tok, other=0.0)
    s = tl.sigmoid(a_pre * rinv[:, None] * l_pre + tl.load(bias_ptr + nn).to(tl.float32)[None, :])
    if HAS_DPRE:
        dh_pre = tl.load(dpre_ptr + rows64[:, None] * NS + nn[None, :], mask=tok, other=0.0)
    else:
        dh_pre = tl.zeros([BT, NS], dtype=tl.float32)
    if HAS_U:
        dh_pre = _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS, BC, LOOP_STAGES,
                           DU_NARROW)
    if HAS_RES:
        drinv = res_backward(lg_ptr, bias_ptr, alpha_ptr, dres_ptr, dl_ptr, part_ptr, sc_ptr, pid, NP, rows64, rmask,
                             rinv, N, iters, eps, NS, M, T_IN, T_OUT)
    else:
        drinv = tl.zeros([BT], dtype=tl.float32)
        tl.store(part_ptr + (M + 2) * NP + pid, 0.0)
    dy_pre = dh_pre * s * (1.0 - s)
    l_post = tl.load(lg_ptr + rows64[:, None] * M + NS + nn[None, :], mask=tok, other=0.0)
    s = tl.sigmoid(a_post * rinv[:, None] * l_post + tl.load(bias_ptr + NS + nn).to(tl.float32)[None, :])
    dy_post = tl.load(dpost_ptr + rows64[:, None] * NS + nn[None, :], mask=tok, other=0.0) * post_mult * s * (1.0 - s)
    tl.store(dl_ptr + rows64[:, None] * M + nn[None, :], dy_pre * a_pre * rinv[:, None], mask=tok)
    tl.store(dl_ptr + rows64[:, None] * M + NS + nn[None, :], dy_post * a_post * rinv[:, None], mask=tok)
    # d loss / d rinv, and per-program partial sums of the bias and alpha gradients
    drinv += tl.sum(dy_pre * a_pre * l_pre, axis=1) + tl.sum(dy_post * a_post * l_post, axis=1)
    tl.store(part_ptr + nn * NP + pid, tl.sum(dy_pre, axis=0))
    tl.store(part_ptr + (NS + nn) * NP + pid, tl.sum(dy_post, axis=0))
    tl.store(part_ptr + M * NP + pid, tl.sum(tl.sum(dy_pre * l_pre, axis=1) * rinv, axis=0))
    tl.store(part_ptr + (M + 1) * NP + pid, tl.sum(tl.sum(dy_post * l_post, axis=1) * rinv, axis=0))
    # rinv = (sumsq / K + rms_eps)^(-1/2)  =>  d rinv / d sumsq = -rinv^3 / (2K)
    tl.store(dss_ptr + rows64, -0.5 * drinv * rinv * rinv * rinv / K, mask=rmask)


def forward(x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
            rms_eps: float, pre_eps: float, post_mult: float, with_u: bool, u_dtype: Optional[torch.dtype] = None):
    """The coefficients of x [N, n, C] (and u = sum_j h_pre_j x_j when with_u, stored in u_dtype or x's): (u or None,
    h_pre [N, n], h_post [N, n], h_res [N, n, n] (or [N, 0, 0]: H^res = I), raw logits [N, M], 1/r [N])."""
    N, n, C = x.shape
    M = phi.shape[1]
    has_res = M == n * n + 2 * n
    dev, f32 = x.device, torch.float32
    h_pre, h_post = empty((N, n), f32, dev), empty((N, n), f32, dev)
    h_res = empty((N, n, n) if has_res else (N, 0, 0), f32, dev)
    lg, rinv = empty((N, M), f32, dev), empty((N,), f32, dev)
    u = empty((N, C), u_dtype or x.dtype, dev) if with_u else None
    if N == 0:
        return u, h_pre, h_post, h_res, lg, rinv
    x, phi, bias, alpha = token_rows(x), c_contig(phi), bias.contiguous(), alpha.contiguous()
    dot_mode, pairs = forward_dot(x, phi)
    cfg = forward_tiles("coef_fwd", dot_mode, pairs, BK=np2(n * C, 16), BC=np2(C, 16))
    # Sinkhorn in a launch of its own (small token blocks: no serial tail behind a GEMM loop), but in the kernel with
    # phi as pairs, whose narrower tiles tied on device time there: one launch less of host time
    own_launch = has_res and not pairs
    u_inside = with_u and C <= cfg["u_inside_max_c"]
    launcher(_coef_fwd)[(cdiv(N, cfg["BT"]),)](
        x_ptr=x, phi_ptr=phi, bias_ptr=bias, alpha_ptr=alpha, lg_ptr=lg, rinv_ptr=rinv, hpre_ptr=h_pre,
        hpost_ptr=h_post, hres_ptr=h_res, u_ptr=u if u_inside else h_pre, N=N, C=C, stride_x=x.stride(0),
        stride_phi=phi.stride(0), iters=iters, eps=eps, rms_eps=rms_eps, pre_eps=pre_eps, post_mult=post_mult, NS=n,
        M=M, MP=np2(M, 16), HAS_RES=has_res, SINK=not own_launch, HAS_U=u_inside, T_IN=t_in, T_OUT=t_out, DOT=dot_mode,
        BT=cfg["BT"], BK=cfg["BK"], BC=cfg["BC"], PAIRS=pairs, **launch_options(cfg))
    if with_u and not u_inside:  # u by stream_pre's streaming kernel: x read again, at copy speed
        write_u(x, h_pre, u)
    if own_launch:
        ct = tiles("coef_tail")
        launcher(_coef_tail)[(cdiv(N, ct["BT"]),)](
            lg_ptr=lg, rinv_ptr=rinv, bias_ptr=bias, alpha_ptr=alpha, hres_ptr=h_res, N=N, iters=iters, eps=eps, NS=n,
            M=M, T_IN=t_in, T_OUT=t_out, BT=ct["BT"], **launch_options(ct))
    return u, h_pre, h_post, h_res, lg, rinv


def token_backward(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult, du=None):
    """Per token: dh_* (+ <du, x_j> into dh_pre when du is given) -> dL [N, M], d(sum x^2) [N], per-program bias /
    alpha partials [M + 3, programs], and du as the x pass takes it: in x's dtype, rounded here when it came wider
    (u in the branch's dtype). d_pre None: zero (read by no one)."""
    N, n, C = x.shape
    M = phi.shape[1]
    has_res = M == n * n + 2 * n
    dev = x.device
    ct = tiles("coef_bwd_tok", BC=np2(C, 16))
    n_prog = cdiv(N, ct["BT"])
    dl, dss = empty((N, M), torch.float32, dev), empty((N,), torch.float32, dev)
    part = empty((M + 3, n_prog), torch.float32, dev)
    # Sinkhorn's replay scratch: 2 iters - 1 reciprocal sums of n floats per token (written before it is read)
    sc = torch.empty(((2 * iters - 1) * N * n) if has_res else 1, dtype=torch.float32, device=dev)
    with_u = du is not None
    narrow = with_u and du.dtype != x.dtype
    dun = empty(du.shape, x.dtype, dev) if narrow else None
    launcher(_coef_bwd_tok)[(n_prog,)](
        lg_ptr=lg, rinv_ptr=rinv, bias_ptr=bias.contiguous(), alpha_ptr=alpha.contiguous(),
        dpre_ptr=lg if d_pre is None else d_pre.contiguous(), dpost_ptr=d_post.contiguous(),
        dres_ptr=d_res.contiguous(), dl_ptr=dl, dss_ptr=dss, part_ptr=part, sc_ptr=sc, x_ptr=x,
        du_ptr=du.contiguous() if with_u else x, dun_ptr=or_(dun, x), N=N, NP=n_prog, K=n * C, C=C,
        stride_x=x.stride(0), iters=iters, eps=eps, post_mult=post_mult, NS=n, M=M, HAS_RES=has_res, T_IN=t_in,
        T_OUT=t_out, HAS_U=with_u, HAS_DPRE=d_pre is not None, BT=ct["BT"], BC=ct["BC"], LOOP_STAGES=ct["loop_stages"],
        DU_NARROW=narrow, **launch_options(ct))
    return dl, dss, part, or_(dun, du)


def param_grads(phi: Tensor, bias: Tensor, alpha: Tensor, dphi_part: Tensor, part: Tensor):
    """dphi, dbias, dalpha from the kernels' partial sums, in the parameters' dtypes, in one launch."""
    dphi, dbias, dalpha = (empty(t.shape, t.dtype, t.device) for t in (phi, bias, alpha))
    sum_partials(dphi_part, dphi, part, dbias, dalpha)
    return dphi, dbias, dalpha


def backward(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult, h_pre=None,
             du=None, dx_in=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dphi, dbias, dalpha): the per-token pass, then the x pass writing the op's one dx (with h_pre_j du where
    du is given and dx_in, the gradient x received from its other consumer, where given)."""
    N, n, C = x.shape
    dx = empty((N, n, C), x.dtype, x.device)
    if N == 0:
        return dx, torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)
    x, dx_in, phi = token_rows(x), None if dx_in is None else token_rows(dx_in), c_contig(phi)
    dl, dss, part, du = token_backward(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters=iters, eps=eps,
                                       t_in=t_in, t_out=t_out, post_mult=post_mult, du=du)
    dphi_part = projection.x_pass(x, phi, dl, dss, dx, h_pre=h_pre, du=du, dx_in=dx_in)
    return (dx, *param_grads(phi, bias, alpha, dphi_part, part))


def _coef_fwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    rms_eps: float, pre_eps: float, post_mult: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C] -> h_pre [N, n], h_post [N, n], h_res [N, n, n] (or [N, 0, 0]), raw logits [N, M], 1/r [N]."""
    return forward(x, phi, bias, alpha, iters=iters, eps=eps, t_in=t_in, t_out=t_out, rms_eps=rms_eps,
                   pre_eps=pre_eps, post_mult=post_mult, with_u=False)[1:]


coef_fwd = custom_op("mhc_coefficients", _coef_fwd_body)


def coef_fake(x: Tensor, phi: Tensor) -> tuple[Tensor, ...]:
    """The coefficient outputs' fakes: h_pre, h_post, h_res, logits, 1/r."""
    N, n, C = x.shape
    M = phi.shape[1]
    f32 = dict(dtype=torch.float32)
    res = (N, n, n) if M == n * n + 2 * n else (N, 0, 0)
    return (x.new_empty((N, n), **f32), x.new_empty((N, n), **f32), x.new_empty(res, **f32),
            x.new_empty((N, M), **f32), x.new_empty((N,), **f32))


def u_fake(x: Tensor, u_dtype: Optional[torch.dtype]) -> Tensor:
    return x.new_empty((x.shape[0], x.shape[2]), dtype=u_dtype or x.dtype)


@coef_fwd.register_fake
def _(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult):
    return coef_fake(x, phi)


def _coef_bwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, lg: Tensor, rinv: Tensor,
    d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    post_mult: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return backward(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters=iters, eps=eps, t_in=t_in, t_out=t_out,
                    post_mult=post_mult)


coef_bwd = custom_op("mhc_coefficients_bwd", _coef_bwd_body)


@coef_bwd.register_fake
def _(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult):
    return fake_like(x), fake_like(phi), fake_like(bias), fake_like(alpha)


def _coef_setup(ctx, inputs, output):
    x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult = inputs
    _, _, _, lg, rinv = output
    ctx.save_for_backward(x, phi, bias, alpha, lg, rinv)
    ctx.opts = dict(iters=iters, eps=eps, t_in=t_in, t_out=t_out, post_mult=post_mult)  # the backward ops' scalars
    ctx.mark_non_differentiable(lg, rinv)


def coefficient_grads(x: Tensor, phi: Tensor, d_pre, d_post, d_res) -> tuple[Optional[Tensor], ...]:
    """The op's incoming coefficient gradients, zeros of their shapes where autograd gave none (`grads_or_zeros`)."""
    N, n = x.shape[0], x.shape[1]
    res = (N, n, n) if phi.shape[1] == n * n + 2 * n else (N, 0, 0)
    return grads_or_zeros(x.device, d_pre, (d_post, (N, n)), (d_res, res))


def _coef_backward(ctx, d_pre, d_post, d_res, _dlg, _drinv):
    x, phi, bias, alpha, lg, rinv = ctx.saved_tensors
    dh = coefficient_grads(x, phi, d_pre, d_post, d_res)
    dx, dphi, dbias, dalpha = body_of(ctx, coef_bwd)(x, phi, bias, alpha, lg, rinv, *dh, **ctx.opts)
    return dx, dphi, dbias, dalpha, None, None, None, None, None, None, None


coef_fwd.register_autograd(_coef_backward, setup_context=_coef_setup)

# the op as the public wrappers call it (custom_ops.eager_op), MHCOptions whole as its fifth argument
coef_eager = with_options(eager_op(coef_fwd, _coef_setup, _coef_backward), at=4)
