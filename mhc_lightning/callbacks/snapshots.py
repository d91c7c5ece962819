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

Checkpoints: the callback's state (rollback history, cool-down, on-disk snapshot list, RNG) is saved in every
Lightning checkpoint. The train loader's position is not the callback's business: the datamodule's loader is
stateful, so Lightning saves and restores it (fit/resume.py).

What a snapshot holds and how it is copied: snapshot_state.py; the files on disk: snapshot_files.py.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from ..model import hyper_connections
from .divergence import TrainingDiverged
from .events import StabilityEvent, channel_of, check_choice, check_number, log_metrics
from .snapshot_files import SnapshotFiles
from .snapshot_state import Snapshot, copy_state, fingerprint, rng_state, set_rng_state, tensors


class RollbackError(TrainingDiverged):
    """Raised when a rollback cannot be served (no valid snapshot) or the rollback cap is exceeded: the run diverged."""


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
        for name, value in (("grad_check", grad_check), ("reset_optimizer", reset_optimizer)):
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

        self.ring: deque[Snapshot] = deque(maxlen=keep) if keep else deque(maxlen=1)
        self.files = SnapshotFiles(self.dirpath, keep_on_disk) if self.dirpath is not None else None
        self.rollback_steps: list[int] = []
        self.skip_remaining = 0
        self.cooldown_until = -1
        self._sinkhorn_saved: Optional[list[int]] = None  # iterations to restore after a direct cool-down
        self._last_snapshot_step: Optional[int] = None
        self._deferred = False
        self._batch_step = 0
        self._trainer = None
        self._pending_rng: Optional[dict] = None

    @property
    def state_key(self) -> str:
        return type(self).__name__

    # ---- setup / teardown -----------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.keep == 0 and trainer.world_size > 1:
            raise ValueError(
                f"{type(self).__name__}.keep must be >= 1 with several processes: only rank 0 writes "
                "snapshot files, every rank restores from its in-memory ring"
            )
        self._trainer = trainer
        channel_of(pl_module, trainer).rollback_handler = self
        if self.dirpath is not None and trainer.global_rank == 0:
            self.dirpath.mkdir(parents=True, exist_ok=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.ring.clear()  # free the copies

    # ---- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "rollback_steps": list(self.rollback_steps),
            "skip_remaining": self.skip_remaining,
            "cooldown_until": self.cooldown_until,
            "sinkhorn_saved": self._sinkhorn_saved,
            "disk": [dict(d) for d in self.files.records] if self.files else [],
            "last_snapshot_step": self._last_snapshot_step,
            "rng": rng_state(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.rollback_steps = list(state_dict["rollback_steps"])
        self.skip_remaining = state_dict["skip_remaining"]
        self.cooldown_until = state_dict["cooldown_until"]
        self._sinkhorn_saved = state_dict["sinkhorn_saved"]
        if self.files is not None:
            self.files.records = [dict(d) for d in state_dict["disk"]]
        self._last_snapshot_step = state_dict["last_snapshot_step"]
        self._pending_rng = state_dict.get("rng")

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
        return {
            "model": pl_module.model.state_dict(),
            "optimizers": [o.state_dict() for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        }

    def _full_state(self, trainer, live: dict, spare: Optional[dict] = None) -> dict:
        dev = torch.device("cpu") if self.device == "cpu" else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        state = copy_state(live, spare, dev)
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
        # Checksummed where the live state is (the device reads it far faster than one CPU thread reads the host
        # copy): the sums are exact integers, so the copy's own fingerprint is the same.
        live = self._live_state(trainer, pl_module)
        checksum, finite = fingerprint(live)
        finite = finite and math.isfinite(probe_norm)
        # Several processes: the probe batch is per rank, so decide together or the rings would differ.
        if not trainer.strategy.reduce_boolean_decision(finite, all=True):
            # Never let a non-finite state take a ring slot (it would push out a good snapshot): retry next step.
            self._deferred = True
            event = StabilityEvent(
                step,
                "snapshot_refused",
                float("nan"),
                float("nan"),
                "deferred",
                type(self).__name__,
                "state not finite at snapshot time",
            )
            channel_of(pl_module).record(event, trainer)
            return False
        # Validated: the snapshot that the ring is about to evict lends its buffers (no allocation, pinned).
        spare = self.ring.popleft().state if self.keep and len(self.ring) == self.ring.maxlen else None
        snap = Snapshot(
            step=step,
            position={"epoch": trainer.current_epoch, "batch_idx": batch_idx, "global_step": step},
            state=self._full_state(trainer, live, spare),
            probe=probe,
            probe_grad_norm=probe_norm,
            fingerprint=checksum,
        )
        if self.files is not None and trainer.global_rank == 0:
            self.files.write(snap)
        if self.keep:
            self.ring.append(snap)
        self._last_snapshot_step = step
        seconds = time.perf_counter() - t0
        log_metrics(trainer, {"stability/snapshot_step": float(step), "stability/snapshot_seconds": seconds}, step)
        return True

    # ---- rollback -------------------------------------------------------------------------
    def _candidates(self) -> list[tuple[str, Any]]:
        """(source, entry) newest step first; for one step, the in-memory copy before the file."""
        by_step: dict[int, list[tuple[str, Any]]] = {}
        for snap in self.ring:
            by_step.setdefault(snap.step, []).append(("memory", snap))
        # Several processes: memory only, so that every rank restores the same step (only rank 0 has the files).
        if self.files is not None and (self._trainer is None or self._trainer.world_size == 1):
            for rec in self.files.records:
                by_step.setdefault(rec["step"], []).append(("disk", rec))
        return [c for step in sorted(by_step, reverse=True) for c in by_step[step]]

    def _validate(self, trainer, pl_module, snap: Snapshot, source: str) -> None:
        """State-loading validation: checksum (memory), shapes and dtypes against the live objects, finite."""
        st = snap.state
        if source == "memory" and fingerprint(st)[0] != snap.fingerprint:
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
            shapes = {
                i: p.shape for g_live, g in zip(opt.param_groups, groups) for i, p in zip(g["params"], g_live["params"])
            }
            for pid, pstate in sd["state"].items():
                for name, t in pstate.items():
                    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != shapes.get(pid):
                        raise ValueError(
                            f"optimizer state {name} of parameter {pid}: {tuple(t.shape)} != "
                            f"{tuple(shapes.get(pid, ()))}"
                        )
        for where in ("model", "optimizers"):
            for t in tensors(st[where]):
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"non-finite values in the {where} state")

    def _load(self, trainer, pl_module, snap: Snapshot) -> None:
        st = snap.state
        pl_module.model.load_state_dict(st["model"])  # copies into the live parameters (optimizer keeps them)
        # Optimizer.load_state_dict keeps same-device tensors as they are: copy, or the live moments would
        # alias (and later overwrite) the snapshot.
        for opt, sd in zip(trainer.optimizers, st["optimizers"]):
            opt.load_state_dict(copy_state(sd, None, None))
        for cfg, sd in zip(trainer.lr_scheduler_configs, st["schedulers"]):
            cfg.scheduler.load_state_dict(copy_state(sd, None, None))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and st["scaler"]:
            scaler.load_state_dict(st["scaler"])
        set_rng_state(st["rng"])

    def _rollback(self, trainer, pl_module, request: StabilityEvent, batch_idx: int) -> None:
        channel = channel_of(pl_module)
        step = self._batch_step
        recent = [s for s in self.rollback_steps if s > step - self.rollback_window]
        if len(recent) >= self.max_rollbacks:
            msg = (
                f"{type(self).__name__}: rollback requested at step {step} for {request.kind} "
                f"(value {request.value:.4g}), but {len(recent)} rollback(s) already happened within the last "
                f"{self.rollback_window} steps (max_rollbacks={self.max_rollbacks}, at steps {recent}). "
                "The instability persists after restoring snapshots: lower the learning rate, tighten the "
                "constraint (SinkhornScheduler.intensity) or inspect the stability/events.json table."
            )
            channel.record(
                StabilityEvent(
                    step,
                    "rollback_limit",
                    float(len(recent) + 1),
                    float(self.max_rollbacks),
                    "stop",
                    type(self).__name__,
                    msg,
                ),
                trainer,
            )
            channel.flush(trainer)
            raise RollbackError(msg, step)

        rejected: list[str] = []
        for source, entry in self._candidates():
            label = f"step {entry.step if source == 'memory' else entry['step']} ({source})"
            snap, detail_check, reason = None, "", None
            try:
                snap = self.files.load(entry) if source == "disk" else entry
                self._validate(trainer, pl_module, snap, source)
                self._load(trainer, pl_module, snap)
                if self.grad_check:
                    g = self._probe_grad_norm(trainer, pl_module, snap.probe)
                    rel = abs(g - snap.probe_grad_norm) / max(abs(snap.probe_grad_norm), 1e-12)
                    if not rel <= self.grad_check_rtol:
                        raise ValueError(
                            f"gradient consistency check failed: probe grad norm {g:.6g} vs "
                            f"{snap.probe_grad_norm:.6g} recorded "
                            f"(rel {rel:.2e} > {self.grad_check_rtol:g})"
                        )
                    detail_check = f"; probe grad norm {g:.6g} vs {snap.probe_grad_norm:.6g} (rel {rel:.1e})"
            except ValueError as err:
                reason = str(err)
            # Every rank must accept the same candidate (probe batches are per rank): one refusal refuses it.
            if not trainer.strategy.reduce_boolean_decision(reason is None, all=True):
                reason = reason or "refused on another rank"
                rejected.append(f"{label}: {reason}")
                channel.record(
                    StabilityEvent(
                        step,
                        "rollback_rejected",
                        float(entry.step if source == "memory" else entry["step"]),
                        float(step),
                        "rejected",
                        type(self).__name__,
                        f"{label}: {reason}",
                    ),
                    trainer,
                )
                continue
            self._after_restore(trainer, pl_module, request, snap, source, batch_idx, rejected, detail_check)
            return

        msg = (
            f"{type(self).__name__}: rollback requested at step {step} for {request.kind}, but no snapshot "
            f"passed validation ({'; '.join(rejected) or 'none were taken yet'})."
        )
        channel.record(
            StabilityEvent(step, "rollback_failed", float("nan"), float("nan"), "stop", type(self).__name__, msg),
            trainer,
        )
        channel.flush(trainer)
        raise RollbackError(msg, step)

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
        window = (
            f"epoch {pos['epoch']} batch {pos['batch_idx']} -> epoch {trainer.current_epoch} batch {batch_idx}"
            f" (steps {snap.step}..{step})"
        )
        detail = (
            f"after {request.kind} at step {step} (value {request.value:.4g}): restored snapshot of step "
            f"{snap.step} from {source}{detail_check}; data window {window} not replayed"
            + (f", next {self.skip_batches} batches skipped" if self.skip_batches else "")
            + ("; optimizer state reset" if self.reset_optimizer else "")
            + (
                f"; cool-down {self.cooldown_steps} steps at lr x{self.cooldown_lr_factor:g}"
                + (f", Sinkhorn iters >= {self.cooldown_sinkhorn_iters}" if self.cooldown_sinkhorn_iters else "")
                if self.cooldown_steps
                else ""
            )
            + (f"; rejected first: {'; '.join(rejected)}" if rejected else "")
        )
        channel_of(pl_module).record(
            StabilityEvent(step, "rollback", float(snap.step), float(step), "restored", type(self).__name__, detail),
            trainer,
        )
        log_metrics(
            trainer,
            {"stability/rollbacks": float(len(self.rollback_steps)), "stability/rollback_to_step": float(snap.step)},
            step,
        )
        # Drop newer in-memory snapshots than the restored one: they belong to the abandoned trajectory.
        for s in [s for s in self.ring if s.step > snap.step]:
            self.ring.remove(s)

    def _direct_sinkhorn_cooldown(self, pl_module, cooling: bool) -> None:
        """Without a SinkhornScheduler, hold the iterations at the cool-down minimum, then put them back."""
        layers = [l for l in hyper_connections(pl_module.model) if l.spec.sinkhorn]
        if cooling and self._sinkhorn_saved is None:
            self._sinkhorn_saved = [l.sinkhorn_iters for l in layers]
            for l in layers:
                l.sinkhorn_iters = max(l.sinkhorn_iters, self.cooldown_sinkhorn_iters)
        elif not cooling and self._sinkhorn_saved is not None:
            for l, it in zip(layers, self._sinkhorn_saved):
                l.sinkhorn_iters = it
            self._sinkhorn_saved = None
