"""MLflow glue that Lightning lacks: logging the resolved config as a run artifact.

The stock SaveConfigCallback asserts on trainer.log_dir, which is None for sqlite:/http: tracking
URIs (Lightning issues #19441, #16310, #20273); this subclass writes the config into the run instead.
"""
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, save_to_log_dir: bool = False, **kwargs):
        super().__init__(*args, save_to_log_dir=save_to_log_dir, **kwargs)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        for lg in trainer.loggers:
            if isinstance(lg, MLFlowLogger):
                lg.experiment.log_text(lg.run_id, text, "config.yaml")
                lg.experiment.set_tag(lg.run_id, "stage", getattr(stage, "value", stage))
