"""Coefficients of the exactly doubly stochastic H^res families, mHC-lite and KromHC (docs/design.md §15).

The same projection, gates and H^pre / H^post as mHC (`gated_logits`, docs/design.md §2); only the res block
differs: r logits per token (n! for mHC-lite, log2 n for KromHC) in place of mHC's n^2, and H^res made from them
without Sinkhorn. phi: [n C, 2n + r] with columns [pre (n) | post (n) | res (r)]; bias the same r + 2n; alpha
[pre, post, res]. There are no fused kernels for these: the model always runs them from here (HyperConfig's
`ops_backend`), in eager mode or under torch.compile. Each family is an `ExactFamily` (LITE, KROM); the mode registry
(model/modes.py) points each mode at its family's ops, `lite_enter` / `krom_enter`, which take mhc_enter's arguments.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from ..options import DEFAULT_OPTIONS, MHCOptions
from .birkhoff import birkhoff_res, permutation_count
from .coefficients import gated_logits, no_autocast
from .kronecker import factor_count, kronecker_res
from .pre import in_dtype
from .streams import stream_pre


@dataclass(frozen=True)
class ExactFamily:
    """One exactly doubly stochastic H^res family: its res logits per token at n streams (`res_count(n)`, which
    refuses an n the family does not take) and H^res [..., n, n] from them (`res(z, n)`)."""

    label: str
    res_count: Callable[[int], int]
    res: Callable[[torch.Tensor, int], torch.Tensor]


LITE = ExactFamily("mHC-lite", permutation_count, birkhoff_res)  # n! permutation weights (birkhoff.py)
KROM = ExactFamily("KromHC", factor_count, kronecker_res)  # log2 n 2 x 2 factors (kronecker.py)


def _logits(x, phi, bias, alpha, family: ExactFamily, opts: MHCOptions):
    n = x.shape[-2]
    want = 2 * n + family.res_count(n)
    if phi.shape[-1] != want or bias.shape[-1] != want:
        raise ValueError(
            f"{family.label} at n={n} needs phi and bias with {want} columns [pre {n} | post {n} | res "
            f"{want - 2 * n}], got {phi.shape[-1]} and {bias.shape[-1]}"
        )
    return gated_logits(x, phi, bias, alpha, opts.rms_eps)


@no_autocast
def exact_coefficients(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    family: ExactFamily,
    opts: MHCOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_pre [..., n], h_post [..., n], h_res [..., n, n]) for x [..., n, C], in promote(x.dtype, float32).
    Of opts only pre_eps, post_mult and rms_eps apply: there is no Sinkhorn to configure."""
    pre, post, z = _logits(x, phi, bias, alpha, family, opts)
    h_pre = torch.sigmoid(pre) + opts.pre_eps
    h_post = opts.post_mult * torch.sigmoid(post)
    return h_pre, h_post, family.res(z, x.shape[-2])


@no_autocast
def exact_res_logits(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    family: ExactFamily,
    opts: MHCOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """The family's res logits [..., r] before the softmax / sigmoids."""
    return _logits(x, phi, bias, alpha, family, opts)[2]


def exact_enter(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    family: ExactFamily,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, u, h_pre, h_post, h_res): as `mhc_enter`, with the family's H^res; u = sum_j h_pre_j x_j in u_dtype."""
    h_pre, h_post, h_res = exact_coefficients(x, phi, bias, alpha, family, opts)
    return x, in_dtype(stream_pre(x, h_pre), u_dtype), h_pre, h_post, h_res


def lite_enter(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC-lite's enter op (`exact_enter` with LITE)."""
    return exact_enter(x, phi, bias, alpha, LITE, opts, u_dtype)


def krom_enter(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KromHC's enter op (`exact_enter` with KROM)."""
    return exact_enter(x, phi, bias, alpha, KROM, opts, u_dtype)
