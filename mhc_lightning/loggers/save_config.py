"""MLflowSaveConfig: `mhc`'s save_config_callback. The resolved config becomes the run's config.yaml artifact, the run
is tagged with its stage, and each checkpoint records the run that wrote it (CHECKPOINT_RUN_KEY), so that
`mhc validate|test` can name it wherever the file was moved to.

The stock SaveConfigCallback asserts on trainer.log_dir, which is None for sqlite:/http: tracking
URIs (Lightning issues #19441, #16310, #20273); MLflowSaveConfig writes the config into the run instead.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import SaveConfigCallback

from .credentials import mask
from .mlflow_runs import mlflow_loggers
from .tags import CHECKPOINT_RUN_KEY, STAGE_TAG


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, save_to_log_dir: bool = False, **kwargs):
        super().__init__(*args, save_to_log_dir=save_to_log_dir, **kwargs)

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
