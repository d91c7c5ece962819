"""Res-logit biases of mHC-lite and KromHC at t = 0 (docs/design.md §15).

Each bias scheme of docs/design.md §6 gives mHC a diagonal gap g (res logits g I, H^res = Sinkhorn(g I)); that
H^res is d I + o (J - I) with d = e^g / (e^g + n - 1), already doubly stochastic. The exact families start from the
same diagonal d, so that with one bias_init / res_gap the three H^res families start equally close to I and only
their parameterisation differs:

- mHC-lite: the identity permutation's logit leads the other n! - 1 by g'. Its diagonal is
  (e^g' + (n-1)! - 1) / (e^g' + n! - 1), equal to d for e^g' = (n-1)! (e^g - 1) + 1; H^res is then d I + o (J - I),
  the very matrix mHC starts from.
- KromHC: each of the K = log2 n factors gets p = d^(1/K), logit ln(p / (1 - p)); the diagonal is p^K = d and an
  off-diagonal entry p^(K-h) (1 - p)^h, h the number of bits in which the two stream indices differ.
"""

import math

import torch

from ..kernels.reference import factor_count, permutation_count
from .modes import ModeSpec

# the mHC diagonal gap each scheme of docs/design.md §6 sets (home: res_gap); 0 = uniform J/n, the symmetric start
SCHEME_GAPS = {"a6": 6.0, "hc_identity": 1.0, "near_identity": 10.0, "zeros": 0.0}


def mhc_diagonal(n: int, gap: float) -> float:
    """d = diagonal of Sinkhorn(gap I) at n streams."""
    return 1.0 / (1.0 + (n - 1) * math.exp(-gap))


def lite_gap(n: int, gap: float) -> float:
    """g' with which mHC-lite's identity lead gives the diagonal of mHC's gap."""
    return math.log(math.factorial(n - 1) * math.expm1(gap) + 1.0)


def krom_logit(n: int, gap: float) -> float:
    """Each KromHC factor's logit, from p = d^(1/K)."""
    log_p = math.log(mhc_diagonal(n, gap)) / factor_count(n)
    return log_p - math.log(-math.expm1(log_p)) if log_p < 0 else math.inf


def lite_res_bias(n: int, gap: float) -> torch.Tensor:
    """mHC-lite's n! res-logit biases: the identity permutation leads the others by `lite_gap`."""
    out = torch.zeros(permutation_count(n))
    out[0] = lite_gap(n, gap)  # permutation 0 is the identity (kernels/reference/birkhoff.py)
    return out


def krom_res_bias(n: int, gap: float) -> torch.Tensor:
    """KromHC's log2 n res-logit biases, all `krom_logit`."""
    return torch.full((factor_count(n),), krom_logit(n, gap))


def exact_res_bias(spec: ModeSpec, n: int, scheme: str, res_gap: float) -> torch.Tensor:
    """The res-logit biases [r] of exact mode `spec` (its res_init) for bias_init `scheme` (home: res_gap)."""
    gap = res_gap if scheme == "home" else SCHEME_GAPS[scheme]
    return globals()[spec.res_init](n, gap)
