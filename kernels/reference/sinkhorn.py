"""Sinkhorn-Knopp projection onto doubly stochastic matrices (docs/design.md §3).

Everything here is written on H^res, the matrix that left-multiplies the stream vector
(rows = output streams, columns = input streams). Works in any float dtype, float64 included.
"""

import torch

from ..options import EXACT_AXES, SINKHORN_ITERS, STARTS, ExactAxis, SinkhornStart


def _check(iters: int, exact_axis: str, start: str) -> None:
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    if exact_axis not in EXACT_AXES:
        raise ValueError(f"sinkhorn exact_axis must be one of {EXACT_AXES}, got {exact_axis!r}")
    if start not in STARTS:
        raise ValueError(f"sinkhorn start must be one of {STARTS}, got {start!r}")


def _sinkhorn_rows_exact(z: torch.Tensor, iters: int, eps: float, start: str) -> torch.Tensor:
    """Canonical K(Z): T_c first, T_r last, so every row sums to 1 (up to eps)."""
    if start == "log_domain":
        # Same fixed point as `exp` with eps = 0, but stable for very large logit gaps.
        logp = z
        for _ in range(iters):
            logp = logp - torch.logsumexp(logp, dim=-2, keepdim=True)
            logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
        return logp.exp()
    if start == "softmax_eps":
        # DeepSeek: column softmax (T_c o exp with exact max-shift) + eps, then T_r.
        p = torch.softmax(z, dim=-2) + eps
    else:  # "exp": paper Eq. 9; a global shift keeps exp finite and cancels in the normalisation.
        p = torch.exp(z - z.amax(dim=(-2, -1), keepdim=True))
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    p = p / (p.sum(dim=-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
    return p


def sinkhorn(
    z: torch.Tensor,
    iters: int = SINKHORN_ITERS,
    eps: float = 1e-6,
    exact_axis: ExactAxis = "rows",
    start: SinkhornStart = "softmax_eps",
) -> torch.Tensor:
    """Project logits z [..., n, n] (H^res orientation) to a (nearly) doubly stochastic H^res.

    exact_axis="rows" is DeepSeek/paper (forward gain exactly 1); "cols" is K(Z^T)^T, the
    Liger / lucidrains convention (backward gain exactly 1). Differentiable by plain autograd
    through the unrolled iterations: that is the exact gradient every kernel is checked against.
    """
    _check(iters, exact_axis, start)
    if exact_axis == "rows":
        return _sinkhorn_rows_exact(z, iters, eps, start)
    return _sinkhorn_rows_exact(z.transpose(-1, -2), iters, eps, start).transpose(-1, -2)


def sinkhorn_residuals(h_res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Max |row sum - 1| and max |col sum - 1| over the last two dims, per leading index."""
    rows = (h_res.sum(dim=-1) - 1).abs().amax(dim=-1)
    cols = (h_res.sum(dim=-2) - 1).abs().amax(dim=-1)
    return rows, cols
