"""The models `python -m bench stack` times: pre-norm causal attention (SDPA) and pre-norm SwiGLU sublayers, summed
by a residual or wired by mHC / HC (the project's HyperConnection), Liger-Kernel's LigerMHC or lucidrains'
hyper-connections. Streams are expanded once after the input and sum-collapsed at the end."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mhc_lightning.model import HyperConfig, HyperConnection
from mhc_lightning.model.recompute import run_sublayers

N_STREAMS = 4


class Norm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads, self.norm = heads, Norm(c)
        self.wqkv = nn.Linear(c, 3 * c, bias=False)
        self.wo = nn.Linear(c, c, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.wqkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    def __init__(self, c):
        super().__init__()
        hidden = int(8 * c / 3) // 64 * 64 or 64
        self.norm = Norm(c)
        self.w_in = nn.Linear(c, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, c, bias=False)

    def forward(self, x):
        gate, up = self.w_in(self.norm(x)).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


def sublayers(c, heads, blocks):
    return [m for _ in range(blocks) for m in (Attention(c, heads), SwiGLU(c))]


def expand(x):
    return x.unsqueeze(-2).expand(*x.shape[:-1], N_STREAMS, x.shape[-1]).contiguous()


class Residual(nn.Module):
    def __init__(self, c, heads, blocks):
        super().__init__()
        self.layers = nn.ModuleList(sublayers(c, heads, blocks))

    def forward(self, x):
        for f in self.layers:
            x = x + f(x)
        return x


class Hyper(nn.Module):
    """Sublayers wired by HyperConnection, as the model wires them: chained (one boundary op between sublayers) or one
    sublayer at a time (its enter op, the branch, its write-back); `recompute` sublayers per selective-recompute block
    (docs/design.md §9; 0 = off)."""

    def __init__(
        self, c, heads, blocks, backend, chained=True, recompute=0, mode="mhc", rebuild=False, sinkhorn_iters=20
    ):
        super().__init__()
        cfg = dict(
            residual_mode=mode,
            n_streams=N_STREAMS,
            kernel_backend=backend,
            phi_init="normal",
            bias_init="a6" if mode != "hc" else "hc_identity",
            sinkhorn_iters=sinkhorn_iters,
            rebuild_branch_input=rebuild,
            chain_sublayers=chained,
        )
        self.layers = nn.ModuleList(
            HyperConnection(f, c, i, HyperConfig(**cfg)) for i, f in enumerate(sublayers(c, heads, blocks))
        )
        self.recompute = recompute

    def forward(self, x):
        return run_sublayers(self.layers, expand(x), self.recompute).sum(-2)


class Liger(nn.Module):
    def __init__(self, c, heads, blocks):
        super().__init__()
        from liger_kernel.transformers.mhc import LigerMHC

        self.layers = nn.ModuleList(
            LigerMHC(f, hc=N_STREAMS, c=c, tmax=20, phi_dtype=torch.bfloat16) for f in sublayers(c, heads, blocks)
        )

    def forward(self, x):
        x = expand(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum(-2)


class Lucid(nn.Module):
    def __init__(self, c, heads, blocks):
        super().__init__()
        from hyper_connections import mc_get_init_and_expand_reduce_stream_functions

        init, self.expand, self.reduce = mc_get_init_and_expand_reduce_stream_functions(N_STREAMS, sinkhorn_iters=20)
        self.layers = nn.ModuleList(
            init(dim=c, branch=f, layer_index=i) for i, f in enumerate(sublayers(c, heads, blocks))
        )

    def forward(self, x):
        x = self.expand(x)
        for layer in self.layers:
            x = layer(x)
        return self.reduce(x)
