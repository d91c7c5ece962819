"""Fused "pre" op semantics: coefficients and the layer input u = sum_j h_pre_j x_j together (docs/design.md §2, §8).

No new math: a thin composition of the reference `mhc_coefficients` and `stream_pre`. The fused kernel computes
the same thing from one read of x and returns a single dx in its backward.
"""
from typing import Optional

import torch

from ..options import DEFAULT_OPTIONS, MHCOptions
from .coefficients import mhc_coefficients
from .streams import stream_pre


def mhc_pre(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions = DEFAULT_OPTIONS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(u, h_pre, h_post, h_res | None)."""
    h_pre, h_post, h_res = mhc_coefficients(x, phi, bias, alpha, opts)
    return stream_pre(x, h_pre), h_pre, h_post, h_res


def mhc_enter(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions = DEFAULT_OPTIONS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x, u, h_pre, h_post, h_res | None): mhc_pre, and the stream the sublayer's write-back is to read. Here x itself;
    the fused op hands on an alias, so that the write-back's gradient of x joins its own backward."""
    return (x, *mhc_pre(x, phi, bias, alpha, opts))
