"""`hc_enter` (docs/design.md §5; docs/kernels.md, "HC"): HC's coefficients and u = sum_i h_pre_i x_i in one op,
x handed on to the write-back, one dx in its backward (as `mhc_enter` for mHC): the coefficient kernel
(`hc_coefficients.coefficients`), u by stream_pre's streaming kernel, and HC's backward with du and the write-back's
gradient of x added (`hc_coefficients.backward`).
"""
from typing import Optional

import torch

from ..custom_ops import body_of, custom_op, eager_op, register_routed, route_of
from ..host import empty, fake_like, token_rows
from .hc_coefficients import backward, coefficient_grads, coefficients
from .stream_pre import write_u

Tensor = torch.Tensor


def enter_forward(x: Tensor, w: Tensor, statics: Tensor, eps: float, tanh: bool,
                  u_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [N, n, C] -> u [N, C] (u_dtype, None: x.dtype), then the coefficients of x's rows: h_pre [N n], h_post [N n],
    h_res [N, n, n], the raw projection [N n, n + 2], 1/r [N n]. u by stream_pre's streaming kernel (x read again)."""
    N, n, C = x.shape
    x = token_rows(x)
    coefs = coefficients(x.view(N * n, C), w, statics, n, eps, tanh)
    u = empty((N, C), u_dtype or x.dtype, x.device)
    if N > 0:
        write_u(x, coefs[0].view(N, n), u)
    return (u, *coefs)


def _hc_enter_fwd_body(x: Tensor, w: Tensor, statics: Tensor, eps: float, tanh: bool,
                       u_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return enter_forward(x, w, statics, eps, tanh, u_dtype)


hc_enter_fwd = custom_op("hc_enter", _hc_enter_fwd_body)


@hc_enter_fwd.register_fake
def _hc_enter_fake(x, w, statics, eps, tanh, u_dtype=None):
    N, n, C = x.shape
    f32 = dict(dtype=torch.float32)
    return (x.new_empty((N, C), dtype=u_dtype or x.dtype), x.new_empty((N * n,), **f32), x.new_empty((N * n,), **f32),
            x.new_empty((N, n, n), **f32), x.new_empty((N * n, w.shape[1]), **f32), x.new_empty((N * n,), **f32))


def enter_backward(d_pre: Optional[Tensor], d_post: Tensor, d_res: Tensor, du: Optional[Tensor], x: Tensor, w: Tensor,
                   statics: Tensor, lg: Tensor, rinv: Tensor, h_pre: Tensor, tanh: bool,
                   dx_in: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dx [N, n, C] (with h_pre_i du and dx_in, the write-back's gradient of x, added in the same pass), dw,
    dstatics."""
    N, n, C = x.shape
    dx, dw, dst = backward(d_pre, d_post, d_res, token_rows(x).view(N * n, C), w, statics, lg, rinv, n, tanh,
                           h_pre=h_pre, du=du, dx_in=None if dx_in is None else dx_in.reshape(N * n, C))
    return dx.view(N, n, C), dw, dst


hc_enter_bwd = custom_op("hc_enter_bwd", enter_backward)


@hc_enter_bwd.register_fake
def _(d_pre, d_post, d_res, du, x, w, statics, lg, rinv, h_pre, tanh, dx_in=None):
    return fake_like(x), fake_like(w), fake_like(statics)


def _hc_enter_setup(ctx, inputs, output):
    x, w, statics, _, tanh = inputs[:5]
    _, h_pre, _, _, lg, rinv = output
    ctx.save_for_backward(x, w, statics, lg, rinv, h_pre)
    ctx.mark_non_differentiable(lg, rinv)
    ctx.tanh = tanh


def _hc_enter_op_backward(ctx, du, d_pre, d_post, d_res, _dlg, _drinv, dx_next=None):
    x, w, statics, lg, rinv, h_pre = ctx.saved_tensors
    N, n, _ = x.shape
    dh = coefficient_grads(N * n, n, x.device, d_pre, d_post, d_res)
    dx, dw, dst = body_of(ctx, hc_enter_bwd)(*dh, du, x, w, statics, lg, rinv, h_pre, ctx.tanh, dx_in=dx_next)
    return dx, dw, dst, None, None, None


hc_enter_fwd.register_autograd(_hc_enter_op_backward, setup_context=_hc_enter_setup)


def _hc_enter_routed_body(
    x: Tensor, w: Tensor, statics: Tensor, eps: float, tanh: bool, u_dtype: Optional[torch.dtype] = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hc_enter's outputs and x's route to the write-back (`Routed`): `hc_enter` as torch.compile sees it."""
    return (*enter_forward(x, w, statics, eps, tanh, u_dtype), route_of(x))


hc_enter_routed = custom_op("hc_enter_routed", _hc_enter_routed_body)


@hc_enter_routed.register_fake
def _(x, w, statics, eps, tanh, u_dtype=None):
    return (*_hc_enter_fake(x, w, statics, eps, tanh, u_dtype), route_of(x))


register_routed(hc_enter_routed, _hc_enter_setup, _hc_enter_op_backward)


def _hc_enter_backward(ctx, dx_next, *grads):
    """The eager `hc_enter`: the gradient of the x handed on to the write-back joins dx in the x pass."""
    return _hc_enter_op_backward(ctx, *grads, dx_next=dx_next)


# the op as the public wrappers call it (custom_ops.eager_op)
hc_enter_eager = eager_op(hc_enter_fwd, _hc_enter_setup, _hc_enter_backward, routed=hc_enter_routed)
