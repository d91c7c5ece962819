"""DivergenceGuard: end a fit whose training loss is no longer finite, whatever the config (fit/cli.py installs it).

When it looks: the loss is read back at the steps where Lightning's loggers read the logged values anyway (every
`trainer.log_every_n_steps`-th optimizer step) and at each validation, where the host waits for the device in any
case: no other step waits for the GPU, and a non-finite loss is seen at most `log_every_n_steps` steps late.

What counts: a non-finite loss whose update went through (the weights are then lost) ends the fit at once. One whose
update was skipped (a GradScaler's overflow skip under 16-mixed, an InstabilityDetector's skip or rollback) ends it
only when the loss is still not finite at `PATIENCE` consecutive checks: the skips are not helping.

How it ends: `TrainingDiverged` (RollbackError, the snapshots' last resort, is one too). Lightning marks the MLflow runs
FAILED; this callback tags them `mhc.diverged=true` and `mhc.diverged_step=<step>` first; `mhc fit` prints one line
(the step, the runs, what to try) and exits with EXIT_DIVERGED.
"""

from __future__ import annotations

import math
from typing import Optional

from lightning.pytorch.callbacks import Callback

from ..loggers.mlflow_runs import mlflow_loggers

EXIT_DIVERGED = 3  # not 1 (a crash) nor 2 (bad input): scripts and sweeps can tell a diverged run apart
DIVERGED_TAG, DIVERGED_STEP_TAG = "mhc.diverged", "mhc.diverged_step"
PATIENCE = 3  # consecutive non-finite checks, when the updates in between were skipped
_VETOED = {"nonfinite_loss", "nonfinite_grad", "nonfinite_param"}  # detector events whose skip covers a NaN loss


class TrainingDiverged(RuntimeError):
    """The loss (or the weights) stopped being finite and the fit cannot usefully go on. `step` is the optimizer step
    (0-based, as the stability events count); `runs` and `hint` are filled in by DivergenceGuard."""

    def __init__(self, reason: str, step: Optional[int] = None):
        super().__init__(reason)
        self.reason, self.step = reason, step
        self.runs: list[str] = []
        self.hint = ""
        self.announce = True  # False on the other ranks of a multi-process fit: rank 0 says it

    def __str__(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        runs = f"; MLflow run {', '.join(self.runs)} marked FAILED ({DIVERGED_TAG}=true)" if self.runs else ""
        return f"training diverged{where}: {self.reason}{runs}. {self.hint}".strip()


class DivergenceGuard(Callback):
    """See the module docstring."""

    def __init__(self):
        self._checked = -1  # the last global_step checked
        self._streak = 0  # consecutive checks with a non-finite loss

    def on_train_start(self, trainer, pl_module) -> None:
        self._checked, self._streak = -1, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = trainer.log_every_n_steps
        if n > 0 and trainer.global_step % n == 0:
            self._check(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._check(trainer, pl_module)

    def _check(self, trainer, pl_module) -> None:
        loss = getattr(pl_module, "last_loss", None)
        if trainer.global_step == self._checked or loss is None:
            return
        self._checked = step = trainer.global_step
        value = float(loss)  # the one read-back, at a step where the loggers read theirs
        finite = math.isfinite(value)
        if trainer.world_size > 1:  # every rank decides alike, or the others would wait for it forever
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if finite:
            self._streak = 0
            return
        self._streak += 1
        step -= 1  # the step whose loss this is (global_step has counted its update already)
        skipped = self._skipped(trainer, pl_module, step)
        if skipped and self._streak < PATIENCE:
            return
        why = (
            f"the training loss is still not finite ({value}) after {self._streak} checks of skipped updates"
            if skipped
            else f"the training loss is {value} and the update of that step was applied"
        )
        raise TrainingDiverged(why, step)

    @staticmethod
    def _skipped(trainer, pl_module, step: int) -> bool:
        """Whether the update of `step` was skipped rather than applied with non-finite gradients."""
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return True  # the GradScaler skips every update with non-finite gradients
        channel = getattr(pl_module, "stability_channel", None)
        for e in reversed(channel.events if channel is not None else []):
            if e.step < step:
                break
            if e.step == step and e.kind in _VETOED and e.action in ("skip", "rollback"):
                return True
        return False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, TrainingDiverged):
            return
        exception.announce = trainer.is_global_zero
        lr = getattr(getattr(pl_module, "optim", None), "lr", None)
        lower = f"Try a lower model.optim.lr (now {lr:g})" if lr is not None else "Try a lower learning rate"
        stability = any(type(cb).__name__ == "InstabilityDetector" for cb in trainer.callbacks)
        exception.hint = (
            f"{lower}, or tighter settings of conf/presets/stability.yaml (docs/stability.md)."
            if stability
            else f"{lower}, or add -c conf/presets/stability.yaml (skips and rolls back bad steps)."
        )
        if not trainer.is_global_zero:
            return
        for lg in mlflow_loggers(trainer):
            if getattr(lg, "_run_id", None) is None:  # no run yet (reading run_id would create one)
                continue
            tags = {DIVERGED_TAG: "true"}
            if exception.step is not None:
                tags[DIVERGED_STEP_TAG] = str(exception.step)
            for key, value in tags.items():
                lg.experiment.set_tag(lg.run_id, key, value)
            exception.runs.append(lg.run_id)
