"""Shared test helpers: generated English-like text, tiny CLI argument lists, and a handshake with a running fit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import yaml

from mhc_lightning.data.synthetic import english_like_text

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


make_text = english_like_text


def mlflow_logger_arg(tracking_uri: str, experiment: str = "tests", run_name: str = "test", **extra) -> str:
    init = {"experiment_name": experiment, "run_name": run_name, "tracking_uri": tracking_uri, **extra}
    return "--trainer.logger=" + json.dumps(
        {"class_path": "mhc_lightning.loggers.ResilientMLFlowLogger", "init_args": init}
    )


def tiny_grid_sets(corpus: Path, steps: int) -> list[str]:
    """`mhc grid --set` arguments for the same small model as tiny_fit_args (one block), without per-layer figures."""
    pairs = [
        f"data.corpus={corpus}",
        "data.seq_len=32",
        "data.batch_size=4",
        "model.arch.n_layers=1",
        "model.arch.d_model=32",
        "model.arch.n_heads=2",
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=false",
        "model.diagnostics_every=0",  # per-layer figures cost seconds per validation, and no grid test reads them
    ]
    return [arg for pair in pairs for arg in ("--set", pair)]


def tiny_fit_args(
    corpus: Path,
    tracking_uri: str,
    root: Path,
    mode: str = "mhc",
    steps: int = 4,
    experiment: str = "tests",
    run_name: str = "test",
) -> list[str]:
    """`mhc fit` arguments for a model small enough to take a few seconds on CPU."""
    return [
        "fit",
        "-c",
        str(CONF / "base.yaml"),
        "-c",
        str(CONF / "model" / f"{mode}.yaml"),
        "-c",
        str(CONF / "presets" / "debug.yaml"),
        f"--data.corpus={corpus}",
        "--data.seq_len=32",
        "--data.batch_size=4",
        "--model.arch.n_layers=2",
        "--model.arch.d_model=32",
        "--model.arch.n_heads=2",
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        mlflow_logger_arg(tracking_uri, experiment, run_name),
    ]


def handshake_arg(dirpath: Path, steps: list[int]) -> str:
    """`mhc fit` argument adding the Handshake callback below (the process needs tests/ on PYTHONPATH)."""
    return "--trainer.callbacks+=" + json.dumps(
        {"class_path": "helpers.Handshake", "init_args": {"dirpath": str(dirpath), "steps": steps}}
    )


def wait_for(path: Path, timeout: float = 300, proc=None, log: Path = None) -> None:
    """Until `path` exists; fail early if `proc` (a subprocess) ended meanwhile."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"process ended ({proc.returncode}) before {path.name}:\n" + (log.read_text()[-3000:] if log else "")
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.1)


class Handshake(L.Callback):
    """For fault tests driven from outside a `mhc fit` process: before each of `steps`, write <dirpath>/at<step> and
    wait (up to `timeout` s) for <dirpath>/go<step>, so the test can break something at a known step."""

    def __init__(self, dirpath: str, steps: list[int], timeout: float = 600):
        self.dirpath, self.steps, self.timeout = Path(dirpath), set(steps), timeout

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.steps and trainer.global_rank == 0:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            (self.dirpath / f"at{step}").write_text(str(step))
            wait_for(self.dirpath / f"go{step}", self.timeout)


def derived_spec(path: Path, name: str, **changes) -> Path:
    """sweeps/smoke.yaml with another name and test settings; base configs made absolute."""
    d = yaml.safe_load((REPO / "sweeps" / "smoke.yaml").read_text())
    d["name"] = name
    d["base"] = [str(REPO / b) for b in d["base"]]
    for k, v in changes.items():
        if k in ("fixed", "budget", "storage"):
            d[k].update(v)
        else:
            d[k] = v
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def wait_for_running_trial(
    name: str, storage, proc, log: Path, timeout: float, worker_pid: int | None = None, poll: float = 0.5
):
    """The first RUNNING trial of study `name` that already has its MLflow run (its `mhc fit` is training), of the
    worker process `worker_pid` when given; None after `timeout`. Fails with the log's tail if `proc` ends first."""
    import optuna
    from optuna.trial import TrialState

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(poll)
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:  # not created yet
            continue
        for t in study.get_trials(states=(TrialState.RUNNING,)):
            if "mlflow_run_id" in t.user_attrs and worker_pid in (None, trial_worker_pid(t)):
                return t
    return None


def trial_worker_pid(trial) -> int | None:
    """The pid in a trial's `worker` attribute ("host:pid")."""
    parts = str(trial.user_attrs.get("worker", "")).split(":")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def md_table(path: Path) -> list[dict[str, str]]:
    """The rows of a markdown table written by the reports, as {header: cell}."""
    lines = Path(path).read_text().splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    return [dict(zip(cells[0], row)) for row in cells[2:]]
