"""mHC-lite's H^res: a convex combination of all n! permutation matrices (docs/design.md §15).

By Birkhoff-von Neumann every doubly stochastic matrix is such a combination, and every such combination is doubly
stochastic: each permutation matrix has unit row and column sums, so H^res = sum_k a_k P_k with a on the simplex has
row and column sums sum_k a_k = 1 exactly, up to rounding, with no iteration to truncate.

Layout: coefficient k belongs to the k-th permutation sigma_k of range(n) in lexicographic order (`itertools.
permutations`), so k = 0 is the identity; P_k[i, sigma_k(i)] = 1, i.e. output stream i reads input stream sigma_k(i)
(H^res left-multiplies the stream, rows = output streams).
"""

import itertools
import math

import torch

# n! coefficients per token: 120 at n = 5, 720 at 6 (more projection columns than a sublayer's branch has inputs)
LITE_STREAMS = (2, 3, 4, 5)

_BASES: dict = {}


def permutation_count(n: int) -> int:
    """The res logits per token: n!."""
    if n not in LITE_STREAMS:
        raise ValueError(f"mHC-lite takes n_streams in {list(LITE_STREAMS)}, got {n}")
    return math.factorial(n)


def permutation_basis(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """[n!, n * n]: row k is P_k flattened row-major. Built once per (n, dtype, device): on a GPU a fresh copy per
    call would be a host-to-device transfer per sublayer."""
    key = (n, dtype, torch.device(device) if device is not None else torch.device("cpu"))
    basis = _BASES.get(key)
    if basis is None:
        perms = list(itertools.permutations(range(n)))
        rows = torch.zeros(len(perms), n, n, dtype=torch.float64)
        for k, sigma in enumerate(perms):
            rows[k, torch.arange(n), torch.tensor(sigma)] = 1.0
        basis = _BASES[key] = rows.flatten(1).to(device=key[2], dtype=dtype)
    return basis


def birkhoff_res(z: torch.Tensor, n: int) -> torch.Tensor:
    """H^res [..., n, n] = sum_k softmax(z)_k P_k for logits z [..., n!], in z's dtype."""
    if z.shape[-1] != permutation_count(n):
        raise ValueError(f"mHC-lite needs {math.factorial(n)} res logits per token for n={n}, got {z.shape[-1]}")
    a = torch.softmax(z, dim=-1)
    return (a @ permutation_basis(n, z.dtype, z.device)).unflatten(-1, (n, n))
