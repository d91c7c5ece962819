"""GradientSnapshots: keep validated training-state snapshots and roll back to one on request.

Every `every_n_steps` optimizer steps (and at the first batch of a fit) the callback copies model,
optimizer, LR-scheduler, loss-scaler and RNG states, the data position, a probe batch and the gradient
norm of that probe batch into an in-memory ring of `keep` snapshots, and optionally to `dirpath` as
`snapshot-step<step>.pt` plus a JSON sidecar with its sha256.

A rollback request (InstabilityDetector sets it, the update of that step is already vetoed) is served in
on_train_batch_end: newest snapshot first, each one must pass state-loading validation (checksum, tensor
shapes against the live model / optimizer, finite values) and then a gradient consistency check (the probe
gradient norm recomputed on the restored weights must match the one recorded at snapshot time). The
first that passes stays loaded. Then, optionally: reset optimizer moments, skip `skip_batches` further
batches, lower the LR by `cooldown_lr_factor` and raise Sinkhorn iterations for `cooldown_steps` steps.

Data: the data loader is NOT rewound, so the batches between the snapshot and the event are never
replayed (the PaLM-style skip of the window that led to the event); `global_step` keeps counting
attempted steps, so `max_steps` bounds compute and MLflow steps stay monotone. The LR schedule is
restored with the optimizer, i.e. it restarts from the snapshot's position.

Checkpoints: the callback's state (rollback history, cool-down, on-disk snapshot list, RNG and the
shuffle position of the train loader) is saved in every Lightning checkpoint. Lightning does not restore
the position inside an epoch of a plain DataLoader; with `resumable_data` the callback records the
shuffle generator state and the batches done and fast-forwards the sampler on resume, so a run resumed
from `last` continues on exactly the batches an uninterrupted run would see.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from ..files import sha256_file
from .events import StabilityEvent, channel_of, check_choice, check_number, log_metrics, norm_sum


class RollbackError(RuntimeError):
    """Raised when a rollback cannot be served (no valid snapshot) or the rollback cap is exceeded."""


# ---- state helpers ----------------------------------------------------------------------------
def _copy_state(obj: Any, spare: Any, dev: Optional[torch.device]) -> Any:
    """Copy of `obj`'s tensors on `dev` (None: where each one is), written into the matching tensors of `spare`
    (an evicted snapshot of the same structure) when shape, dtype and device agree: no allocation and no page
    faults for a GB of state. New CPU copies of CUDA tensors are pinned, so every copy is asynchronous; the
    caller synchronises once."""
    if isinstance(obj, torch.Tensor):
        t, target = obj.detach(), dev or obj.device
        if (isinstance(spare, torch.Tensor) and spare.shape == t.shape and spare.dtype == t.dtype
                and spare.device == target):
            return spare.copy_(t, non_blocking=True)
        if target.type == "cpu" and t.is_cuda:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return t.to(target, copy=True)
    if isinstance(obj, dict):
        spare = spare if isinstance(spare, dict) else {}
        return {k: _copy_state(v, spare.get(k), dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        spare = spare if isinstance(spare, (list, tuple)) and len(spare) == len(obj) else [None] * len(obj)
        return type(obj)(_copy_state(v, s, dev) for v, s in zip(obj, spare))
    return copy.deepcopy(obj)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


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


def _fingerprint(state: dict) -> tuple[list[int], bool]:
    """(checksum, all finite) of the model and optimizer tensors of a snapshot.

    The checksum is the int64 sum of each tensor's raw words: exact and independent of reduction order (so
    the same on any device), it changes with any single flipped bit. One extra read of the state.
    """
    ts = [t.detach() for t in _tensors({"model": state["model"], "optimizers": state["optimizers"]}) if t.numel()]
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


# ---- resumable train loader -------------------------------------------------------------------
class _ResumableSampler(Sampler[int]):
    """The wrapped sampler's order, plus the generator state at the start of the current epoch.

    `resume = (generator_state or None, skip_indices)` replays an epoch's order and drops its first indices.
    Works for a seeded RandomSampler (the permutation is drawn from its generator at the first index) and for
    a SequentialSampler (no state but the position).
    """

    def __init__(self, inner: Sampler):
        self.inner = inner
        self.generator: Optional[torch.Generator] = getattr(inner, "generator", None)
        self.epoch_state: Optional[torch.Tensor] = None
        self.resume: Optional[tuple[Optional[torch.Tensor], int]] = None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self.resume is not None:
            state, skip = self.resume
            self.resume = None
            if state is not None and self.generator is not None:
                self.generator.set_state(state)
        self.epoch_state = self.generator.get_state() if self.generator is not None else None
        it = iter(self.inner)
        for _ in range(skip):
            next(it)
        yield from it


class GradientSnapshots(Callback):
    """Snapshots of the full training state and validated rollback (see the module docstring).

    Args:
        every_n_steps: optimizer steps between snapshots.
        keep: snapshots kept in memory (0 = none, then `dirpath` is required).
        device: where in-memory copies live: "cpu" (frees accelerator memory) or "same".
        dirpath: also write each snapshot there with a sha256 sidecar; null = memory only.
        keep_on_disk: snapshot files kept in `dirpath`.
        grad_check: run the gradient consistency check on the probe batch after loading.
        grad_check_rtol: allowed relative difference of the probe gradient norm.
        reset_optimizer: clear the optimizer moments after a rollback.
        skip_batches: batches skipped after a rollback, on top of the never-replayed window.
        cooldown_steps: steps of cool-down after a rollback (0 = none).
        cooldown_lr_factor: LR multiplier during the cool-down.
        cooldown_sinkhorn_iters: minimum Sinkhorn iterations during the cool-down; null = unchanged.
        max_rollbacks: rollbacks allowed within `rollback_window` steps; one more raises RollbackError.
        rollback_window: the window, in optimizer steps.
        resumable_data: make the datamodule's shuffled train loader resume mid-epoch from checkpoints.
    """

    def __init__(
        self,
        every_n_steps: int = 500,
        keep: int = 2,
        device: str = "cpu",
        dirpath: Optional[str] = None,
        keep_on_disk: int = 2,
        grad_check: bool = True,
        grad_check_rtol: float = 1e-3,
        reset_optimizer: bool = False,
        skip_batches: int = 0,
        cooldown_steps: int = 50,
        cooldown_lr_factor: float = 0.5,
        cooldown_sinkhorn_iters: Optional[int] = None,
        max_rollbacks: int = 3,
        rollback_window: int = 1000,
        resumable_data: bool = True,
    ):
        super().__init__()
        me = type(self).__name__
        check_number(me, "every_n_steps", every_n_steps, low=1, integer=True)
        check_number(me, "keep", keep, low=0, integer=True)
        check_choice(me, "device", device, ("cpu", "same"))
        check_number(me, "keep_on_disk", keep_on_disk, low=1, integer=True)
        check_number(me, "grad_check_rtol", grad_check_rtol, low=0, strict=True)
        check_number(me, "skip_batches", skip_batches, low=0, integer=True)
        check_number(me, "cooldown_steps", cooldown_steps, low=0, integer=True)
        check_number(me, "cooldown_lr_factor", cooldown_lr_factor, low=0, strict=True, high=1)
        check_number(me, "cooldown_sinkhorn_iters", cooldown_sinkhorn_iters, low=1, integer=True, optional=True)
        check_number(me, "max_rollbacks", max_rollbacks, low=0, integer=True)
        check_number(me, "rollback_window", rollback_window, low=1, integer=True)
        for name, value in (("grad_check", grad_check), ("reset_optimizer", reset_optimizer),
                            ("resumable_data", resumable_data)):
            if not isinstance(value, bool):
                raise ValueError(f"{me}.{name} must be true or false, got {value!r}")
        if keep == 0 and dirpath is None:
            raise ValueError(f"{me}.keep is 0 and {me}.dirpath is null: snapshots would be kept nowhere")
        self.every_n_steps, self.keep, self.device = every_n_steps, keep, device
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.keep_on_disk = keep_on_disk
        self.grad_check, self.grad_check_rtol = grad_check, grad_check_rtol
        self.reset_optimizer, self.skip_batches = reset_optimizer, skip_batches
        self.cooldown_steps, self.cooldown_lr_factor = cooldown_steps, cooldown_lr_factor
        self.cooldown_sinkhorn_iters = cooldown_sinkhorn_iters
        self.max_rollbacks, self.rollback_window = max_rollbacks, rollback_window
        self.resumable_data = resumable_data

        self.ring: deque[Snapshot] = deque(maxlen=keep) if keep else deque(maxlen=1)
        self.disk: list[dict] = []  # sidecar records of the files in dirpath, oldest first
        self.rollback_steps: list[int] = []
        self.skip_remaining = 0
        self.cooldown_until = -1
        self._sinkhorn_saved: Optional[list[int]] = None  # iterations to restore after a direct cool-down
        self._last_snapshot_step: Optional[int] = None
        self._deferred = False
        self._batch_step = 0
        self._trainer = None
        self._sampler: Optional[_ResumableSampler] = None
        self._pending_data: Optional[dict] = None
        self._pending_rng: Optional[dict] = None
        self._orig_train_dataloader = None

    @property
    def state_key(self) -> str:
        return type(self).__name__

    # ---- setup / teardown -----------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.keep == 0 and trainer.world_size > 1:
            raise ValueError(f"{type(self).__name__}.keep must be >= 1 with several processes: only rank 0 writes "
                             "snapshot files, every rank restores from its in-memory ring")
        self._trainer = trainer
        channel_of(pl_module, trainer).rollback_handler = self
        if stage == "fit" and self.resumable_data:
            self._wrap_train_dataloader(trainer)
        if self.dirpath is not None and trainer.global_rank == 0:
            self.dirpath.mkdir(parents=True, exist_ok=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        dm = trainer.datamodule
        if self._orig_train_dataloader is not None and dm is not None:
            if "train_dataloader" in vars(dm):
                del dm.train_dataloader  # back to the class's method
            self._orig_train_dataloader = None
        self.ring.clear()  # free the copies

    def _wrap_train_dataloader(self, trainer) -> None:
        dm = trainer.datamodule
        if dm is None or trainer.world_size > 1:
            rank_zero_warn(f"{type(self).__name__}: resumable_data needs a datamodule and a single process; "
                           "mid-epoch resume falls back to Lightning's behaviour (epoch restarts).")
            return
        if self._orig_train_dataloader is not None:
            return
        orig = dm.train_dataloader
        self._orig_train_dataloader = orig

        def train_dataloader():
            dl = orig()
            bs = getattr(dl, "batch_sampler", None)
            inner = getattr(bs, "sampler", None)
            seeded = isinstance(inner, RandomSampler) and inner.generator is not None and not inner.replacement
            if not isinstance(bs, BatchSampler) or not (seeded or isinstance(inner, SequentialSampler)):
                rank_zero_warn(f"{type(self).__name__}: the train loader is neither a seeded RandomSampler nor a "
                               "SequentialSampler; mid-epoch resume is left to Lightning.")
                return dl
            sampler = _ResumableSampler(inner)
            bs.sampler = sampler  # BatchSampler reads .sampler at each iter(); DataLoader itself is unchanged
            self._sampler = sampler
            if self._pending_data is not None:
                d, self._pending_data = self._pending_data, None
                if d["batches_done"] >= d["batches_per_epoch"]:  # saved at an epoch end: next permutation
                    sampler.resume = (d["generator_now"], 0)
                    where = f"epoch {d['epoch'] + 1}, batch 0"
                else:
                    sampler.resume = (d["epoch_generator"], d["batches_done"] * bs.batch_size)
                    where = f"epoch {d['epoch']}, batch {d['batches_done']}"
                rank_zero_info(f"{type(self).__name__}: resuming the train loader at {where} (same shuffle "
                               "order as an uninterrupted run; Lightning's 'dataloader is not resumable' "
                               "warning does not apply)")
            return dl

        dm.train_dataloader = train_dataloader

    # ---- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        out = {"rollback_steps": list(self.rollback_steps), "skip_remaining": self.skip_remaining,
               "cooldown_until": self.cooldown_until, "sinkhorn_saved": self._sinkhorn_saved,
               "disk": [dict(d) for d in self.disk], "last_snapshot_step": self._last_snapshot_step,
               "rng": rng_state()}
        t, s = self._trainer, self._sampler
        if t is not None and s is not None:
            out["data"] = {
                "epoch_generator": s.epoch_state.clone() if s.epoch_state is not None else None,
                "generator_now": s.generator.get_state() if s.generator is not None else None,
                "batches_done": int(t.fit_loop.epoch_loop.batch_progress.current.processed),
                "batches_per_epoch": int(t.num_training_batches),
                "epoch": int(t.current_epoch),
            }
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        self.rollback_steps = list(state_dict["rollback_steps"])
        self.skip_remaining = state_dict["skip_remaining"]
        self.cooldown_until = state_dict["cooldown_until"]
        self._sinkhorn_saved = state_dict["sinkhorn_saved"]
        self.disk = [dict(d) for d in state_dict["disk"]]
        self._last_snapshot_step = state_dict["last_snapshot_step"]
        self._pending_rng = state_dict.get("rng")
        self._pending_data = state_dict.get("data")

    def on_train_start(self, trainer, pl_module) -> None:
        if self._pending_rng is not None:  # resumed: continue the random streams where the checkpoint left them
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ---- per step -------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = self._batch_step = trainer.global_step
        channel = channel_of(pl_module)
        if self.skip_remaining > 0:
            self.skip_remaining -= 1
            pl_module.skip_batch = True
        cooling = step < self.cooldown_until
        pl_module.lr_scale = self.cooldown_lr_factor if cooling else 1.0
        if self.cooldown_sinkhorn_iters is not None and channel.sinkhorn_owner is None:
            self._direct_sinkhorn_cooldown(pl_module, cooling)
        # The first batch of a fit (also after a resume: the in-memory ring is not checkpointed) gets one too.
        first = self._last_snapshot_step is None or (self.keep > 0 and not self.ring)
        due = first or (step % self.every_n_steps == 0 and step != self._last_snapshot_step)
        # Never right after an event: the state may already carry the instability.
        after_event = channel.last_event_step is not None and channel.last_event_step >= step - 1
        if (due or self._deferred) and not after_event and not pl_module.skip_batch:
            self._deferred = not self._take(trainer, pl_module, batch, batch_idx)
        elif due:
            self._deferred = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        channel = channel_of(pl_module)
        request = channel.rollback_request
        if request is not None:
            channel.rollback_request = None
            self._rollback(trainer, pl_module, request, batch_idx)
        channel.flush(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        channel_of(pl_module).flush(trainer)

    # ---- snapshot -------------------------------------------------------------------------
    @staticmethod
    def _live_state(trainer, pl_module) -> dict:
        """The training state's own dicts (tensors not copied): model, optimizers, LR schedulers."""
        return {"model": pl_module.model.state_dict(), "optimizers": [o.state_dict() for o in trainer.optimizers],
                "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}

    def _full_state(self, trainer, live: dict, spare: Optional[dict] = None) -> dict:
        dev = torch.device("cpu") if self.device == "cpu" else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        state = _copy_state(live, spare, dev)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the device-to-host copies are asynchronous
        state["scaler"] = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        state["rng"] = rng_state()
        return state

    def _probe_grad_norm(self, trainer, pl_module, probe) -> float:
        """Gradient norm of the probe batch at the current weights; leaves .grad and the RNG untouched."""
        rng = rng_state()
        params = [p for p in pl_module.parameters() if p.requires_grad]
        batch = tuple(t.to(pl_module.device) for t in probe)
        with trainer.precision_plugin.forward_context():
            loss = pl_module.batch_loss(batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        norms = [g.float().norm() for g in grads if g is not None]
        set_rng_state(rng)
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def _take(self, trainer, pl_module, batch, batch_idx) -> bool:
        t0 = time.perf_counter()
        step = trainer.global_step
        probe = tuple(t.detach().to("cpu", copy=True) for t in batch[:2])
        probe_norm = self._probe_grad_norm(trainer, pl_module, probe)
        # Checksummed where the live state is (the GPU reads it in microseconds; the CPU copy would take a single
        # CPU thread ~1 s per GB): the sums are exact integers, so the copy's own fingerprint is the same.
        live = self._live_state(trainer, pl_module)
        fingerprint, finite = _fingerprint(live)
        finite = finite and math.isfinite(probe_norm)
        # Several processes: the probe batch is per rank, so decide together or the rings would differ.
        if not trainer.strategy.reduce_boolean_decision(finite, all=True):
            # Never let a non-finite state take a ring slot (it would push out a good snapshot): retry next step.
            self._deferred = True
            event = StabilityEvent(step, "snapshot_refused", float("nan"), float("nan"), "deferred",
                                   type(self).__name__, "state not finite at snapshot time")
            channel_of(pl_module).record(event, trainer)
            return False
        # Validated: the snapshot that the ring is about to evict lends its buffers (no allocation, pinned).
        spare = self.ring.popleft().state if self.keep and len(self.ring) == self.ring.maxlen else None
        snap = Snapshot(step=step, position={"epoch": trainer.current_epoch, "batch_idx": batch_idx,
                                             "global_step": step},
                        state=self._full_state(trainer, live, spare), probe=probe, probe_grad_norm=probe_norm,
                        fingerprint=fingerprint)
        if self.dirpath is not None and trainer.global_rank == 0:
            self._write(snap)
        if self.keep:
            self.ring.append(snap)
        self._last_snapshot_step = step
        seconds = time.perf_counter() - t0
        log_metrics(trainer, {"stability/snapshot_step": float(step), "stability/snapshot_seconds": seconds}, step)
        return True

    def _write(self, snap: Snapshot) -> None:
        path = self.dirpath / f"snapshot-step{snap.step:08d}.pt"
        tmp = path.with_suffix(".pt.tmp")
        payload = {"step": snap.step, "position": snap.position, "state": snap.state, "probe": snap.probe,
                   "probe_grad_norm": snap.probe_grad_norm}
        torch.save(payload, tmp)
        digest = sha256_file(tmp)
        os.replace(tmp, path)
        record = {"step": snap.step, "file": path.name, "sha256": digest, "probe_grad_norm": snap.probe_grad_norm,
                  "position": snap.position}
        side = path.with_suffix(".json")
        side.with_suffix(".json.tmp").write_text(json.dumps(record, indent=1))
        os.replace(side.with_suffix(".json.tmp"), side)  # the sidecar appears last: a file without one is ignored
        snap.path, snap.sha256 = str(path), digest
        self.disk = [d for d in self.disk if d["step"] != snap.step] + [record]
        while len(self.disk) > self.keep_on_disk:
            old = self.disk.pop(0)
            for p in (self.dirpath / old["file"], (self.dirpath / old["file"]).with_suffix(".json")):
                p.unlink(missing_ok=True)

    # ---- rollback -------------------------------------------------------------------------
    def _candidates(self) -> list[tuple[str, Any]]:
        """(source, entry) newest step first; for one step, the in-memory copy before the file."""
        by_step: dict[int, list[tuple[str, Any]]] = {}
        for snap in self.ring:
            by_step.setdefault(snap.step, []).append(("memory", snap))
        # Several processes: memory only, so that every rank restores the same step (only rank 0 has the files).
        if self.dirpath is not None and (self._trainer is None or self._trainer.world_size == 1):
            for rec in self.disk:
                by_step.setdefault(rec["step"], []).append(("disk", rec))
        return [c for step in sorted(by_step, reverse=True) for c in by_step[step]]

    def _load_disk(self, rec: dict) -> Snapshot:
        path = self.dirpath / rec["file"]
        side = path.with_suffix(".json")
        if not path.exists() or not side.exists():
            raise ValueError(f"missing file {path.name} or its sidecar")
        expected = json.loads(side.read_text())["sha256"]
        actual = sha256_file(path)
        if actual != expected:
            raise ValueError(f"checksum mismatch for {path.name} (sha256 {actual[:12]}… != recorded {expected[:12]}…)")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is simply not a valid snapshot
            raise ValueError(f"unreadable {path.name}: {err}") from err
        return Snapshot(step=payload["step"], position=payload["position"], state=payload["state"],
                        probe=payload["probe"], probe_grad_norm=payload["probe_grad_norm"], path=str(path))

    def _validate(self, trainer, pl_module, snap: Snapshot, source: str) -> None:
        """State-loading validation: checksum (memory), shapes and dtypes against the live objects, finite."""
        st = snap.state
        if source == "memory" and _fingerprint(st)[0] != snap.fingerprint:
            raise ValueError("in-memory checksum mismatch")
        live = pl_module.model.state_dict()
        if set(live) != set(st["model"]):
            missing, extra = sorted(set(live) - set(st["model"])), sorted(set(st["model"]) - set(live))
            raise ValueError(f"model keys differ (missing {missing[:3]}, unexpected {extra[:3]})")
        for k, v in live.items():
            s = st["model"][k]
            if s.shape != v.shape or s.dtype != v.dtype:
                raise ValueError(f"model tensor {k}: {tuple(s.shape)}/{s.dtype} != live {tuple(v.shape)}/{v.dtype}")
        if len(st["optimizers"]) != len(trainer.optimizers):
            raise ValueError("number of optimizers differs")
        for opt, sd in zip(trainer.optimizers, st["optimizers"]):
            groups = sd["param_groups"]
            if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
                raise ValueError("optimizer parameter groups differ")
            shapes = {i: p.shape for g_live, g in zip(opt.param_groups, groups)
                      for i, p in zip(g["params"], g_live["params"])}
            for pid, pstate in sd["state"].items():
                for name, t in pstate.items():
                    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != shapes.get(pid):
                        raise ValueError(f"optimizer state {name} of parameter {pid}: {tuple(t.shape)} != "
                                         f"{tuple(shapes.get(pid, ()))}")
        for where in ("model", "optimizers"):
            for t in _tensors(st[where]):
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"non-finite values in the {where} state")

    def _load(self, trainer, pl_module, snap: Snapshot) -> None:
        st = snap.state
        pl_module.model.load_state_dict(st["model"])  # copies into the live parameters (optimizer keeps them)
        # Optimizer.load_state_dict keeps same-device tensors as they are: copy, or the live moments would
        # alias (and later overwrite) the snapshot.
        for opt, sd in zip(trainer.optimizers, st["optimizers"]):
            opt.load_state_dict(_copy_state(sd, None, None))
        for cfg, sd in zip(trainer.lr_scheduler_configs, st["schedulers"]):
            cfg.scheduler.load_state_dict(_copy_state(sd, None, None))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and st["scaler"]:
            scaler.load_state_dict(st["scaler"])
        set_rng_state(st["rng"])

    def _rollback(self, trainer, pl_module, request: StabilityEvent, batch_idx: int) -> None:
        channel = channel_of(pl_module)
        step = self._batch_step
        recent = [s for s in self.rollback_steps if s > step - self.rollback_window]
        if len(recent) >= self.max_rollbacks:
            msg = (f"{type(self).__name__}: rollback requested at step {step} for {request.kind} "
                   f"(value {request.value:.4g}), but {len(recent)} rollback(s) already happened within the last "
                   f"{self.rollback_window} steps (max_rollbacks={self.max_rollbacks}, at steps {recent}). "
                   "The instability persists after restoring snapshots: lower the learning rate, tighten the "
                   "constraint (SinkhornScheduler.intensity) or inspect the stability/events.json table.")
            channel.record(StabilityEvent(step, "rollback_limit", float(len(recent) + 1), float(self.max_rollbacks),
                                          "stop", type(self).__name__, msg), trainer)
            channel.flush(trainer)
            raise RollbackError(msg)

        rejected: list[str] = []
        for source, entry in self._candidates():
            label = f"step {entry.step if source == 'memory' else entry['step']} ({source})"
            snap, detail_check, reason = None, "", None
            try:
                snap = self._load_disk(entry) if source == "disk" else entry
                self._validate(trainer, pl_module, snap, source)
                self._load(trainer, pl_module, snap)
                if self.grad_check:
                    g = self._probe_grad_norm(trainer, pl_module, snap.probe)
                    rel = abs(g - snap.probe_grad_norm) / max(abs(snap.probe_grad_norm), 1e-12)
                    if not rel <= self.grad_check_rtol:
                        raise ValueError(f"gradient consistency check failed: probe grad norm {g:.6g} vs "
                                         f"{snap.probe_grad_norm:.6g} recorded "
                                         f"(rel {rel:.2e} > {self.grad_check_rtol:g})")
                    detail_check = f"; probe grad norm {g:.6g} vs {snap.probe_grad_norm:.6g} (rel {rel:.1e})"
            except ValueError as err:
                reason = str(err)
            # Every rank must accept the same candidate (probe batches are per rank): one refusal refuses it.
            if not trainer.strategy.reduce_boolean_decision(reason is None, all=True):
                reason = reason or "refused on another rank"
                rejected.append(f"{label}: {reason}")
                channel.record(StabilityEvent(step, "rollback_rejected", float(entry.step if source == "memory"
                                                                                else entry["step"]),
                                              float(step), "rejected", type(self).__name__, f"{label}: {reason}"),
                               trainer)
                continue
            self._after_restore(trainer, pl_module, request, snap, source, batch_idx, rejected, detail_check)
            return

        msg = (f"{type(self).__name__}: rollback requested at step {step} for {request.kind}, but no snapshot "
               f"passed validation ({'; '.join(rejected) or 'none were taken yet'}).")
        channel.record(StabilityEvent(step, "rollback_failed", float("nan"), float("nan"), "stop",
                                      type(self).__name__, msg), trainer)
        channel.flush(trainer)
        raise RollbackError(msg)

    def _after_restore(self, trainer, pl_module, request, snap, source, batch_idx, rejected, detail_check) -> None:
        step = self._batch_step
        if self.reset_optimizer:
            for opt in trainer.optimizers:
                opt.state.clear()
        self.skip_remaining = self.skip_batches
        if self.cooldown_steps:
            self.cooldown_until = step + 1 + self.cooldown_steps
            channel = channel_of(pl_module)
            if self.cooldown_sinkhorn_iters is not None:
                channel.tighten_until, channel.tighten_iters = self.cooldown_until, self.cooldown_sinkhorn_iters
        self.rollback_steps.append(step)
        pos = snap.position
        window = (f"epoch {pos['epoch']} batch {pos['batch_idx']} -> epoch {trainer.current_epoch} batch {batch_idx}"
                  f" (steps {snap.step}..{step})")
        detail = (f"after {request.kind} at step {step} (value {request.value:.4g}): restored snapshot of step "
                  f"{snap.step} from {source}{detail_check}; data window {window} not replayed"
                  + (f", next {self.skip_batches} batches skipped" if self.skip_batches else "")
                  + ("; optimizer state reset" if self.reset_optimizer else "")
                  + (f"; cool-down {self.cooldown_steps} steps at lr x{self.cooldown_lr_factor:g}"
                     + (f", Sinkhorn iters >= {self.cooldown_sinkhorn_iters}" if self.cooldown_sinkhorn_iters else "")
                     if self.cooldown_steps else "")
                  + (f"; rejected first: {'; '.join(rejected)}" if rejected else ""))
        channel_of(pl_module).record(StabilityEvent(step, "rollback", float(snap.step), float(step), "restored",
                                                    type(self).__name__, detail), trainer)
        log_metrics(trainer, {"stability/rollbacks": float(len(self.rollback_steps)),
                              "stability/rollback_to_step": float(snap.step)}, step)
        # Drop newer in-memory snapshots than the restored one: they belong to the abandoned trajectory.
        for s in [s for s in self.ring if s.step > snap.step]:
            self.ring.remove(s)

    def _direct_sinkhorn_cooldown(self, pl_module, cooling: bool) -> None:
        """Without a SinkhornScheduler, hold the iterations at the cool-down minimum, then put them back."""
        layers = [l for l in getattr(pl_module.model, "sublayers", []) if getattr(l, "mode", "") == "mhc"]
        if cooling and self._sinkhorn_saved is None:
            self._sinkhorn_saved = [l.sinkhorn_iters for l in layers]
            for l in layers:
                l.sinkhorn_iters = max(l.sinkhorn_iters, self.cooldown_sinkhorn_iters)
        elif not cooling and self._sinkhorn_saved is not None:
            for l, it in zip(layers, self._sinkhorn_saved):
                l.sinkhorn_iters = it
            self._sinkhorn_saved = None
