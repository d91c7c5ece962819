"""The sublayer boundary op (`mhc_boundary`, kernels/reference/mhc_boundary.py): sublayer l's write-back and sublayer
l + 1's coefficients and input in one op, x_{l+1} written once and its gradient written once (docs/kernels.md,
"How the model calls them").

Forward: the write-back's kernel writes x_{l+1} and the coefficient kernel reads it back (`mhc_coefficients.forward`
with u), the per-sublayer kernels. Backward: the per-token pass and the x pass on x_{l+1}, the downstream gradient of
x_{l+1} added in that pass (ACC), so that the x pass writes x_{l+1}'s whole gradient; then the write-back's backward
reads it. The same kernels and bytes as one sublayer at a time: what the op saves is host time (one op, one autograd
node per sublayer).
"""
from typing import Optional

import torch

from ..custom_ops import body_of, custom_op, eager_op, with_options
from ..host import fake_like
from .mhc_coefficients import backward, coef_fake, coefficient_grads, forward, u_fake
from .stream_post_res import post_backward, post_forward, requested_u

Tensor = torch.Tensor


def _bnd_fwd_body(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int,
    eps: float, t_in: bool, t_out: bool, rms_eps: float, pre_eps: float, post_mult: float,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C], f [N, C], h_post [N, n], h_res [N, n, n] or [N, 0, 0] (H^res = I) of sublayer l -> x_next, then
    u (u_dtype, None: x.dtype), h_pre, h_post, h_res, raw logits, 1/r of sublayer l + 1 (as mhc_pre on x_next)."""
    x_next = post_forward(x, f, h_post, h_res)
    return (x_next, *forward(x_next, phi, bias, alpha, iters=iters, eps=eps, t_in=t_in, t_out=t_out, rms_eps=rms_eps,
                             pre_eps=pre_eps, post_mult=post_mult, with_u=True, u_dtype=u_dtype))


bnd_fwd = custom_op("mhc_boundary", _bnd_fwd_body)


@bnd_fwd.register_fake
def _(x, f, h_post, h_res, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype=None):
    return (fake_like(x), u_fake(x, u_dtype)) + coef_fake(x, phi)


def _boundary_backward(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, d_pre, d_post, d_res,
                       iters, eps, t_in, t_out, post_mult, hu=None, u_out=None):
    """(dx, df, dh_post, dh_res, dphi, dbias, dalpha). hu, u_out (eager only, `request_u`): the write-back's pass also
    writes sublayer l's u."""
    if x.shape[0] == 0:
        dx, df, dhp, dhr = post_backward(g, x, f, h_post, h_res, hu=hu, u_out=u_out)
        return dx, df, dhp, dhr, torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)
    G, dphi, dbias, dalpha = backward(x_next, phi, bias, alpha, lg, rinv, d_pre, d_post, d_res, iters=iters, eps=eps,
                                      t_in=t_in, t_out=t_out, post_mult=post_mult, h_pre=h_pre2, du=du, dx_in=g)
    dx, df, dhp, dhr = post_backward(G, x, f, h_post, h_res, hu=hu, u_out=u_out)
    return dx, df, dhp.to(h_post.dtype), dhr.to(h_res.dtype), dphi, dbias, dalpha


def _bnd_bwd_body(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, x_next: Tensor,
    lg: Tensor, rinv: Tensor, h_pre2: Tensor, g: Tensor, du: Tensor, d_pre: Optional[Tensor], d_post: Tensor,
    d_res: Tensor, iters: int, eps: float, t_in: bool, t_out: bool, post_mult: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _boundary_backward(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, d_pre, d_post,
                              d_res, iters=iters, eps=eps, t_in=t_in, t_out=t_out, post_mult=post_mult)


bnd_bwd = custom_op("mhc_boundary_bwd", _bnd_bwd_body)


@bnd_bwd.register_fake
def _(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, d_pre, d_post, d_res, iters, eps, t_in,
      t_out, post_mult):
    return fake_like(x), fake_like(f), fake_like(h_post), fake_like(h_res), fake_like(phi), fake_like(bias), \
        fake_like(alpha)


def _bnd_setup(ctx, inputs, output):
    x, f, h_post, h_res, phi, bias, alpha, iters, eps, t_in, t_out, _rms_eps, _pre_eps, post_mult = inputs[:14]
    x_next, _, h_pre2, _, _, lg, rinv = output
    # x_next is also the next op's input: saving it here keeps no extra copy
    ctx.save_for_backward(x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2)
    ctx.opts = dict(iters=iters, eps=eps, t_in=t_in, t_out=t_out, post_mult=post_mult)  # the backward ops' scalars
    ctx.mark_non_differentiable(lg, rinv)


def _bnd_backward(ctx, g, du, d_pre, d_post, d_res, _dlg, _drinv):
    x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2 = ctx.saved_tensors
    dh = coefficient_grads(x_next, phi, d_pre, d_post, d_res)
    g = torch.zeros_like(x_next) if g is None else g
    du = torch.zeros((x.shape[0], x.shape[2]), dtype=x.dtype, device=x.device) if du is None else du
    args = (x, f, h_post, h_res, phi, bias, alpha, x_next, lg, rinv, h_pre2, g, du, *dh)
    wanted = requested_u(ctx, x)  # eager only: the plain body, with the u buffer
    if wanted:
        grads = _boundary_backward(*args, **ctx.opts, hu=wanted[0], u_out=wanted[1])
    else:
        grads = body_of(ctx, bnd_bwd)(*args, **ctx.opts)
    return (*grads, None, None, None, None, None, None, None, None)


bnd_fwd.register_autograd(_bnd_backward, setup_context=_bnd_setup)

# the op as the public wrappers call it (custom_ops.eager_op), MHCOptions whole as its eighth argument
boundary_eager = with_options(eager_op(bnd_fwd, _bnd_setup, _bnd_backward), at=7)
