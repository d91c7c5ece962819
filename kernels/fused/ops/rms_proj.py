"""`rms_proj`, HC's projection alone, y = RMSNorm(x) w (docs/design.md §5; docs/kernels.md, "HC"): the forward is
HC's projection kernel without its tail (`hc_coefficients.project`), the backward the x pass (`projection.x_pass`).
"""
import torch

from .. import projection
from ..custom_ops import body_of, custom_op, eager_op
from ..host import c_contig, empty, fake_like
from ..partial_sums import sum_partials
from .hc_coefficients import project

Tensor = torch.Tensor


def _rms_proj_fwd_body(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, C] rows, w [C, M] -> y = L / r [R, M] fp32, the raw projection L = x w and 1/r [R] (r: RMS of the row)."""
    R = x.shape[0]
    lg, rinv = empty((R, w.shape[1]), torch.float32, x.device), empty((R,), torch.float32, x.device)
    if R > 0:
        project(x, w, eps, lg, rinv)
    return lg * rinv[:, None], lg, rinv


rms_proj_fwd = custom_op("rms_proj", _rms_proj_fwd_body)


@rms_proj_fwd.register_fake
def _(x, w, eps):
    f32 = dict(dtype=torch.float32)
    return x.new_empty((x.shape[0], w.shape[1]), **f32), x.new_empty((x.shape[0], w.shape[1]), **f32), \
        x.new_empty((x.shape[0],), **f32)


def _rms_proj_bwd_body(dy: Tensor, x: Tensor, w: Tensor, lg: Tensor, rinv: Tensor) -> tuple[Tensor, Tensor]:
    """dx = dL w^T + 2 x d(sum x^2) and dw = x^T dL (the x pass), with dL = dy / r, d(sum x^2) from d(1/r)."""
    R, C = x.shape
    dx = empty((R, C), x.dtype, x.device)
    if R == 0:
        return dx, torch.zeros_like(w)
    dl = (dy * rinv[:, None]).contiguous()
    dss = (-0.5 / C) * (dy * lg).sum(1) * rinv.pow(3)  # 1/r = (sum x^2 / C + eps)^(-1/2)
    part = projection.x_pass(c_contig(x).view(R, 1, C), c_contig(w), dl, dss.contiguous(), dx.view(R, 1, C))
    dw = empty(w.shape, w.dtype, w.device)
    sum_partials(part, dw)
    return dx, dw


rms_proj_bwd = custom_op("rms_proj_bwd", _rms_proj_bwd_body)


@rms_proj_bwd.register_fake
def _(dy, x, w, lg, rinv):
    return fake_like(x), fake_like(w)


def _rms_proj_setup(ctx, inputs, output):
    x, w, _ = inputs
    _, lg, rinv = output
    ctx.save_for_backward(x, w, lg, rinv)
    ctx.mark_non_differentiable(lg, rinv)


def _rms_proj_backward(ctx, dy, _dlg, _drinv):
    x, w, lg, rinv = ctx.saved_tensors
    if dy is None:
        return None, None, None
    dx, dw = body_of(ctx, rms_proj_bwd)(dy.contiguous(), x, w, lg, rinv)
    return dx, dw, None


rms_proj_fwd.register_autograd(_rms_proj_backward, setup_context=_rms_proj_setup)


# the op as the public wrappers call it (custom_ops.eager_op)
rms_proj_eager = eager_op(rms_proj_fwd, _rms_proj_setup, _rms_proj_backward)
