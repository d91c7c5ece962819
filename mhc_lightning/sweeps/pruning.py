"""Optuna intermediate values and pruning on the optimizer step.

Every single-objective trial reports its monitored metric at each validation, with or without a pruner, so that
optuna-dashboard draws its learning curve (without a pruner the study's NopPruner never prunes; Optuna takes no
intermediate values in multi-objective studies, which cannot be pruned either).

optuna_integration's PyTorchLightningPruningCallback reports `step=current_epoch`, so with several
validations per epoch (or one long epoch, as here) only the first report counts. This one reports
`trainer.global_step` at every validation and stops the trainer cleanly; the objective raises
TrialPruned after fit returns, so loggers close normally instead of ending the run FAILED.

Under DDP only rank 0 talks to Optuna (other ranks may hold no trial at all); its decision is broadcast
so that every rank stops at the same step, instead of rank 0 leaving the others waiting in a collective.
"""

from __future__ import annotations

import math
from typing import Optional

from lightning.pytorch.callbacks import Callback


class StepPruning(Callback):
    def __init__(self, trial, monitor: str = "val/loss"):
        self.trial, self.monitor = trial, monitor
        self.pruned_at: Optional[int] = None
        self.reported: list[tuple[int, float]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:  # the same on every rank, so the broadcast below is reached by all or none
            return
        prune_at = self._report(trainer) if trainer.global_rank == 0 else None
        prune_at = trainer.strategy.broadcast(prune_at, src=0)
        if prune_at is not None:
            self.pruned_at = prune_at
            trainer.should_stop = True

    def _report(self, trainer) -> Optional[int]:
        """Rank 0: report the monitored value; the step if Optuna says prune."""
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return None
        v, step = float(value), trainer.global_step
        self.trial.report(v if math.isfinite(v) else float("nan"), step=step)
        self.reported.append((step, v))
        return step if self.trial.should_prune() else None
