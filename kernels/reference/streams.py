"""Stream-side ops of the per-layer update x_{l+1} = H^res x_l + H^post^T F(H^pre x_l) (docs/design.md §1, §4).

Mixing accumulates in promote(x.dtype, float32) and returns x.dtype, as the fused kernels do.
"""

from typing import Optional

import torch

from .coefficients import compute_dtype, no_autocast


def expand_streams(h: torch.Tensor, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x_0 = 1_n h: copy the embedding [..., C] into n streams [..., n, C] in dtype (default h's; no learned
    expansion)."""
    return h.to(dtype or h.dtype).unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def sum_streams(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The "sum" collapse: the n streams [..., n, C] summed to [..., C] in dtype (default x's)."""
    return x.sum(dim=-2, dtype=dtype)


@no_autocast
def stream_pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """Layer input u = sum_j h_pre_j x_j: [..., n, C] x [..., n] -> [..., C]. Also the weighted collapse."""
    cd = compute_dtype(x.dtype)
    return (h_pre.to(cd).unsqueeze(-1) * x.to(cd)).sum(dim=-2).to(x.dtype)


@no_autocast
def stream_post_res(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: Optional[torch.Tensor]
) -> torch.Tensor:
    """x_next_i = sum_j h_res_ij x_j + h_post_i f.  h_res=None means H^res = I (identity-HC)."""
    cd = compute_dtype(x.dtype)
    xc = x.to(cd)
    mixed = xc if h_res is None else h_res.to(cd) @ xc
    return (mixed + h_post.to(cd).unsqueeze(-1) * f.to(cd).unsqueeze(-2)).to(x.dtype)
