"""ResilientMLFlowLogger: Lightning's MLFlowLogger with the platform's policies (docs/stability.md, "Tracking
server and resume"). Every shipped config uses it.

- Start: an unreachable tracking store stops `mhc fit` within seconds with one line naming the URI (a UserError),
  before any run, folder or checkpoint exists. A run that starts with the server away would only fill a spool that
  nobody is told about; a typo in the URI is the usual cause.
- During the run: a write that fails because the server went away, or the SQLite store is locked, full or read-only,
  is kept in a spool on local disk (spool.py) and sent when the store takes writes again, so an outage never stops or
  stalls training (one line says it began; MLflow's traceback per failed write is not shown); what is left at the end
  waits for `mhc sweep replay`, and the end of the command says so in one line (`pending_note`): the run shows RUNNING
  in the store until then.
- Resume (`mhc fit ... --ckpt_path last`, see fit/resume.py): the same MLflow run continues; metric steps it already
  holds are not logged a second time (steps between the checkpoint and the kill keep the first attempt's values,
  which an exact resume reproduces anyway).
- Checkpoints, one copy: with `log_model: false` (every shipped config) they stay in the run's local folder
  (`trainer.default_root_dir`/<experiment id>/<run id>/checkpoints); with `log_model: true` they are uploaded as run
  artifacts at the end of a successful fit and the local files are removed once the upload went through.
- Experiments it creates open in the MLflow UI's training-runs view (store.py).
- Params carry the names `mhc fit` takes (`model.arch.hyper.residual_mode`, `data.corpus`; param_names.py), without
  LightningCLI's internals.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from .param_names import cli_params
from .spool import GuardedClient
from .store import (
    TrackingUnreachable,
    check_tracking,
    ensure_experiment,
    is_outage,
    outage_reason,
    probe_database,
    quiet_store_errors,
    redact,
    store_lock,
    unopenable,
    use_fast_http_failures,
)

_STATUS = {"success": "FINISHED", "failed": "FAILED", "finished": "FINISHED"}


class ResilientMLFlowLogger(MLFlowLogger):
    """MLFlowLogger that checks the store at start, spools writes through an outage, resumes runs without duplicate
    metric steps and keeps one copy of each checkpoint (see the module docstring).

    Args (besides MLFlowLogger's):
        spool_dir: where failed writes wait (default ./mlflow_spool).
        retry_every: seconds between retries while the server is down (doubling up to 10 min).
        flush_timeout: seconds to keep retrying at the end of fit before leaving the rest for `mhc sweep replay`.
    """

    def __init__(
        self,
        *args: Any,
        spool_dir: str = "mlflow_spool",
        retry_every: float = 30.0,
        flush_timeout: float = 30.0,
        **kwargs: Any,
    ):
        use_fast_http_failures()
        quiet_store_errors()
        given = inspect.signature(MLFlowLogger).bind_partial(*args, **kwargs).arguments
        uri = given.get("tracking_uri", os.getenv("MLFLOW_TRACKING_URI"))
        probe_database(uri)  # in seconds, not after MLflow's retries
        try:
            with store_lock(uri):
                super().__init__(*args, **kwargs)  # its MlflowClient opens (and migrates a new) store right away
        except Exception as err:  # one line, the URI masked, instead of a traceback that quotes it
            raise unopenable(uri, err) from None
        self._spool_dir, self._flush_timeout = spool_dir, flush_timeout
        self._started = False
        self._logged_up_to: dict[str, int] = {}  # resumed run: last step already logged, per metric
        self._checkpoint_callbacks: list = []
        self.pending_note = ""  # set at the end when writes are left in the spool (the CLI prints it last)
        # Lightning's logger has no way to hand it a client: route its own client through the guard, so that every
        # write Lightning makes (metrics, params, artifacts, the final status) is kept when the server is down.
        self._guard = GuardedClient(self._mlflow_client, spool_dir, retry_every, f" at {redact(self._tracking_uri)}")
        self._mlflow_client = self._guard

    @property
    @rank_zero_experiment
    def experiment(self):
        if not self._started:
            self._start()
        return self._guard

    def _start(self) -> None:
        check_tracking(self._tracking_uri)  # one clear line when the store is not there
        try:
            if self._run_id is None and self._experiment_id is None:
                self._experiment_id = ensure_experiment(self._guard, self._experiment_name)
            MLFlowLogger.experiment.fget(self)  # Lightning creates (or opens) the run
        except TrackingUnreachable:
            raise
        except Exception as err:
            if is_outage(err):
                raise TrackingUnreachable(
                    f"MLflow tracking store {redact(self._tracking_uri)} stopped answering "
                    f"while the run was created ({outage_reason(err)}); start the run again "
                    "once it is back"
                ) from None
            raise
        self._started = True
        run = self._guard.get_run(self.run_id)
        if run.data.metrics:  # an existing run continues: remember what it holds
            self._logged_up_to = {
                k: max(m.step for m in self._guard.get_metric_history(self.run_id, k)) for k in run.data.metrics
            }
        if run.info.status != "RUNNING":
            self._guard.update_run(self.run_id, status="RUNNING")

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        super().log_hyperparams(cli_params(params))

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        if self._logged_up_to and step is not None:
            metrics = {k: v for k, v in metrics.items() if step > self._logged_up_to.get(k, -1)}
        if metrics:
            super().log_metrics(metrics, step)

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        if checkpoint_callback not in self._checkpoint_callbacks:
            self._checkpoint_callbacks.append(checkpoint_callback)
        super().after_save_checkpoint(checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._started:
            return
        try:
            super().finalize(status)  # uploads checkpoints (log_model) and ends the run; writes go through the guard
        except Exception as err:
            if not is_outage(err):
                raise
            self._guard.set_terminated(self.run_id, _STATUS.get(status, status))  # kept in the spool
        sent = self._guard.drain(self._flush_timeout)
        self.pending_note = self._guard.pending_note(self._tracking_uri)
        if self.pending_note and status != "success":  # no closing announcement follows (mlflow_runs.announce_run)
            print(f"mhc: {self.pending_note}", file=sys.stderr, flush=True)
        if self._log_model and status == "success" and sent:
            self._remove_uploaded_checkpoints()

    def _remove_uploaded_checkpoints(self) -> None:
        """One copy: the checkpoints now live in the run's artifacts (`<name>/<name>.ckpt`)."""
        for cb in self._checkpoint_callbacks:
            paths = {cb.best_model_path, cb.last_model_path, *getattr(cb, "best_k_models", {})} - {"", None}
            for p in map(Path, paths):
                p.unlink(missing_ok=True)
            folder = Path(cb.dirpath) if cb.dirpath else None
            if folder is not None and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if self._checkpoint_callbacks:
            rank_zero_info(
                f"checkpoints uploaded to MLflow run {self.run_id} (artifacts last/, ...) and removed "
                "locally (log_model: true keeps one copy, in MLflow)"
            )
