"""The child's side of a subprocess trial (`trial.launcher: subprocess`): a callback that links a child `mhc fit`,
and every DDP rank Lightning starts from it, to the sweep's Optuna trial.

- Every rank records the objective metrics (MetricRecorder, as in-process) and takes part in StepPruning's
  broadcast of the prune decision, so all ranks stop at the same step.
- Only rank 0 opens the study's storage (URL from the environment: it may hold a password), reports the monitored
  value at each validation (with or without a pruner) and asks should_prune; at the end of fit it writes the
  recorded history, the prune step and the logged metric names to `result_path`, where the sweep worker reduces
  them as for an in-process trial.
- MLflow is written by rank 0 only, by the trial's logger (Lightning's rank-zero logging), into the trial's run.
- Every rank dies with its parent process (`mhc` calls child_processes.die_with_parent first thing), so that a sweep
  worker killed with SIGKILL leaves no rank behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from .factories import build_pruner, make_storage
from .objective import STORAGE_ENV
from .pruning import StepPruning
from .recorder import MetricRecorder


def open_trial(study_name: str, trial_number: int, pruner: dict[str, Any]):
    """The running trial, from the storage the worker shares with us (reports and should_prune go through it)."""
    import optuna

    url = os.environ.get(STORAGE_ENV)
    if not url:
        raise RuntimeError(f"TrialLink needs ${STORAGE_ENV}, which the sweep worker sets: it is for `mhc sweep` trials")
    storage = make_storage(url, {})  # no heartbeat: the worker beats for this trial
    # RandomSampler: the trial's parameters are already sampled; opening it must not run a costly sampler
    study = optuna.load_study(
        study_name=study_name, storage=storage, pruner=build_pruner(pruner), sampler=optuna.samplers.RandomSampler()
    )
    # the storage interface (a public class) maps the study's trial number to the id a Trial is opened with
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), trial_number)
    return optuna.trial.Trial(study, trial_id)


class TrialLink(MetricRecorder):
    """Added by the sweep worker to the child's `mhc fit` (`--trainer.callbacks+=`); not for configs.

    Args:
        result_path: where rank 0 writes {"history", "missing", "pruned_at", "logged"} at the end of fit.
        metrics: the objective metrics to record.
        study_name, trial_number, monitor, pruner: for intermediate values and pruning (all or none; every
            single-objective study): the trial, the metric to report, the spec's pruner block ({name, options}).
    """

    def __init__(
        self,
        result_path: str,
        metrics: list[str],
        study_name: Optional[str] = None,
        trial_number: Optional[int] = None,
        monitor: Optional[str] = None,
        pruner: Optional[dict] = None,
    ):
        super().__init__(metrics)
        self.result_path = Path(result_path)
        self.study_name, self.trial_number, self.pruner = study_name, trial_number, pruner
        self.pruning = StepPruning(None, monitor) if monitor else None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.pruning is not None and self.pruning.trial is None and trainer.global_rank == 0:
            self.pruning.trial = open_trial(self.study_name, self.trial_number, self.pruner)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)  # record first, then report: the in-process order
        if self.pruning is not None:
            self.pruning.on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.global_rank != 0:
            return
        out = {
            "history": self.history,
            "missing": self.missing,
            "pruned_at": self.pruning.pruned_at if self.pruning else None,
            "logged": sorted(trainer.callback_metrics),
        }
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        tmp.replace(self.result_path)  # the worker never reads half a file
