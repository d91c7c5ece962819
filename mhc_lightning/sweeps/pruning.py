"""Optuna pruning on the optimizer step.

optuna_integration's PyTorchLightningPruningCallback reports `step=current_epoch`, so with several
validations per epoch (or one long epoch, as here) only the first report counts. This one reports
`trainer.global_step` at every validation and stops the trainer cleanly; the objective raises
TrialPruned after fit returns, so loggers close normally instead of ending the run FAILED.
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
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        v, step = float(value), trainer.global_step
        self.trial.report(v if math.isfinite(v) else float("nan"), step=step)
        self.reported.append((step, v))
        if self.trial.should_prune():
            self.pruned_at = step
            trainer.should_stop = True
