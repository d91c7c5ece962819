"""GPT-style decoder whose sublayers are wired by HyperConnection (residual / HC / mHC / identity-HC).

Streams are expanded once after the embedding, persist through every sublayer, and are collapsed
once before the final norm (docs/design.md §4): expanding per block would make n independent residuals.
"""

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Optional, Union

import torch
import torch.nn as nn

from ..kernels import get_ops
from ..kernels.reference import head_weights, stream_pre
from .config import GPTConfig
from .hyper_connection import HyperConnection, hyper_connections
from .layers import Attention, RMSNorm, SwiGLU
from .recompute import optimal_block, run_sublayers


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype when autocast is on for this device type, else None."""
    try:  # the device-type forms exist from torch 2.4 on; device types without autocast raise
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except (RuntimeError, TypeError, AttributeError):
        return None


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        h, C = cfg.hyper, cfg.d_model
        self.n = h.streams
        self.multi_stream = h.spec.multi_stream
        self.embed = nn.Embedding(cfg.vocab_size, C)
        branches = []
        for _ in range(cfg.n_layers):
            branches.append(Attention(C, cfg.n_heads, cfg.context, cfg.rope_base, cfg.norm_eps, h.kernel_backend))
            branches.append(SwiGLU(C, cfg.mlp_ratio, cfg.norm_eps))
        self.sublayers = nn.ModuleList(HyperConnection(b, C, k, h) for k, b in enumerate(branches))
        # sublayers per selective-recompute block (0 = off); a plain residual has no mHC ops to recompute
        block = optimal_block(cfg.n_sublayers, self.n) if cfg.recompute_block == "auto" else cfg.recompute_block
        self.recompute_block = block if self.multi_stream else 0
        if self.multi_stream and h.collapse == "head":
            self.head_phi = nn.Parameter(torch.zeros(self.n * C, self.n))
            self.head_bias = nn.Parameter(torch.zeros(self.n))
            self.head_alpha = nn.Parameter(torch.tensor(h.alpha_init))
        self.norm = RMSNorm(C, cfg.norm_eps)
        self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tied_head:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self) -> None:
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
        for layer in self.sublayers:  # GPT-2: scale output projections by depth
            nn.init.normal_(layer.branch.out.weight, std=std / math.sqrt(self.cfg.n_sublayers))

    def collapse(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The stream, collapsed to [..., C] in `dtype` (forward passes the embedding's, so that the final norm and
        the head run in the dtype they would with a full-precision stream); None = the stream's dtype."""
        dtype = dtype or x.dtype
        if not self.multi_stream:
            return x.to(dtype)
        if self.cfg.hyper.collapse == "sum":
            return get_ops(self.cfg.hyper.ops_backend, x.device).sum_streams(x, dtype)
        return stream_pre(x, head_weights(x, self.head_phi, self.head_bias, self.head_alpha)).to(dtype)

    def stream_dtype(self, h: torch.Tensor) -> torch.dtype:
        """The residual stream's dtype for embedding output h (GPTConfig.stream_dtype)."""
        if self.cfg.stream_dtype != "auto":
            return getattr(torch, self.cfg.stream_dtype)
        # fp16 autocast keeps the embedding's dtype: the GradScaler guards gradients, not activations, and an
        # unconstrained HC stream can grow past fp16's 65504 (bf16 has fp32's range).
        return torch.bfloat16 if autocast_dtype(h.device.type) == torch.bfloat16 else h.dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[-1] > self.cfg.context:
            raise ValueError(f"sequence length {idx.shape[-1]} exceeds model context {self.cfg.context}")
        h = self.embed(idx)
        if self.multi_stream:  # the cast and the copy into n streams in one pass (one kernel each way when fused)
            x = get_ops(self.cfg.hyper.ops_backend, h.device).expand_streams(h, self.n, self.stream_dtype(h))
        else:
            x = h.to(self.stream_dtype(h))
        x = run_sublayers(self.sublayers, x, self.recompute_block)
        return self.lm_head(self.norm(self.collapse(x, h.dtype)))

    @torch.no_grad()
    def generate(
        self,
        prompt: Union[torch.Tensor, bytes, str],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> Union[torch.Tensor, bytes]:
        """Continue `prompt` by `max_new_tokens` tokens, each drawn from the softmax of the last logits / temperature
        (temperature 0: greedy, the most likely token), among the `top_k` most likely when given. Each step reads the
        last `context` tokens (no KV cache: one full forward per token). A tensor prompt ([T] or [B, T] token ids) gives
        the ids with the continuation appended; bytes or str (UTF-8) give bytes, for the byte vocabulary of 256."""
        if temperature < 0 or (top_k is not None and top_k < 1) or max_new_tokens < 0:
            raise ValueError(
                f"generate needs temperature >= 0, top_k >= 1 or None and max_new_tokens >= 0, got temperature="
                f"{temperature}, top_k={top_k}, max_new_tokens={max_new_tokens}"
            )
        as_bytes = isinstance(prompt, (bytes, str))
        if as_bytes:
            if self.cfg.vocab_size < 256:
                raise ValueError(
                    f"a bytes prompt needs the byte vocabulary (256), this model has {self.cfg.vocab_size}"
                )
            data = prompt.encode() if isinstance(prompt, str) else prompt
            prompt = torch.tensor(list(data), dtype=torch.long)
        idx = prompt.to(self.embed.weight.device).long()
        single = idx.dim() == 1
        idx = idx[None] if single else idx
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.cfg.context :])[:, -1].float()
                if temperature == 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth = torch.topk(logits, top_k).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        out = idx[0] if single else idx
        return bytes(out.flatten().tolist()) if as_bytes else out

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within this block, every sublayer keeps its first sequence's H_pre / H_post / H_res."""
        layers = hyper_connections(self.sublayers)
        for layer in layers:
            layer.record, layer.last = True, None
        try:
            yield
        finally:
            for layer in layers:
                layer.record = False

    def recorded(self) -> dict[str, torch.Tensor]:
        """Stacked coefficients of the last recorded forward: h_res [L, T, n, n], h_pre/h_post [L, T, n], and the
        relative spread of the streams each sublayer wrote, spread [L, T]; for mHC the range of each token's res
        logits before Sinkhorn, logit_range [L, T]."""
        lasts = [layer.last for layer in hyper_connections(self.sublayers)]
        if not self.multi_stream or any(l is None for l in lasts):
            return {}
        out = {k: torch.stack([l[k][0] for l in lasts]) for k in ("h_pre", "h_post", "spread")}
        if all("logit_range" in l for l in lasts):
            out["logit_range"] = torch.stack([l["logit_range"][0] for l in lasts])
        if lasts[0]["h_res"] is not None:
            out["h_res"] = torch.stack([l["h_res"][0] for l in lasts])
        else:  # identity-HC: H_res = I by construction
            L, T, n = out["h_pre"].shape
            out["h_res"] = torch.eye(n, dtype=out["h_pre"].dtype, device=out["h_pre"].device).expand(L, T, n, n)
        return out


def compile_model(model: nn.Module, **compile_kwargs) -> Callable:
    """torch.compile for the model without a new trace per Sinkhorn iteration count.

    The SinkhornScheduler changes each HyperConnection's `sinkhorn_iters`, a plain int attribute. Dynamo specialises
    ints on modules by default, so every new count would trace the model again (and past its cache limit, run it
    eagerly). With `allow_unspec_int_on_nn_module` an int that changes becomes symbolic on the next trace, and the fused
    kernels take the count as a runtime argument: one extra trace in all. The reference ops unroll Sinkhorn in Python,
    so with `kernel_backend: torch` each count is still its own graph.
    """
    compiled = torch.compile(model, **compile_kwargs)
    if not hasattr(torch._dynamo.config, "allow_unspec_int_on_nn_module"):
        return compiled

    def forward(*args, **kwargs):
        # read by dynamo when it traces (first call, recompiles): scoped to this model's calls
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return compiled(*args, **kwargs)

    return forward
