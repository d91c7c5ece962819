"""MLflow glue that Lightning lacks: the resolved config as a run artifact, stage tags and run names,
the producing run recorded in each checkpoint, and how to open a run.

The stock SaveConfigCallback asserts on trainer.log_dir, which is None for sqlite:/http: tracking
URIs (Lightning issues #19441, #16310, #20273); MLflowSaveConfig writes the config into the run instead.
"""
from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

STAGE_TAG = "stage"  # fit / validate / test: `mhc compare` keeps evaluation runs apart from training runs by it
SOURCE_RUN_TAG = "mhc.source_run_id"  # on an evaluation run: the MLflow run that wrote the checkpoint
CHECKPOINT_TAG = "mhc.checkpoint"  # on an evaluation run: the checkpoint file it evaluated
CHECKPOINT_RUN_KEY = "mlflow_run"  # in a checkpoint: {"run_id", "experiment_id"} of the run that saved it


def mlflow_loggers(trainer) -> list[MLFlowLogger]:
    return [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, save_to_log_dir: bool = False, **kwargs):
        super().__init__(*args, save_to_log_dir=save_to_log_dir, **kwargs)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        for lg in mlflow_loggers(trainer):
            lg.experiment.log_text(lg.run_id, text, "config.yaml")
            lg.experiment.set_tag(lg.run_id, STAGE_TAG, getattr(stage, "value", stage))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # So that `mhc validate/test` can tag its run with the run this checkpoint came from, wherever the file
        # was moved to. Plain strings: Lightning reads checkpoints with weights_only=True.
        for lg in mlflow_loggers(trainer)[:1]:
            checkpoint[CHECKPOINT_RUN_KEY] = {"run_id": str(lg.run_id), "experiment_id": str(lg.experiment_id)}


def _class_of(class_path: str) -> Optional[type]:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def label_runs(logger_cfg, stage: str, source_run_id: Optional[str] = None,
               checkpoint: Optional[str] = None) -> None:
    """Name and tag, in the parsed logger config (before the loggers exist), the MLflow run(s) `stage` creates.

    Every run is tagged `stage`; an evaluation run is named `<run name>-<stage>` and tagged with the
    checkpoint it evaluates and, when known, the run that wrote it. A logger resuming a given run_id is
    left as it is.
    """
    configs = logger_cfg if isinstance(logger_cfg, list) else [logger_cfg]
    for cfg in configs:
        if not hasattr(cfg, "class_path") or cfg.get("init_args") is None:
            continue
        cls = _class_of(cfg.class_path)
        init = cfg.init_args
        if not (isinstance(cls, type) and issubclass(cls, MLFlowLogger)) or init.get("run_id"):
            continue
        tags = dict(init.get("tags") or {})
        tags[STAGE_TAG] = stage
        if stage != "fit":
            init.run_name = f"{init.get('run_name') or 'mhc'}-{stage}"
            if checkpoint:
                tags[CHECKPOINT_TAG] = str(checkpoint)
            if source_run_id:
                tags[SOURCE_RUN_TAG] = source_run_id
        init.tags = tags


def mlflow_command() -> str:
    """How to start MLflow's CLI from this interpreter, whether or not its venv is activated."""
    exe = Path(sys.executable).with_name("mlflow")
    return shlex.quote(str(exe)) if exe.is_file() else f"{shlex.quote(sys.executable)} -m mlflow"


def absolute_store_uri(uri: str) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db, so that a printed command works from any folder."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/") and ":memory:" not in uri:
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def ui_hint(uri: str) -> str:
    """The command that opens a local store in the MLflow UI."""
    return f"{mlflow_command()} ui --backend-store-uri {shlex.quote(absolute_store_uri(uri))}"


def announce_run(trainer, stage: str) -> None:
    """Tell the user where the run went, its final metrics, and how to look at it.

    Reads only what the logger holds locally: no request to a tracking server that may be down by now.
    """
    if trainer.global_rank != 0:
        return
    prefixes = ("val/", "train/loss") if stage == "fit" else (f"{stage}/",)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefixes)}
    for lg in mlflow_loggers(trainer):
        uri = lg.experiment.tracking_uri
        print(f"\nMLflow run {lg.run_id} (experiment id {lg.experiment_id}) at {absolute_store_uri(uri)}")
        print("final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
        page = f"#/experiments/{lg.experiment_id}/runs/{lg.run_id}"
        if is_server(uri):
            print(f"view it:  {uri.rstrip('/')}/{page}")
        else:
            print(f"view it:  {ui_hint(uri)}   (then open http://127.0.0.1:5000/{page})")
