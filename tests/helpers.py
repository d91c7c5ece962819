"""Shared test helpers: generated English-like text and tiny CLI argument lists."""
from __future__ import annotations

import json
from pathlib import Path

from mhc_lightning.data.synthetic import english_like_text

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


make_text = english_like_text


def mlflow_logger_arg(tracking_uri: str, experiment: str = "tests", run_name: str = "test", **extra) -> str:
    init = {"experiment_name": experiment, "run_name": run_name, "tracking_uri": tracking_uri, **extra}
    return "--trainer.logger=" + json.dumps({"class_path": "mhc_lightning.loggers.ResilientMLFlowLogger", "init_args": init})


def tiny_fit_args(corpus: Path, tracking_uri: str, root: Path, mode: str = "mhc", steps: int = 4,
                  experiment: str = "tests", run_name: str = "test") -> list[str]:
    """`mhc fit` arguments for a model small enough to take a few seconds on CPU."""
    return [
        "fit", "-c", str(CONF / "base.yaml"), "-c", str(CONF / "model" / f"{mode}.yaml"),
        "-c", str(CONF / "presets" / "debug.yaml"),
        f"--data.corpus={corpus}", "--data.seq_len=32", "--data.batch_size=4",
        "--model.arch.n_layers=2", "--model.arch.d_model=32", "--model.arch.n_heads=2",
        f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        mlflow_logger_arg(tracking_uri, experiment, run_name),
    ]
