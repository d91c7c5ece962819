"""`mhc fit` with a Lightning logger other than MLflow: training, metrics and checkpoints as usual, and the resolved
config saved by Lightning's own SaveConfigCallback behaviour, as config.yaml in the logger's log_dir."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers import fast_first, tiny_fit_args


def fit_with_logger(corpus, tmp_path, class_path: str, **init_args) -> None:
    from mhc_lightning.fit.cli import main

    args = tiny_fit_args(corpus, "unused", tmp_path / "root", steps=3)
    args = [a for a in args if not a.startswith("--trainer.logger")]
    init_args = init_args or {"name": "tiny"}
    logger = {"class_path": class_path, "init_args": {"save_dir": str(tmp_path / "logs"), **init_args}}
    main(args + ["--trainer.logger=" + json.dumps(logger)])


@fast_first(
    "class_path",
    [
        "lightning.pytorch.loggers.CSVLogger",
        pytest.param("lightning.pytorch.loggers.TensorBoardLogger", marks=pytest.mark.slow),
    ],
)
def test_fit_with_another_logger_saves_its_config_in_the_log_dir(class_path, tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # a second fit gets its own version folder, no clash with the first's config.yaml
        fit_with_logger(tiny_corpus, tmp_path, class_path)
    for version in ("version_0", "version_1"):
        log_dir = tmp_path / "logs" / "tiny" / version
        config = yaml.safe_load((log_dir / "config.yaml").read_text())
        assert config["model"]["arch"]["n_layers"] == 2 and config["trainer"]["max_steps"] == 3
        assert config["trainer"]["logger"]["class_path"] == class_path
        assert (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    if class_path.endswith("CSVLogger"):
        with open(tmp_path / "logs" / "tiny" / "version_0" / "metrics.csv") as f:
            columns = next(csv.reader(f))
        assert {"train/loss", "val/loss", "train/tokens_per_sec", "amax/composite_fwd_max"} <= set(columns)
    else:
        assert list((tmp_path / "logs" / "tiny" / "version_0").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_two_wandb_fits_in_one_save_dir_each_keep_their_config(tiny_corpus, tmp_path):
    """W&B's runs share their save_dir: each fit's config.yaml goes into its own run folder, beside its checkpoints
    (Lightning's stock callback puts it in the save_dir, where a second fit would stop after creating its W&B run)."""
    pytest.importorskip("wandb")
    args = [a for a in tiny_fit_args(tiny_corpus, "unused", tmp_path / "root", steps=3) if "trainer.logger" not in a]
    wandb_logger = "lightning.pytorch.loggers.WandbLogger"
    logger = {"class_path": wandb_logger, "init_args": {"save_dir": "logs", "project": "tiny"}}
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for _ in range(2):  # one process per fit, as `mhc fit` runs (a W&B run lasts as long as its process)
        done = subprocess.run(
            [sys.executable, "-m", "mhc_lightning.fit.cli", *args, "--trainer.logger=" + json.dumps(logger)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    runs = sorted(p for p in (tmp_path / "logs" / "tiny").iterdir())
    assert len(runs) == 2 and len(list((tmp_path / "logs" / "wandb").glob("offline-run-*"))) == 2
    for run in runs:
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["trainer"]["logger"]["class_path"].endswith("WandbLogger")
        assert (run / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "logs" / "config.yaml").exists()
