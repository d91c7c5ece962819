"""Fused "pre" op semantics: coefficients and the layer input u = sum_j h_pre_j x_j together (docs/design.md §2, §8).

No new math: a thin composition of the reference `mhc_coefficients` (HC: `hc_coefficients`) and `stream_pre`. The
fused kernels compute the same thing and return a single dx in their backward.
"""

from typing import Optional

import torch

from ..options import DEFAULT_OPTIONS, MHCOptions
from .coefficients import hc_coefficients, mhc_coefficients
from .streams import stream_pre


def in_dtype(u: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """u as its branch takes it (the ops' u_dtype): cast to dtype, or as it is for None."""
    return u if dtype is None else u.to(dtype)


def rebuild_u(x: torch.Tensor, h_pre: torch.Tensor, u_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u as `mhc_pre` / `mhc_enter` / `mhc_boundary` / `hc_enter` handed it to the branch (the same values, in
    u_dtype), without autograd: for a branch that dropped its saved input until the backward
    (HyperConfig.rebuild_branch_input)."""
    with torch.no_grad():
        return in_dtype(stream_pre(x, h_pre), u_dtype)


def request_u(x: torch.Tensor, h_pre: torch.Tensor, u_dtype: Optional[torch.dtype] = None) -> None:
    """The fused ops' write-back can hand u over from its backward (fused.request_u); these ops cannot: None."""
    return None


def mhc_pre(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(u, h_pre, h_post, h_res | None). u_dtype: u as the branch takes it, u in x's dtype then cast (None: x's)."""
    h_pre, h_post, h_res = mhc_coefficients(x, phi, bias, alpha, opts)
    return in_dtype(stream_pre(x, h_pre), u_dtype), h_pre, h_post, h_res


def mhc_enter(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x, u, h_pre, h_post, h_res | None): mhc_pre, and the stream the sublayer's write-back is to read. Here x itself;
    the fused op hands on an alias, so that the write-back's gradient of x joins its own backward."""
    return (x, *mhc_pre(x, phi, bias, alpha, opts, u_dtype))


def hc_enter(
    x: torch.Tensor,
    *params: torch.Tensor,
    dynamic: bool = True,
    use_tanh: bool = True,
    norm_eps: float = 1e-6,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, u, h_pre, h_post, h_res) of an HC sublayer: `hc_coefficients(x, *params)` (its ten parameters, norm_weight
    ... ar_static) and u = stream_pre(x, h_pre) (cast to u_dtype, as in `mhc_pre`), with x handed on for the
    write-back as in `mhc_enter`."""
    h_pre, h_post, h_res = hc_coefficients(x, *params, dynamic=dynamic, use_tanh=use_tanh, norm_eps=norm_eps)
    return x, in_dtype(stream_pre(x, h_pre), u_dtype), h_pre, h_post, h_res
