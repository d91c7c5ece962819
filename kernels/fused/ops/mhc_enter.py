"""`mhc_enter` (docs/kernels.md, "mHC's coefficients and the sublayer's entry"): `mhc_pre`, and x handed on to the
sublayer's write-back, whose gradient of x joins mhc_pre's one dx in the x pass (no sum of two stream-sized gradients).

Eager, x' is x's alias; under torch.compile it is `Routed` (x and the route its write-back gradient takes).
"""
from typing import Optional

import torch

from ..custom_ops import custom_op, eager_op, register_routed, route_of, with_options
from .mhc_coefficients import coef_fake, u_fake
from .mhc_pre import mhc_pre_backward, mhc_pre_fwd, mhc_pre_fwd_body, mhc_pre_setup

Tensor = torch.Tensor


def _mhc_enter_backward(ctx, dx_next, *grads):
    """The eager `mhc_enter`: mhc_pre's outputs plus x handed on to the sublayer's write-back, whose gradient dx_next
    joins this backward's dx in the x pass (no separate sum of two stream-sized gradients)."""
    return mhc_pre_backward(ctx, *grads, dx_next=dx_next)


def _mhc_enter_fwd_body(
    x: Tensor, phi: Tensor, bias: Tensor, alpha: Tensor, iters: int, eps: float, t_in: bool, t_out: bool,
    rms_eps: float, pre_eps: float, post_mult: float, u_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mhc_pre's outputs and x's route to the write-back (`Routed`): `mhc_enter` as torch.compile sees it."""
    return (*mhc_pre_fwd_body(x, phi, bias, alpha, iters=iters, eps=eps, t_in=t_in, t_out=t_out, rms_eps=rms_eps,
                               pre_eps=pre_eps, post_mult=post_mult, u_dtype=u_dtype), route_of(x))


mhc_enter_fwd = custom_op("mhc_enter", _mhc_enter_fwd_body)


@mhc_enter_fwd.register_fake
def _(x, phi, bias, alpha, iters, eps, t_in, t_out, rms_eps, pre_eps, post_mult, u_dtype=None):
    return (u_fake(x, u_dtype),) + coef_fake(x, phi) + (route_of(x),)


register_routed(mhc_enter_fwd, mhc_pre_setup, mhc_pre_backward)

# the op as the public wrappers call it (custom_ops.eager_op), MHCOptions whole as its fifth argument
mhc_enter_eager = with_options(eager_op(mhc_pre_fwd, mhc_pre_setup, _mhc_enter_backward, routed=mhc_enter_fwd), at=4)
