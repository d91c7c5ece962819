"""ResilientMLFlowLogger: Lightning's MLFlowLogger, but a tracking-server outage mid-run does not stop training.

Writes that fail because the server is unreachable wait in a spool on local disk and are retried; what
is still waiting at the end of fit can be sent later with `mhc sweep replay` (see tracking.py). Usable in
any config:  trainer.logger.class_path: mhc_lightning.sweeps.logger.ResilientMLFlowLogger
"""
from __future__ import annotations

from typing import Optional

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from .tracking import GuardedClient, TrackingUnreachable, is_outage, redact, use_fast_http_failures


class ResilientMLFlowLogger(MLFlowLogger):
    """MLFlowLogger that keeps training when the tracking server goes away mid-run (see the module doc).

    spool_dir: where failed writes wait (default ./mlflow_spool); retry_every: seconds between retries
    while the server is down; flush_timeout: seconds to keep retrying at the end of fit.
    """

    def __init__(self, *args, spool_dir: str = "mlflow_spool", retry_every: float = 30.0,
                 flush_timeout: float = 30.0, **kwargs):
        use_fast_http_failures()
        super().__init__(*args, **kwargs)
        self._spool_dir = spool_dir
        self._retry_every = retry_every
        self._flush_timeout = flush_timeout
        self._guard: Optional[GuardedClient] = None

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._guard is None:
            try:
                MLFlowLogger.experiment.fget(self)
            except Exception as err:
                if is_outage(err):
                    raise TrackingUnreachable(
                        f"MLflow tracking server {redact(self._tracking_uri)} is unreachable at the start of the run: {err}"
                    ) from err
                raise
            self._guard = GuardedClient(self._mlflow_client, self._spool_dir, self._retry_every,
                                        f" at {redact(self._tracking_uri)}")
        return self._guard

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._initialized:
            return
        status = {"success": "FINISHED", "failed": "FAILED", "finished": "FINISHED"}.get(status, status)
        if self._checkpoint_callback:
            self._scan_and_log_checkpoints(self._checkpoint_callback)
        self.experiment.set_terminated(self.run_id, status)
        self._guard.drain(self._flush_timeout, self._tracking_uri)
