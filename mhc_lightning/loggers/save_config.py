"""MLflowSaveConfig: `mhc`'s save_config_callback. The resolved config becomes the run's config.yaml artifact, the run
is tagged with its stage, and each checkpoint records the run that wrote it (CHECKPOINT_RUN_KEY), so that
`mhc validate|test` can name it wherever the file was moved to.

The stock SaveConfigCallback asserts on trainer.log_dir, which is None for sqlite:/http: tracking
URIs (Lightning issues #19441, #16310, #20273); MLflowSaveConfig writes the config into the run instead.
With any other logger (CSVLogger, TensorBoardLogger, WandbLogger, ...) config.yaml goes into the run's own folder,
<save_dir>/<name>/<version>, where its checkpoints go: a CSV or TensorBoard logger's version folder, a W&B run's
folder. Lightning's stock callback writes it to trainer.log_dir, which for W&B is the save_dir every run shares: a
second fit there would stop with a traceback after creating its W&B run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

from .credentials import mask
from .mlflow_runs import mlflow_loggers
from .tags import CHECKPOINT_RUN_KEY, STAGE_TAG


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, save_to_log_dir: Optional[bool] = None, **kwargs):
        """save_to_log_dir None: config.yaml in the run's folder when the first logger is not an MLflow one (an MLflow
        logger's log_dir is None for sqlite: and http: stores), besides the MLflow artifact; False: never."""
        super().__init__(*args, save_to_log_dir=False, **kwargs)  # the run folder is written by save_config
        self._to_run_folder = save_to_log_dir is not False

    def save_config(self, trainer, pl_module, stage: str) -> None:
        # keep null values: the config as it ran; a password in a URL (a database store) masked (credentials.py)
        text = mask(self.parser.dump(self.config, skip_unset=False))
        if self._to_run_folder and trainer.loggers and not isinstance(trainer.loggers[0], MLFlowLogger):
            folder = run_folder(trainer)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / self.config_filename).write_text(text)
        for lg in mlflow_loggers(trainer):
            lg.experiment.log_text(lg.run_id, text, "config.yaml")
            lg.experiment.set_tag(lg.run_id, STAGE_TAG, getattr(stage, "value", stage))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # So that `mhc validate/test` can tag its run with the run this checkpoint came from, wherever the file
        # was moved to. Plain strings: Lightning reads checkpoints with weights_only=True.
        for lg in mlflow_loggers(trainer)[:1]:
            checkpoint[CHECKPOINT_RUN_KEY] = {"run_id": str(lg.run_id), "experiment_id": str(lg.experiment_id)}


def run_folder(trainer) -> Path:
    """The first logger's run folder, as ModelCheckpoint resolves it (its checkpoints/ lies inside)."""
    lg = trainer.loggers[0]
    version = lg.version if isinstance(lg.version, str) else f"version_{lg.version}"
    return Path(lg.save_dir or trainer.default_root_dir, str(lg.name), version)
