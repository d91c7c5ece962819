"""`mhc_pre` (docs/design.md §2, §8; docs/kernels.md, "mHC's coefficients and the sublayer's entry"): mHC's
coefficients and the branch's input u = sum_j h_pre_j x_j in one op, from one read of x, with one dx in its backward.

The coefficient kernel (`mhc_coefficients.forward` with u) writes u while the token block it has just streamed is
still in L2, or stream_pre's streaming kernel writes it after; the backward adds <du, x_j> to dh_pre in the per-token
pass and h_pre_j du to dx in the x pass (`mhc_coefficients.backward`).
"""
from typing import Optional

import torch

from ..custom_ops import body_of, custom_op, eager_op, with_options
from ..host import fake_like
from .mhc_coefficients import backward, coef_bwd, coef_fake, coefficient_grads, forward, u_fake

Tensor = torch.Tensor


def mhc_pre_fwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    rms_eps: float, pre_eps: float, post_mult: float, u_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C] -> u [N, C] (u_dtype, None: x.dtype), h_pre, h_post, h_res, raw logits, 1/r (as coef_fwd)."""
    return forward(x, phi, bias, alpha, iters=iters, eps=eps, t_in=t_in, t_out=t_out, rms_eps=rms_eps,
                   pre_eps=pre_eps, post_mult=post_mult, with_u=True, u_dtype=u_dtype)


mhc_pre_fwd = custom_op("mhc_pre", mhc_pre_fwd_body)


@mhc_pre_fwd.register_fake
def _(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype=None):
    return (u_fake(x, u_dtype),) + coef_fake(x, phi)


def _mhc_pre_bwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, lg: Tensor, rinv: Tensor, h_pre: Tensor, du: Tensor,
    d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    post_mult: float, dx_in: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dx_in: the gradient x received from its other consumer (`mhc_enter`), added into dx by the same kernel."""
    return backward(x, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters=iters, eps=eps, t_in=t_in, t_out=t_out,
                    post_mult=post_mult, h_pre=h_pre, du=du, dx_in=dx_in)


mhc_pre_bwd = custom_op("mhc_pre_bwd", _mhc_pre_bwd_body)


@mhc_pre_bwd.register_fake
def _(x, phi, bias, alpha, lg, rinv, h_pre, du, d_pre, d_post, d_res, iters, eps, t_in, t_out, post_mult, dx_in=None):
    return fake_like(x), fake_like(phi), fake_like(bias), fake_like(alpha)


def mhc_pre_setup(ctx, inputs, output):
    x, phi, bias, alpha, iters, eps, t_in, t_out, _rms_eps, _pre_eps, post_mult = inputs[:11]
    _, h_pre, _, _, lg, rinv = output
    ctx.save_for_backward(x, phi, bias, alpha, lg, rinv, h_pre)
    ctx.opts = dict(iters=iters, eps=eps, t_in=t_in, t_out=t_out, post_mult=post_mult)  # the backward ops' scalars
    ctx.mark_non_differentiable(lg, rinv)


def mhc_pre_backward(ctx, du, d_pre, d_post, d_res, _dlg, _drinv, dx_next=None):
    """dx_next (`mhc_enter`): the gradient of the x handed on to the write-back, added in the x pass. du comes in u's
    dtype (`token_backward` rounds a wider one)."""
    x, phi, bias, alpha, lg, rinv, h_pre = ctx.saved_tensors
    dh = coefficient_grads(x, phi, d_pre, d_post, d_res)
    if du is None:
        grads = body_of(ctx, coef_bwd)(x, phi, bias, alpha, lg, rinv, *dh, **ctx.opts)
        if dx_next is not None:
            grads = (grads[0] + dx_next, *grads[1:])
    else:
        grads = body_of(ctx, mhc_pre_bwd)(x, phi, bias, alpha, lg, rinv, h_pre, du, *dh, **ctx.opts, dx_in=dx_next)
    return (*grads, None, None, None, None, None, None, None, None)


mhc_pre_fwd.register_autograd(mhc_pre_backward, setup_context=mhc_pre_setup)

# the op as the public wrappers call it (custom_ops.eager_op), MHCOptions whole as its fifth argument
mhc_pre_eager = with_options(eager_op(mhc_pre_fwd, mhc_pre_setup, mhc_pre_backward), at=4)
