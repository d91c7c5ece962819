"""Small helpers for running under Lightning's DDP / FSDP strategies (torch.distributed underneath).

Lightning owns process management; this module only answers questions that need every rank:

- collective decisions: `any_rank`, `max_across_ranks`, `mean_across_ranks`, `broadcast_from_rank0`. A stability
  verdict taken from rank-local values (a loss, a probe batch) must go through one of these before it changes the
  weights, or the ranks diverge (one skips an update or rolls back, the other does not);
- `reduce_diagnostics`: the mHC diagnostics of one recorded sequence per rank, reduced so every rank holds the same
  numbers (so callbacks that act on them decide the same way, and rank 0 logs the worst over all ranks);
- `digest` / `ranks_in_sync` and the `RankConsistencyCheck` callback: every rank holds bitwise the same weights
  (and optimizer state) — the invariant DDP keeps and that a rollback must keep.

Every helper is a no-op returning the local answer when torch.distributed is not initialised (single process).
Collectives must be called by every rank in the same order: only call them under rank-uniform conditions
(global_step, a value already reduced), never under a rank-local one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if dist_ready() else 1


def rank() -> int:
    return dist.get_rank() if dist_ready() else 0


def _collective_device(device: Optional[torch.device]) -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones. Follow the backend, not the caller's guess.
    if dist_ready() and dist.get_backend() == "nccl":
        return device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- collective decisions -----------------------------------------------------------------------
def max_across_ranks(value: float, device: Optional[torch.device] = None) -> float:
    """The largest of every rank's `value` (e.g. the severity index of each rank's stability action)."""
    if world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def any_rank(flag: bool, device: Optional[torch.device] = None) -> bool:
    """True on every rank when `flag` is true on at least one."""
    return max_across_ranks(1.0 if flag else 0.0, device) > 0.5


def mean_across_ranks(value: torch.Tensor | float, device: Optional[torch.device] = None) -> torch.Tensor:
    """Mean over ranks (e.g. the loss of the global batch from each rank's share; shares are equal under DDP)."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if world_size() == 1:
        return t
    t = t.to(_collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / world_size()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (pickled; for small decisions, not tensors of weights)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def reduce_diagnostics(scalars: dict[str, float], per_layer: dict[str, list], device: Optional[torch.device] = None
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
        seg = stacked[:, pos:pos + n]
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
    return {"model": digest(pl_module.state_dict()),
            "optimizer": digest([o.state_dict() for o in trainer.optimizers])}


def ranks_in_sync(trainer, pl_module) -> tuple[bool, list[dict[str, str]]]:
    """(every rank has the same model and optimizer digests, the digests of each rank)."""
    everyone = gather_objects(state_digests(trainer, pl_module))
    return all(d == everyone[0] for d in everyone), everyone


def _sharded(trainer) -> bool:
    # FSDP / model-parallel ranks hold different shards by design; their digests are not comparable.
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    s = trainer.strategy
    return not isinstance(s, (DDPStrategy, SingleDeviceStrategy)) or "DeepSpeed" in type(s).__name__


class RankConsistencyCheck(Callback):
    """Check that every rank holds the same weights and optimizer state (DDP's invariant).

    Cheap enough for every run at fit end (one hash of the state per rank, one small all_gather); with
    `every_n_steps` also during training, e.g. right after rollbacks or other callbacks that touch weights.

    Args:
        every_n_steps: also check after every n-th optimizer step (0 = only at the end of fit).
        on_mismatch: "raise" (RuntimeError naming the ranks that differ) or "warn".
        dirpath: each rank also writes rank<r>.json there (global_step and digests), for tests and post-mortems.
    """

    def __init__(self, every_n_steps: int = 0, on_mismatch: Literal["raise", "warn"] = "raise",
                 dirpath: Optional[str] = None):
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"RankConsistencyCheck.every_n_steps must be an integer >= 0, got {every_n_steps!r}")
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"RankConsistencyCheck.on_mismatch must be 'raise' or 'warn', got {on_mismatch!r}")
        self.every_n_steps, self.on_mismatch = every_n_steps, on_mismatch
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.checks = 0
        self.mismatch_steps: list[int] = []
        self._warned_sharded = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        k = self.every_n_steps
        if k and trainer.global_step % k == 0:
            self.check(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.check(trainer, pl_module)

    def check(self, trainer, pl_module) -> bool:
        if _sharded(trainer):
            if not self._warned_sharded:
                self._warned_sharded = True
                rank_zero_warn(f"RankConsistencyCheck: {type(trainer.strategy).__name__} shards the state across "
                               "ranks; nothing to compare.")
            return True
        ok, everyone = ranks_in_sync(trainer, pl_module)
        self.checks += 1
        step = trainer.global_step
        if not ok:
            self.mismatch_steps.append(step)
        if self.dirpath is not None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "global_step": step,
                      **everyone[trainer.global_rank], "in_sync": ok, "checks": self.checks,
                      "mismatch_steps": self.mismatch_steps}
            (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
        if trainer.global_rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics({"dist/ranks_in_sync": float(ok)}, step=step)
        if not ok:
            differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
            msg = (f"RankConsistencyCheck: at global_step {step} ranks {differ} hold different weights or optimizer "
                   f"state than rank 0 (digests {everyone}). Something changed the state on some ranks only, "
                   "e.g. a callback acting on a rank-local value without a collective decision.")
            if self.on_mismatch == "raise":
                raise RuntimeError(msg)
            rank_zero_warn(msg)
        return ok
