"""Coefficients of the exactly doubly stochastic H^res families, mHC-lite and KromHC (docs/design.md §15).

The same projection, gates and H^pre / H^post as mHC (`gated_logits`, docs/design.md §2); only the res block
differs: r logits per token (n! for mHC-lite, log2 n for KromHC) in place of mHC's n^2, and H^res made from them
without Sinkhorn. phi: [n C, 2n + r] with columns [pre (n) | post (n) | res (r)]; bias the same r + 2n; alpha
[pre, post, res]. There are no fused kernels for these: the model always runs them from here (HyperConfig's
`ops_backend`), in eager mode or under torch.compile.
"""

from typing import Optional

import torch

from ..options import DEFAULT_OPTIONS, MHCOptions
from .birkhoff import birkhoff_res, permutation_count
from .coefficients import gated_logits, no_autocast
from .kronecker import factor_count, kronecker_res
from .pre import in_dtype
from .streams import stream_pre

EXACT_FAMILIES = ("mhc_lite", "kromhc")


def exact_res_count(family: str, n: int) -> int:
    """Res logits per token: n! (mhc_lite) or log2 n (kromhc)."""
    if family == "mhc_lite":
        return permutation_count(n)
    if family == "kromhc":
        return factor_count(n)
    raise ValueError(f"family must be one of {list(EXACT_FAMILIES)}, got {family!r}")


def exact_res(z: torch.Tensor, family: str, n: int) -> torch.Tensor:
    """H^res [..., n, n] (left-multiplying) from the family's res logits z [..., r]."""
    if family == "mhc_lite":
        return birkhoff_res(z, n)
    if family == "kromhc":
        return kronecker_res(z, n)
    raise ValueError(f"family must be one of {list(EXACT_FAMILIES)}, got {family!r}")


def _logits(x, phi, bias, alpha, family: str, opts: MHCOptions):
    n = x.shape[-2]
    want = 2 * n + exact_res_count(family, n)
    if phi.shape[-1] != want or bias.shape[-1] != want:
        raise ValueError(
            f"{family} at n={n} needs phi and bias with {want} columns [pre {n} | post {n} | res "
            f"{want - 2 * n}], got {phi.shape[-1]} and {bias.shape[-1]}"
        )
    return gated_logits(x, phi, bias, alpha, opts.rms_eps)


@no_autocast
def exact_coefficients(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    family: str,
    opts: MHCOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_pre [..., n], h_post [..., n], h_res [..., n, n]) for x [..., n, C], in promote(x.dtype, float32).
    Of opts only pre_eps, post_mult and rms_eps apply: there is no Sinkhorn to configure."""
    pre, post, z = _logits(x, phi, bias, alpha, family, opts)
    h_pre = torch.sigmoid(pre) + opts.pre_eps
    h_post = opts.post_mult * torch.sigmoid(post)
    return h_pre, h_post, exact_res(z, family, x.shape[-2])


@no_autocast
def exact_res_logits(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    family: str,
    opts: MHCOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """The family's res logits [..., r] before the softmax / sigmoids."""
    return _logits(x, phi, bias, alpha, family, opts)[2]


def exact_enter(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    family: str,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, u, h_pre, h_post, h_res): as `mhc_enter`, with the family's H^res; u = sum_j h_pre_j x_j in u_dtype."""
    h_pre, h_post, h_res = exact_coefficients(x, phi, bias, alpha, family, opts)
    return x, in_dtype(stream_pre(x, h_pre), u_dtype), h_pre, h_post, h_res
