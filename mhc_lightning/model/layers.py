"""The sublayers F(x, W) that hyper-connections wrap: each owns its pre-norm (docs/design.md §1)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import get_ops
from ..kernels.reference import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """Causal self-attention with RoPE (docs/design.md §13); kernel_backend picks RoPE's op as for the mHC ops."""

    def __init__(
        self, d_model: int, n_heads: int, context: int, rope_base: float, norm_eps: float, kernel_backend: str = "auto"
    ):
        super().__init__()
        self.n_heads, self.kernel_backend = n_heads, kernel_backend
        self.norm = RMSNorm(d_model, norm_eps)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        cos, sin = rope_tables(context, d_model // n_heads, rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = get_ops(self.kernel_backend, x.device).rope_qkv(
            self.qkv(self.norm(x)), self.cos, self.sin, self.n_heads
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, ratio: float, norm_eps: float):
        super().__init__()
        hidden = max(8, int(ratio * d_model) // 8 * 8)
        self.norm = RMSNorm(d_model, norm_eps)
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(self.norm(x)).chunk(2, dim=-1)
        return self.out(F.silu(a) * b)
