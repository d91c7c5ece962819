"""Shared test helpers: generated English-like text and tiny CLI argument lists."""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the king speaks of love and honour while a storm rolls over the sea and "
         "every lord in the hall waits for news from the north with fear").split()

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def make_text(n_bytes: int, seed: int = 0) -> str:
    """English-like sentences of random words, at least n_bytes long (never zeros, never constant)."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + rng.choice(".!?") + " "
        out.append(s)
        size += len(s)
    return "".join(out)


def mlflow_logger_arg(tracking_uri: str, experiment: str = "tests", run_name: str = "test", **extra) -> str:
    init = {"experiment_name": experiment, "run_name": run_name, "tracking_uri": tracking_uri, **extra}
    return "--trainer.logger=" + json.dumps({"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": init})


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
