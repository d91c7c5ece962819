"""What a GradientSnapshots snapshot holds, and how it is copied, fingerprinted and put back: training-state copies
that reuse an evicted snapshot's buffers, an exact checksum of model and optimizer tensors, and the RNG streams."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from .events import norm_sum


def copy_state(obj: Any, spare: Any, dev: Optional[torch.device]) -> Any:
    """Copy of `obj`'s tensors on `dev` (None: where each one is), written into the matching tensors of `spare`
    (an evicted snapshot of the same structure) when shape, dtype and device agree: no allocation and no page
    faults for a GB of state. New CPU copies of CUDA tensors are pinned, so every copy is asynchronous; the
    caller synchronises once."""
    if isinstance(obj, torch.Tensor):
        t, target = obj.detach(), dev or obj.device
        if (
            isinstance(spare, torch.Tensor)
            and spare.shape == t.shape
            and spare.dtype == t.dtype
            and spare.device == target
        ):
            return spare.copy_(t, non_blocking=True)
        if target.type == "cpu" and t.is_cuda:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return t.to(target, copy=True)
    if isinstance(obj, dict):
        spare = spare if isinstance(spare, dict) else {}
        return {k: copy_state(v, spare.get(k), dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        spare = spare if isinstance(spare, (list, tuple)) and len(spare) == len(obj) else [None] * len(obj)
        return type(obj)(copy_state(v, s, dev) for v, s in zip(obj, spare))
    return copy.deepcopy(obj)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        # numpy's key array as a tensor, so the payload loads with torch.load(weights_only=True)
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(state: dict) -> tuple[list[int], bool]:
    """(checksum, all finite) of the model and optimizer tensors of a snapshot.

    The checksum is the int64 sum of each tensor's raw words: exact and independent of reduction order (so
    the same on any device), it changes with any single flipped bit. One extra read of the state.
    """
    ts = [t.detach() for t in tensors({"model": state["model"], "optimizers": state["optimizers"]}) if t.numel()]
    sums = [t.contiguous().view(_WORDS[t.element_size()]).sum(dtype=torch.int64) for t in ts]
    floats = [t for t in ts if t.is_floating_point()]
    finite = bool(norm_sum(floats).isfinite())
    home = sums[0].device if sums else None  # optimizer step counters stay on the CPU beside CUDA weights
    return (torch.stack([s.to(home) for s in sums]).tolist() if sums else []), finite


@dataclass
class Snapshot:
    step: int  # global_step of the state (taken before the batch at `position` was trained)
    position: dict  # epoch, batch_idx, global_step
    state: Optional[dict]  # model, optimizers, schedulers, scaler, rng (None for a disk entry not loaded)
    probe: Optional[tuple[torch.Tensor, torch.Tensor]]
    probe_grad_norm: float
    fingerprint: list[int] = field(default_factory=list)
    path: Optional[str] = None  # disk copy
    sha256: Optional[str] = None
