"""How far apart the n residual streams are: recorded by each mHC / HC sublayer for the diagnostics
(mhc_lightning/diagnostics.py) and for the detector's degenerate-streams check."""

import torch


def stream_spread(x: torch.Tensor) -> torch.Tensor:
    """Relative spread of the streams, max_i ||x_i - mean_j x_j|| / ||mean_j x_j||: [..., n, C] -> [...].

    Exactly 0 while the streams are bitwise identical (the symmetric trap of docs/design.md §6).
    """
    x = x.double()
    mean = x.mean(dim=-2, keepdim=True)
    return (x - mean).norm(dim=-1).amax(dim=-1) / mean.squeeze(-2).norm(dim=-1).clamp_min(1e-30)
