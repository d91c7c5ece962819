"""SystemMetrics: MLflow's own system metrics (CPU, memory, disk, network; GPU utilisation, memory and power through
NVML where `nvidia-ml-py` is installed: the `gpu` extra) in the fit's MLflow run, as `system/*`.

`mlflow.enable_system_metrics_logging()` only reaches runs started by `mlflow.start_run`; Lightning's MLFlowLogger
creates its run through MlflowClient, so the monitor is started here, on rank 0, for the logger's run id, and
stopped when the fit ends (or fails). MLflow's environment variables set its cadence:
MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL (seconds, default 10) and MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING.
A resumed run (`--ckpt_path last`) continues its system-metric steps. Only MLflow loggers get these metrics.
"""

from __future__ import annotations

import logging

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from ..loggers.mlflow_runs import mlflow_loggers
from ..loggers.store import outage_reason


class SystemMetrics(Callback):
    def __init__(self, sampling_interval: float = 10.0, samples_before_logging: int = 1):
        self.sampling_interval, self.samples_before_logging = sampling_interval, samples_before_logging
        self._monitors: list = []

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no "started / stopped" lines
        for lg in mlflow_loggers(trainer):
            monitor = SystemMetricsMonitor(
                lg.run_id,
                sampling_interval=self.sampling_interval,
                samples_before_logging=self.samples_before_logging,
                resume_logging=True,
                tracking_uri=lg.experiment.tracking_uri,
            )
            monitor.start()
            self._monitors.append(monitor)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        for monitor in self._monitors:
            monitor.finish()
            # The monitor publishes once per interval; what it sampled since (all of a fit shorter than one
            # interval: it samples once at start) would be dropped at finish, so it goes out as a last step.
            last = monitor.aggregate_metrics()
            try:
                if last:
                    monitor.publish_metrics(last)
                    monitor.mlflow_logger.flush()
            except Exception as err:  # best effort, as MLflow's own monitor: a server away must not fail the fit
                rank_zero_warn(f"last system metrics not sent to MLflow ({outage_reason(err)})")
        self._monitors = []
