"""KromHC's H^res: a Kronecker product of 2 x 2 doubly stochastic factors (docs/design.md §15).

For n = 2^K streams, stream index i is read as K bits (i_0 most significant), and

    H^res = U_0 ⊗ U_1 ⊗ ... ⊗ U_{K-1},   U_k = [[p_k, 1 - p_k], [1 - p_k, p_k]],   p_k = sigmoid(z_k)

so H^res[i, j] = prod_k (p_k if bit k of i equals bit k of j, else 1 - p_k). A Kronecker product of doubly
stochastic matrices is doubly stochastic: its row and column sums are the products of the factors' (each 1), exact
up to rounding. Each 2 x 2 factor is the convex combination p I + (1 - p) swap, mHC-lite at n = 2.
"""
import torch

KROM_STREAMS = (2, 4, 8, 16)


def factor_count(n: int) -> int:
    """The res logits per token: K = log2(n), one per 2 x 2 factor."""
    if n not in KROM_STREAMS:
        raise ValueError(f"KromHC takes n_streams in {list(KROM_STREAMS)} (powers of 2), got {n}")
    return n.bit_length() - 1


def kronecker_res(z: torch.Tensor, n: int) -> torch.Tensor:
    """H^res [..., n, n] for factor logits z [..., K] (z_0: the leftmost factor), in z's dtype."""
    if z.shape[-1] != factor_count(n):
        raise ValueError(f"KromHC needs {factor_count(n)} res logits per token for n={n}, got {z.shape[-1]}")
    # 1 - p as sigmoid(-z): near p = 1 (the identity init) 1 - sigmoid(z) would cancel to a few ulps
    p, q = torch.sigmoid(z), torch.sigmoid(-z)
    h = None
    for k in range(z.shape[-1]):
        u = torch.stack([torch.stack([p[..., k], q[..., k]], -1), torch.stack([q[..., k], p[..., k]], -1)], -2)
        if h is None:
            h = u
        else:  # (A ⊗ B)[2a + b, 2c + d] = A[a, c] B[b, d]
            m = h.shape[-1]
            h = (h[..., :, None, :, None] * u[..., None, :, None, :]).reshape(*z.shape[:-1], 2 * m, 2 * m)
    return h
