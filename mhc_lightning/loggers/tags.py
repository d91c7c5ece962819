"""Names that `mhc` writes into MLflow runs and checkpoints and reads back (`mhc compare`, `--ckpt_path last`,
`mhc validate|test`). Plain constants: launchers and reports import them without Lightning."""

STAGE_TAG = "stage"  # fit / validate / test: `mhc compare` keeps evaluation runs apart from training runs by it
SOURCE_RUN_TAG = "mhc.source_run_id"  # on an evaluation run: the MLflow run that wrote the checkpoint
CHECKPOINT_TAG = "mhc.checkpoint"  # on an evaluation run: the checkpoint file it evaluated
CHECKPOINT_RUN_KEY = "mlflow_run"  # in a checkpoint: {"run_id", "experiment_id"} of the run that saved it
# the digests of the data a fit trained and validated on; a run resumed on other data (`--data_changed`) keeps each
# digest it ran on, comma-separated in order (callbacks/run_provenance.py), the last one the data of its last part
DATA_TAGS = {"train": "mhc.data.train_sha256", "val": "mhc.data.val_sha256"}
# on a fit run as a SLURM job: its job id; the job, requeued, continues the run that carries its id (resume.py)
SLURM_JOB_TAG = "mhc.slurm.job_id"
