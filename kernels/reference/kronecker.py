"""KromHC's H^res: a Kronecker product of 2 x 2 doubly stochastic factors (docs/design.md §15).

For n = 2^K streams, stream index i is read as K bits (i_0 most significant), and

    H^res = U_0 ⊗ U_1 ⊗ ... ⊗ U_{K-1},   U_k = [[p_k, 1 - p_k], [1 - p_k, p_k]],   p_k = sigmoid(z_k)

so H^res[i, j] = prod_k (p_k if bit k of i equals bit k of j, else 1 - p_k). A Kronecker product of doubly
stochastic matrices is doubly stochastic: its row and column sums are the products of the factors' (each 1), exact
up to rounding. Each 2 x 2 factor is the convex combination p I + (1 - p) swap, mHC-lite at n = 2.
"""

import torch
import torch.nn.functional as F

KROM_STREAMS = (2, 4, 8, 16)

_MASKS: dict = {}


def factor_count(n: int) -> int:
    """The res logits per token: K = log2(n), one per 2 x 2 factor."""
    if n not in KROM_STREAMS:
        raise ValueError(f"KromHC takes n_streams in {list(KROM_STREAMS)} (powers of 2), got {n}")
    return n.bit_length() - 1


def factor_masks(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """[2K, n * n] of 0 / 1: row k marks the entries (i, j), flattened row-major, where bit k of i equals bit k of j
    (they take p_k), row K + k those where it differs (1 - p_k). Built once per (n, dtype, device), as
    birkhoff.permutation_basis."""
    key = (n, dtype, torch.device(device) if device is not None else torch.device("cpu"))
    masks = _MASKS.get(key)
    if masks is None:
        K, i = factor_count(n), torch.arange(n)
        bits = [(i >> (K - 1 - k)) & 1 for k in range(K)]
        same = torch.stack([(b[:, None] == b[None, :]).flatten() for b in bits]).to(torch.float64)
        masks = _MASKS[key] = torch.cat([same, 1 - same]).to(device=key[2], dtype=dtype)
    return masks


def kronecker_res(z: torch.Tensor, n: int) -> torch.Tensor:
    """H^res [..., n, n] for factor logits z [..., K] (z_0: the leftmost factor), in z's dtype.

    The product over factors is taken as exp of a sum of log factors, one matmul with the masks: a loop of
    Kronecker products costs several small ops per factor, forward and backward (4x the time on a CPU). log(1 - p)
    is logsigmoid(-z), exact where 1 - sigmoid(z) would cancel near p = 1 (the identity init)."""
    if z.shape[-1] != factor_count(n):
        raise ValueError(f"KromHC needs {factor_count(n)} res logits per token for n={n}, got {z.shape[-1]}")
    log_factors = torch.cat([F.logsigmoid(z), F.logsigmoid(-z)], dim=-1)
    return (log_factors @ factor_masks(n, z.dtype, z.device)).exp().unflatten(-1, (n, n))
