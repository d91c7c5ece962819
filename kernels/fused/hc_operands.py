"""HC's nine parameters as its kernels' operands, inside the eager `hc_enter` (docs/kernels.md, "HC"): the
projection weights W = diag(g) [w_beta | w_m | W_r] [C, n + 2] and the packed statics [s_beta, s_alpha, B, A_m, A_r]
in one launch (`_hc_operands`), and back, the nine parameter gradients from dW and the statics' gradient in one launch
(`_hc_operand_grads`), each in its parameter's dtype. The torch composition they replace (concatenations, a product,
a dozen autograd nodes each way) is most of an HC sublayer's eager host time; under torch.compile it runs instead
(inductor fuses it). Both are exact reformulations of that composition (same values, sums in fp32).
"""
import torch
import triton
import triton.language as tl

from .host import cdiv, empty, np2
from .launch_cache import launcher
from .launch_config import launch_options, tiles
from .ops import hc_coefficients, hc_enter

Tensor = torch.Tensor


@triton.jit
def _hc_cat_tile(g_ptr, wb_ptr, wm_ptr, wr_ptr, C, NH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                 BR: tl.constexpr):
    """One program's rows of HC's weights: (rows, cols, mask, g [BR] and [w_beta | w_m | W_r] [BR, MP], fp32)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, MP)
    rmask = rows < C
    mask = rmask[:, None] & (cols[None, :] < M)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    wb = tl.load(wb_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    wm = tl.load(wm_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    wr = tl.load(wr_ptr + rows[:, None] * NH + (cols[None, :] - 2), mask=mask & (cols[None, :] >= 2),
                 other=0.0).to(tl.float32)
    cat = tl.where(cols[None, :] == 0, wb[:, None], tl.where(cols[None, :] == 1, wm[:, None], wr))
    return rows, cols, mask, g, cat


@triton.jit
def _hc_operands(g_ptr, wb_ptr, wm_ptr, wr_ptr, sa_ptr, sb_ptr, b_ptr, am_ptr, ar_ptr, w_ptr, st_ptr, C,
                 NH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, PW: tl.constexpr, PWP: tl.constexpr,
                 BR: tl.constexpr):
    """W [C, M] fp32 (M = n + 2); program 0 also writes the statics [s_beta, s_alpha, B (n), A_m (n), A_r (n x n,
    row-major)]."""
    rows, cols, mask, g, cat = _hc_cat_tile(g_ptr, wb_ptr, wm_ptr, wr_ptr, C, NH, M, MP, BR)
    tl.store(w_ptr + rows[:, None] * M + cols[None, :], g[:, None] * cat, mask=mask)
    if tl.program_id(0) == 0:
        k = tl.arange(0, PWP)
        v = tl.load(b_ptr + (k - 2), mask=(k >= 2) & (k < 2 + NH), other=0.0).to(tl.float32)
        v += tl.load(am_ptr + (k - 2 - NH), mask=(k >= 2 + NH) & (k < 2 + 2 * NH), other=0.0).to(tl.float32)
        v += tl.load(ar_ptr + (k - 2 - 2 * NH), mask=(k >= 2 + 2 * NH) & (k < PW), other=0.0).to(tl.float32)
        v = tl.where(k == 0, tl.load(sb_ptr).to(tl.float32), tl.where(k == 1, tl.load(sa_ptr).to(tl.float32), v))
        tl.store(st_ptr + k, v, mask=k < PW)


@triton.jit
def _hc_operand_grads(dw_ptr, dst_ptr, g_ptr, wb_ptr, wm_ptr, wr_ptr, dg_ptr, dwb_ptr, dwm_ptr, dwr_ptr, dsa_ptr,
                      dsb_ptr, db_ptr, dam_ptr, dar_ptr, C, NH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                      PW: tl.constexpr, PWP: tl.constexpr, BR: tl.constexpr):
    """The backward of `_hc_operands`: from dW [C, M] and the statics' gradient [PW], each of HC's nine parameters'
    gradients in its own dtype: dg = sum_k dW_k [w_beta | w_m | W_r]_k, d[w_beta | w_m | W_r] = g dW, and the statics
    split back onto s_beta, s_alpha, B, A_m, A_r."""
    rows, cols, mask, g, cat = _hc_cat_tile(g_ptr, wb_ptr, wm_ptr, wr_ptr, C, NH, M, MP, BR)
    dw = tl.load(dw_ptr + rows[:, None] * M + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rmask = rows < C
    tl.store(dg_ptr + rows, tl.sum(dw * cat, axis=1).to(dg_ptr.dtype.element_ty), mask=rmask)
    dcat = dw * g[:, None]
    tl.store(dwb_ptr + rows, tl.sum(tl.where(cols[None, :] == 0, dcat, 0.0), axis=1).to(dwb_ptr.dtype.element_ty),
             mask=rmask)
    tl.store(dwm_ptr + rows, tl.sum(tl.where(cols[None, :] == 1, dcat, 0.0), axis=1).to(dwm_ptr.dtype.element_ty),
             mask=rmask)
    tl.store(dwr_ptr + rows[:, None] * NH + (cols[None, :] - 2), dcat.to(dwr_ptr.dtype.element_ty),
             mask=mask & (cols[None, :] >= 2))
    if tl.program_id(0) == 0:
        k = tl.arange(0, PWP)
        d = tl.load(dst_ptr + k, mask=k < PW, other=0.0)
        tl.store(dsb_ptr + k, d.to(dsb_ptr.dtype.element_ty), mask=k == 0)
        tl.store(dsa_ptr + (k - 1), d.to(dsa_ptr.dtype.element_ty), mask=k == 1)
        tl.store(db_ptr + (k - 2), d.to(db_ptr.dtype.element_ty), mask=(k >= 2) & (k < 2 + NH))
        tl.store(dam_ptr + (k - 2 - NH), d.to(dam_ptr.dtype.element_ty), mask=(k >= 2 + NH) & (k < 2 + 2 * NH))
        tl.store(dar_ptr + (k - 2 - 2 * NH), d.to(dar_ptr.dtype.element_ty), mask=(k >= 2 + 2 * NH) & (k < PW))


def hc_operands(g: Tensor, w_beta: Tensor, w_m: Tensor, w_r: Tensor, s_alpha: Tensor, s_beta: Tensor,
                b_static: Tensor, am_static: Tensor, ar_static: Tensor) -> tuple[Tensor, Tensor]:
    """HC's nine parameters as its kernels take them, in one launch: W [C, n + 2] fp32
    (reference.hc_projection_weights) and the statics (`hc_coefficients.hc_statics`' layout)."""
    (C, n), dev = w_r.shape, w_r.device
    M, pw = n + 2, 2 + 2 * n + n * n
    w = empty((C, M), torch.float32, dev)
    statics = empty((pw,), torch.float32, dev)
    cfg = tiles("hc_operands")
    launcher(_hc_operands)[(max(1, cdiv(C, cfg["BR"])),)](
        g_ptr=g, wb_ptr=w_beta, wm_ptr=w_m, wr_ptr=w_r, sa_ptr=s_alpha, sb_ptr=s_beta, b_ptr=b_static, am_ptr=am_static,
        ar_ptr=ar_static, w_ptr=w, st_ptr=statics, C=C, NH=n, M=M, MP=np2(M), PW=pw, PWP=np2(pw), BR=cfg["BR"],
        **launch_options(cfg))
    return w, statics


def hc_operand_grads(dw: Tensor, dstatics: Tensor, g: Tensor, w_beta: Tensor, w_m: Tensor, w_r: Tensor,
                     s_alpha: Tensor, s_beta: Tensor, b_static: Tensor, am_static: Tensor,
                     ar_static: Tensor) -> tuple[Tensor, ...]:
    """The nine parameters' gradients from dW and the statics' gradient, in one launch, each in its parameter's dtype
    and shape."""
    params = (g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static)
    grads = tuple(empty(p.shape, p.dtype, p.device) for p in params)
    (C, n), cfg = w_r.shape, tiles("hc_operands")
    pw = dstatics.shape[0]
    dg, dwb, dwm, dwr, dsa, dsb, db, dam, dar = grads
    launcher(_hc_operand_grads)[(max(1, cdiv(C, cfg["BR"])),)](
        dw_ptr=dw, dst_ptr=dstatics, g_ptr=g, wb_ptr=w_beta, wm_ptr=w_m, wr_ptr=w_r, dg_ptr=dg, dwb_ptr=dwb,
        dwm_ptr=dwm, dwr_ptr=dwr, dsa_ptr=dsa, dsb_ptr=dsb, db_ptr=db, dam_ptr=dam, dar_ptr=dar, C=C, NH=n, M=n + 2,
        MP=np2(n + 2), PW=pw, PWP=np2(pw), BR=cfg["BR"], **launch_options(cfg))
    return grads


class HCEnterFolded(torch.autograd.Function):
    """`hc_enter` on HC's nine raw parameters (eager only): the operands are made inside the op (`hc_operands`) and
    the backward turns dW and the statics' gradient into the nine parameter gradients (`hc_operand_grads`). Outputs as
    `hc_enter.hc_enter_eager`'s: x (the alias its write-back reads), then the op's."""

    @staticmethod
    def forward(ctx, x, g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static, eps, tanh, u_dtype=None):
        params = (g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static)
        w, statics = hc_operands(*params)
        out = hc_enter.enter_forward(x, w, statics, eps, tanh, u_dtype)
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
        dh = hc_coefficients.coefficient_grads(N * n, n, x.device, d_pre, d_post, d_res)
        dx, dw, dst = hc_enter.enter_backward(*dh, du, x, w, statics, lg, rinv, h_pre, ctx.tanh, dx_in=dx_next)
        return (dx, *hc_operand_grads(dw, dst, *params), None, None, None)
