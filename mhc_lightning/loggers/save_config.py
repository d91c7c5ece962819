"""MLflowSaveConfig: `mhc`'s save_config_callback. The resolved config becomes the run's config.yaml artifact, the run
is tagged with its stage, and each checkpoint records the run that wrote it (CHECKPOINT_RUN_KEY), so that
`mhc validate|test` can name it wherever the file was moved to.

The stock SaveConfigCallback asserts on trainer.log_dir, which is None for sqlite:/http: tracking
URIs (Lightning issues #19441, #16310, #20273); MLflowSaveConfig writes the config into the run instead.
With any other logger (CSVLogger, TensorBoardLogger, WandbLogger, ...) Lightning's own behaviour applies: config.yaml
in the trainer's log_dir (a CSV or TensorBoard logger's version folder; a W&B logger's save_dir).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

from .credentials import mask
from .mlflow_runs import mlflow_loggers
from .tags import CHECKPOINT_RUN_KEY, STAGE_TAG


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, save_to_log_dir: Optional[bool] = None, **kwargs):
        """save_to_log_dir None: Lightning's config.yaml in the log_dir when the first logger is not an MLflow one
        (an MLflow logger's log_dir is None for sqlite: and http: stores), besides the MLflow artifact."""
        super().__init__(*args, save_to_log_dir=bool(save_to_log_dir), **kwargs)
        self._log_dir_auto = save_to_log_dir is None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._log_dir_auto:
            self.save_to_log_dir = bool(trainer.loggers) and not isinstance(trainer.loggers[0], MLFlowLogger)
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        # keep null values: the config as it ran; a password in a URL (a database store) masked (credentials.py)
        text = mask(self.parser.dump(self.config, skip_unset=False))
        for lg in mlflow_loggers(trainer):
            lg.experiment.log_text(lg.run_id, text, "config.yaml")
            lg.experiment.set_tag(lg.run_id, STAGE_TAG, getattr(stage, "value", stage))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # So that `mhc validate/test` can tag its run with the run this checkpoint came from, wherever the file
        # was moved to. Plain strings: Lightning reads checkpoints with weights_only=True.
        for lg in mlflow_loggers(trainer)[:1]:
            checkpoint[CHECKPOINT_RUN_KEY] = {"run_id": str(lg.run_id), "experiment_id": str(lg.experiment_id)}
