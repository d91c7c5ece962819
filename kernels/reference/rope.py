"""Rotary position embedding on the attention's fused qkv projection (docs/design.md §13).

Channel pairs are (first half, second half) of each head: x1' = x1 cos - x2 sin, x2' = x1 sin + x2 cos, at angle
t * base^(-2j / D) for pair j of a head of D channels at position t.
"""

import torch


def rope_tables(context: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [context, head_dim / 2] in fp32 (angles computed in float64)."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(context, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of x [B, H, T, D]; cos, sin [T, D / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, 3C] (the projection's output) -> q, k rotated and v, each [B, H, T, D]; cos, sin: the tables
    (at least T rows)."""
    B, T, C3 = qkv.shape
    q, k, v = qkv.view(B, T, 3, n_heads, C3 // (3 * n_heads)).permute(2, 0, 3, 1, 4)
    cos, sin = cos[:T], sin[:T]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
