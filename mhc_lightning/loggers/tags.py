"""Names that `mhc` writes into MLflow runs and checkpoints and reads back (`mhc compare`, `--ckpt_path last`,
`mhc validate|test`). Plain constants: launchers and reports import them without Lightning."""

STAGE_TAG = "stage"  # fit / validate / test: `mhc compare` keeps evaluation runs apart from training runs by it
SOURCE_RUN_TAG = "mhc.source_run_id"  # on an evaluation run: the MLflow run that wrote the checkpoint
CHECKPOINT_TAG = "mhc.checkpoint"  # on an evaluation run: the checkpoint file it evaluated
CHECKPOINT_RUN_KEY = "mlflow_run"  # in a checkpoint: {"run_id", "experiment_id"} of the run that saved it
