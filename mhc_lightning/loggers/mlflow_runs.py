"""The MLflow runs of `mhc fit|validate|test` as Lightning meets them: the trainer's MLflow loggers, the logger
configs that will create them (named and tagged by stage before they exist), and where a finished run went.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from lightning.pytorch.loggers import MLFlowLogger

from .credentials import mask
from .store import absolute_store_uri, is_server, ui_hint
from .tags import CHECKPOINT_TAG, SOURCE_RUN_TAG, STAGE_TAG


def mlflow_loggers(trainer) -> list[MLFlowLogger]:
    """The trainer's MLflow loggers: where the callbacks and the CLI write files and tags."""
    return [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]


def _class_of(class_path: str) -> Optional[type]:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def mlflow_logger_configs(logger_cfg) -> list[Any]:
    """The entries of a parsed `trainer.logger` (one, a list, None or a bool) whose class is an MLFlowLogger."""
    configs = logger_cfg if isinstance(logger_cfg, list) else [logger_cfg]
    return [
        cfg
        for cfg in configs
        if hasattr(cfg, "class_path")
        and cfg.get("init_args") is not None
        and isinstance(cls := _class_of(cfg.class_path), type)
        and issubclass(cls, MLFlowLogger)
    ]


def label_runs(logger_cfg, stage: str, source_run_id: Optional[str] = None, checkpoint: Optional[str] = None) -> None:
    """Name and tag, in the parsed logger config (before the loggers exist), the MLflow run(s) `stage` creates.

    Every run is tagged `stage`; an evaluation run is named `<run name>-<stage>` and tagged with the
    checkpoint it evaluates and, when known, the run that wrote it. A logger resuming a given run_id is
    left as it is.
    """
    for cfg in mlflow_logger_configs(logger_cfg):
        init = cfg.init_args
        if init.get("run_id"):
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
        print(f"\nMLflow run {lg.run_id} (experiment id {lg.experiment_id}) at {mask(absolute_store_uri(uri))}")
        print("final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
        page = f"#/experiments/{lg.experiment_id}/runs/{lg.run_id}"
        if is_server(uri):
            print(f"view it:  {mask(uri).rstrip('/')}/{page}")
        else:
            print(f"view it:  {mask(ui_hint(uri))}   (then open http://127.0.0.1:5000/{page})")
        if getattr(lg, "pending_note", ""):  # the command's last line: the store does not hold the whole run yet
            print(f"not sent yet: {lg.pending_note}")
