"""Small helpers for running under Lightning's DDP / FSDP strategies (torch.distributed underneath).

Lightning owns process management; this module only answers questions that need every rank:

- `mean_across_ranks`, `gather_objects`: a value from every rank (a stability verdict taken from rank-local values
  must be reduced before it changes the weights, or the ranks diverge; the callbacks use Lightning's
  `strategy.reduce_boolean_decision` / `broadcast` for yes/no decisions);
- `reduce_diagnostics`: the mHC diagnostics of one recorded sequence per rank, reduced so every rank holds the same
  numbers (so callbacks that act on them decide the same way, and rank 0 logs the worst over all ranks);
- `digest` / `state_digests` / `ranks_in_sync`: every rank holds bitwise the same weights (and optimizer state), the
  invariant DDP keeps and that a rollback must keep (checked by callbacks/rank_consistency.py);

Every helper is a no-op returning the local answer when torch.distributed is not initialised (single process).
Collectives must be called by every rank in the same order: only call them under rank-uniform conditions
(global_step, a value already reduced), never under a rank-local one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if dist_ready() else 1


def rank() -> int:
    return dist.get_rank() if dist_ready() else 0


def _collective_device(device: Optional[torch.device]) -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones. Follow the backend, not the caller's guess.
    if dist_ready() and dist.get_backend() == "nccl":
        if device is not None and device.type == "cuda":
            return device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- values from every rank ---------------------------------------------------------------------
def mean_across_ranks(value: torch.Tensor | float, device: Optional[torch.device] = None) -> torch.Tensor:
    """Mean over ranks (e.g. the loss of the global batch from each rank's share; shares are equal under DDP)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if world_size() == 1:
        return t
    t = t.to(_collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / world_size()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- diagnostics --------------------------------------------------------------------------------
def _reduction(key: str) -> str:
    # The name says how the value aggregates tokens; pooling the ranks' sequences aggregates the same way.
    # max / min / token means are then exact; a metric of the token-averaged matrix ("tokmean") becomes the
    # mean over ranks of that metric, a close approximation.
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "mean"


def reduce_diagnostics(
    scalars: dict[str, float], per_layer: dict[str, list], device: Optional[torch.device] = None
) -> tuple[dict[str, float], dict[str, list]]:
    """The diagnostics of one sequence per rank, reduced over ranks by key name (one all_gather, float64).

    Every rank must call this at the same steps (LitLM does at the diagnostics steps, which depend on
    global_step only). NaN on any rank stays NaN, so a broken rank is never hidden by the others.
    """
    if world_size() == 1 or (not scalars and not per_layer):
        return scalars, per_layer
    items: list[tuple[str, str, torch.Size]] = []
    flat: list[torch.Tensor] = []
    for where, values in (("s", scalars), ("p", per_layer)):
        for k in sorted(values):
            t = torch.as_tensor(values[k], dtype=torch.float64)
            items.append((where, k, t.shape))
            flat.append(t.reshape(-1))
    mine = torch.cat(flat).to(_collective_device(device))
    everyone = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(everyone, mine)
    stacked = torch.stack(everyone).cpu()  # [world, N]
    out_s: dict[str, float] = {}
    out_p: dict[str, list] = {}
    pos = 0
    for where, k, shape in items:
        n = shape.numel()
        seg = stacked[:, pos : pos + n]
        pos += n
        how = _reduction(k)
        red = seg.amax(0) if how == "max" else seg.amin(0) if how == "min" else seg.mean(0)
        # amax/amin propagate NaN already; make the mean do the same explicitly for clarity
        red = torch.where(seg.isnan().any(0), torch.full_like(red, float("nan")), red)
        if where == "s":
            out_s[k] = float(red.item())
        else:
            out_p[k] = red.reshape(shape).tolist()
    return out_s, out_p


# ---- weights equal on every rank ----------------------------------------------------------------
def _walk(obj: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _walk(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def digest(obj: Any) -> str:
    """sha256 of a (nested) state dict: names, dtypes, shapes and the exact bytes of every tensor, plus the
    repr of every other leaf. Bitwise: two ranks agree only if their states are identical."""
    h = hashlib.sha256()
    for name, leaf in _walk(obj):
        h.update(name.encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def state_digests(trainer, pl_module) -> dict[str, str]:
    """Digests of this rank's model weights and optimizer state."""
    return {"model": digest(pl_module.state_dict()), "optimizer": digest([o.state_dict() for o in trainer.optimizers])}


def ranks_in_sync(trainer, pl_module) -> tuple[bool, list[dict[str, str]]]:
    """(every rank has the same model and optimizer digests, the digests of each rank)."""
    everyone = gather_objects(state_digests(trainer, pl_module))
    return all(d == everyone[0] for d in everyone), everyone


def sharded(trainer) -> bool:
    # FSDP / model-parallel ranks hold different shards by design; their digests are not comparable.
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    s = trainer.strategy
    return not isinstance(s, (DDPStrategy, SingleDeviceStrategy)) or "DeepSpeed" in type(s).__name__
