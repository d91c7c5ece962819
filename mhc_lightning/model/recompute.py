"""The sublayer loop (`run_sublayers`), and selective recompute of the mHC ops over blocks of L_r sublayers
(docs/design.md §9, mHC §4.3.2).

Sublayers that chain (mHC / identity-HC HyperConnections, model/hyper_connection.py) run as one chain: the first
computes its coefficients and input from the stream, then each sublayer's write-back and the next sublayer's
coefficients and input are one boundary op. Other modules run as a plain loop of layer(x).

Each block of `block` consecutive sublayers runs under one non-reentrant `torch.utils.checkpoint` with a
selective-checkpoint policy: the outputs of the expensive matmul-family ops (the branches' projections and
attention) are cached in the forward, everything else is dropped and re-run in the backward. What stays
alive per block is its input (the stream x_{l0}, nC per token, and in a chain the block's first input u and
coefficients, C + a few per token) and the cached branch outputs, among them F's output; the n-stream x_l of
the other sublayers, H^pre x_l, the branch pre-norms and the coefficient intermediates are recomputed. A branch
is not re-run as a whole: its matmuls and attention come from the cache, only its elementwise ops (norm, RoPE,
SiLU) are replayed, as are the mHC ops.
"""

import gc
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ..kernels import get_ops, reference
from .hyper_connection import HyperConnection, hyper_connections

try:  # torch >= 2.5
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:  # torch 2.4: the same caching modes before pytorch#125795 made them public (bool policy)
    from torch.utils.checkpoint import _pt2_selective_checkpoint_context_fn_gen as _contexts_24

    CheckpointPolicy = None

# A matmul contracting over fewer than this many elements is memory-bound: re-running it costs about what
# reading a cached copy costs. This keeps the reference stream_post_res's n x n stream mix (a bmm contracting
# over n <= 8, whose output is a whole n*C stream) out of the cache, and caches branch projections (K = C).
MIN_SAVED_CONTRACTION = 16
_MATMULS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "mv": 0, "_scaled_mm": 0}  # op -> arg index of A [.., K]


def optimal_block(n_sublayers: int, n_streams: int) -> int:
    """L_r* = argmin over integers of nC ceil(L / L_r) + (n + 2) C L_r (docs/design.md §9); ties go to the smaller
    L_r."""
    if n_sublayers < 1:
        raise ValueError(f"n_sublayers must be >= 1, got {n_sublayers}")
    n = n_streams
    return min(range(1, n_sublayers + 1), key=lambda r: n * math.ceil(n_sublayers / r) + (n + 2) * r)


def saves_output(op, args) -> bool:
    """True for the ops whose outputs the checkpoint caches: attention and matmuls with a long contraction."""
    packet = getattr(op, "overloadpacket", None)  # higher-order ops (compiled regions) have none
    if packet is None or getattr(packet, "_qualified_op_name", "").split("::")[0] != "aten":
        # custom ops are recomputed: the fused mHC kernels under torch.compile (mhc_lightning::*). In eager their
        # Triton launches never reach the dispatcher; their op bodies simply run again in the replay.
        return False
    name = packet.__name__
    if name.startswith("_scaled_dot_product_") and "attention" in name and not name.endswith("backward"):
        return True
    if name in _MATMULS:
        a = args[_MATMULS[name]]
        return a.shape[-1] >= MIN_SAVED_CONTRACTION
    return False


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if saves_output(op, args) else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn():
    if CheckpointPolicy is None:
        return _contexts_24(lambda mode, op, *args, **kwargs: saves_output(op, args))
    return create_selective_checkpoint_contexts(_policy)


@contextmanager
def _not_recording(layers: list[nn.Module]) -> Iterator[None]:
    inner = [m for layer in layers for m in hyper_connections(layer)]  # the sublayers themselves, not their wrappers
    flags = [layer.record for layer in inner]
    for layer in inner:
        layer.record = False
    try:
        yield
    finally:
        for layer, flag in zip(inner, flags):
            layer.record = flag


def _chains(layers: Sequence[nn.Module], x: torch.Tensor) -> bool:
    """True when the layers run as one chain of boundary ops on stream x: every one is a plain sublayer that can, and
    its config asks for it (HyperConfig.chain_sublayers: true, or auto where the boundary op is the fused kernels' in
    eager mode)."""
    return len(layers) > 0 and all(_plain(layer) and layer.chains and _asks_chain(layer.cfg, x) for layer in layers)


