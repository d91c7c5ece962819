"""Sublayer boundary op semantics (docs/design.md §1, §8): sublayer l's write-back, then sublayer l+1's coefficients
and input, from the stream they share.

    x_next = H^res_l x + h_post_l^T f_l;   (u, h_pre, h_post, h_res)_{l+1} = mhc_pre(x_next)

No new math: a composition of the reference `stream_post_res` and `mhc_pre`. The fused op writes x_next once and
computes the next sublayer's coefficients and u from the tiles it has just written; its backward writes dx once.
"""

from typing import Optional

import torch

from ..options import DEFAULT_OPTIONS, MHCOptions
from .pre import mhc_pre
from .streams import stream_post_res


def mhc_boundary(
    x: torch.Tensor,
    f: torch.Tensor,
    h_post: torch.Tensor,
    h_res: Optional[torch.Tensor],
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x_next, u, h_pre, h_post, h_res | None): h_post / h_res in are sublayer l's, phi / bias / alpha / opts and
    the coefficients out are sublayer l+1's (u in u_dtype, as mhc_pre)."""
    x_next = stream_post_res(x, f, h_post, h_res)
    return (x_next, *mhc_pre(x_next, phi, bias, alpha, opts, u_dtype))