def _plain(layer: nn.Module) -> bool:
    """A HyperConnection that nothing else runs: the chain calls its `enter` / `chain`, not its forward, so a wrapper
    that forwards attributes to it (FSDP's or Lightning's activation-checkpoint wrapper) or forward hooks (the
    composable checkpoint, FSDP2) would be skipped without a word. Such a layer runs through its forward instead."""
    return isinstance(layer, HyperConnection) and not (layer._forward_hooks or layer._forward_pre_hooks)


def _asks_chain(cfg, x: torch.Tensor) -> bool:
    if cfg.chain_sublayers != "auto":
        return bool(cfg.chain_sublayers)
    return not torch.compiler.is_compiling() and get_ops(cfg.kernel_backend, x.device) is not reference


def _run(layers: Sequence[nn.Module], nxt: Optional[nn.Module], *state):
    """The layers in order. state: the stream x alone, or (chained layers) the carry a previous block handed on.
    Returns the stream, or with a chained nxt the carry for it (its coefficients come from this block's last op)."""
    if not _chains(layers, state[0]):
        (x,) = state
        for layer in layers:
            x = layer(x)
        return x
    carry = layers[0].enter(state[0]) if len(state) == 1 else state
    for i, layer in enumerate(layers):
        carry = layer.chain(carry, layers[i + 1] if i + 1 < len(layers) else nxt)
    return carry


class _Block:
    """The function a checkpoint runs, and re-runs in the backward; only the first run records diagnostics."""

    def __init__(self, layers: list[nn.Module], nxt: Optional[nn.Module]):
        self.layers, self.nxt, self.ran = layers, nxt, False

    def __call__(self, *state):
        replay, self.ran = self.ran, True
        if replay:
            with _not_recording(self.layers):
                return _run(self.layers, self.nxt, *state)
        return _run(self.layers, self.nxt, *state)


def run_sublayers(sublayers: Iterable[nn.Module], x: torch.Tensor, block: int) -> torch.Tensor:
    """x through every sublayer in order (one chain when they all chain). block > 0: one selective checkpoint per
    `block` consecutive sublayers.

    block 0, or no autograd recording (torch.no_grad / inference), or every layer in eval mode: no checkpoints.
    Works with any modules mapping a tensor to a tensor of the same kind (HyperConnection layers here).
    """
    layers = list(sublayers)
    if block <= 0 or not torch.is_grad_enabled() or not any(layer.training for layer in layers):
        return _run(layers, None, x)
    chained = _chains(layers, x)
    state = (x,)
    for i in range(0, len(layers), block):
        part = layers[i : i + block]
        nxt = layers[i + block] if chained and i + block < len(layers) else None
        # Recording layers set `.last` in their forward: a replay in the backward must not overwrite it. The
        # plain function keeps torch.compile free of Python side effects in the usual, non-recording case.
        fn = _Block(part, nxt) if any(getattr(layer, "record", False) for layer in part) else partial(_run, part, nxt)
        out = checkpoint(fn, *state, use_reentrant=False, context_fn=_context_fn)
        state = out if isinstance(out, tuple) else (out,)
    (x,) = state
    return x


@contextmanager
def live_activation_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[dict]:
    """Bytes of the tensors created inside this block that are still alive when the block ends.

    Around a forward this is what autograd keeps for the backward (saved tensors, checkpoint inputs and
    selective-checkpoint caches) plus the outputs the caller still holds. Storages are counted once, by
    weak reference, so views and the checkpoint's detached aliases of one buffer are not double-counted;
    storages of `exclude` (parameters, buffers) are never counted. Result in `stats["bytes"]`.
    saved_tensors_hooks cannot measure this: inside a non-reentrant checkpoint its own hooks replace any
    outer ones, and the selective cache is not a saved tensor at all.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: list[weakref.ref] = []

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    s = t.untyped_storage()
                    if s.data_ptr() not in skip and s.nbytes():
                        seen.append(weakref.ref(s))
            return out

    stats = {"bytes": 0}
    with _Track():
        yield stats
    gc.collect()
    live = {s.data_ptr(): s.nbytes() for s in (r() for r in seen) if s is not None}
    stats["bytes"] = sum(live.values())


@contextmanager
def saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[dict]:
    """Bytes of the tensors autograd saves for the backward inside this block, one count per storage, storages of
    `exclude` left out; result in `stats["bytes"]`. Plain autograd only (see live_activation_bytes)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    stats = {"bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield stats
    stats["bytes"] = sum(v for k, v in packed.items() if k not in skip)
