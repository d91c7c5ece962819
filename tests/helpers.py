"""Shared test helpers: generated English-like text and documents, tiny CLI argument lists and grids, a handshake
with a running fit, a tiny in-process fit with fault injectors, and a quickstart-sized model trained in-process."""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml

from mhc_lightning.data.synthetic import english_like_text

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


make_text = english_like_text

_PARAM = type(pytest.param(None))


def fast_first(argnames, argvalues, **kwargs):
    """`pytest.mark.parametrize` whose first case alone runs in the fast tier (`pytest -m "not slow"`): every op and
    path once, on its first setting; the other cases (dtypes, stream counts, layouts, modes) are marked slow and run
    in the full suite. Stacked, the first case of each makes the one fast combination."""
    several = len(argnames.split(",") if isinstance(argnames, str) else argnames) > 1

    def later(v):
        if isinstance(v, _PARAM):
            return pytest.param(*v.values, marks=[*v.marks, pytest.mark.slow], id=v.id)
        return pytest.param(*v, marks=pytest.mark.slow) if several else pytest.param(v, marks=pytest.mark.slow)

    values = list(argvalues)
    return pytest.mark.parametrize(argnames, values[:1] + [later(v) for v in values[1:]], **kwargs)


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


# the variables SLURM sets in a job step of one task (Lightning then sees a SLURM cluster)
SLURM_LIKE = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "mhc-grid",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "localhost",
}


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


def write_documents(folder: Path, n: int = 60, seed: int = 0) -> list[str]:
    """n documents of generated text as a JSON Lines file, a gzip one and a text file; returns the texts in the order
    `mhc prepare` reads them (files by name)."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [make_text(200 + 37 * i, seed=seed + i) for i in range(n)]
    third = n // 3
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:third]))
    )
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[third : n - 1])
    (folder / "c.txt").write_text(docs[-1])
    return docs


TINY_GRID = {
    "experiment": "tiny-grid",
    "configs": ["conf/model/mhc.yaml", "conf/presets/debug.yaml"],
    "variants": {"mhc": {}, "hc": {"model.arch.hyper.residual_mode": "hc"}},
    "axes": {"seed_everything": [1]},
}


def tiny_grid_command(tmp_path: Path, corpus: Path, steps: int) -> list[str]:
    """`mhc grid` on TINY_GRID (two variants, one seed each) with tiny_grid_sets, its logs and runs under tmp_path."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(json.dumps(TINY_GRID))
    return [
        str(Path(sys.executable).with_name("mhc")),
        "grid",
        str(grid),
        "--parallel",
        "2",
        "--logs",
        str(tmp_path / "logs"),
        *tiny_grid_sets(corpus, steps),
        "--set",
        f"trainer.default_root_dir={tmp_path / 'runs'}",
    ]


# a tiny in-process fit (the callback tests) and fault injectors


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and the result does not depend on the machine's core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_module(
    mode: str = "mhc",
    lr: float = 3e-3,
    n_layers: int = 2,
    d_model: int = 32,
    diagnostics_every: int = 5,
    seed: int = 0,
    **hyper,
):
    from mhc_lightning.model import GPTConfig, HyperConfig
    from mhc_lightning.training.module import LitLM, OptimConfig

    L.seed_everything(seed, verbose=False)
    arch = GPTConfig(
        n_layers=n_layers, d_model=d_model, n_heads=2, context=32, hyper=HyperConfig(residual_mode=mode, **hyper)
    )
    return LitLM(arch=arch, optim=OptimConfig(lr=lr, warmup_steps=5), diagnostics_every=diagnostics_every)


# MHC_TEST_ACCELERATOR=gpu runs the in-process callback tests on CUDA (GPU machine): device-placement bugs
# (CPU step counters beside CUDA weights, pinned copies) only show there.
ACCELERATOR = os.environ.get("MHC_TEST_ACCELERATOR", "cpu")


def tiny_fit(
    corpus: Path,
    callbacks: list,
    steps: int,
    module=None,
    logger=False,
    ckpt_path=None,
    seed: int = 0,
    data_seed: Optional[int] = 1234,
    **trainer_kwargs,
):
    """Fit a tiny model in-process for `steps` optimizer steps; returns (trainer, module). data_seed: the data
    order, held fixed by default so that the callback tests' trajectories do not move with `seed` (None: follow it)."""
    from mhc_lightning.data import ByteTextDataModule

    module = module if module is not None else tiny_module(seed=seed)
    L.seed_everything(seed, verbose=False)
    dm = ByteTextDataModule(corpus=str(corpus), seq_len=32, batch_size=4, seed=data_seed)
    kw = dict(
        max_steps=steps,
        accelerator=ACCELERATOR,
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    kw.update(trainer_kwargs)
    trainer = L.Trainer(callbacks=callbacks, **kw)
    with one_thread():
        trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer, module


def params_finite(module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


class NaNGradAt(L.Callback):
    """Fault: after backward at optimizer step k, one parameter's gradient becomes NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            next(pl_module.parameters()).grad.fill_(float("nan"))


class CorruptBatchAt(L.Callback):
    """Fault: the targets of the batch at step k become byte 0 (absent from the text): a loss spike."""

    def __init__(self, *steps: int):
        self.steps = set(steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            batch[1].zero_()


class StepRecorder(L.Callback):
    """Per-step loss (None when the batch was skipped) and the batch's first token, for assertions."""

    def __init__(self):
        self.loss: dict[int, Optional[float]] = {}
        self.first_tokens: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.first_tokens[trainer.global_step] = batch[0][:, 0].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = pl_module.last_loss
        self.loss[trainer.global_step - 1] = None if loss is None else float(loss)

    def final_loss(self) -> float:
        return next(v for _, v in sorted(self.loss.items(), reverse=True) if v is not None and math.isfinite(v))


# a quickstart-sized model trained in-process on the reference ops (the stream tests)


def quick_model(mode: str, **hyper):
    """The quickstart's shape (3 blocks, C = 128, n = 4), on the reference ops."""
    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            n_layers=3,
            d_model=128,
            n_heads=4,
            context=64,
            hyper=HyperConfig(residual_mode=mode, kernel_backend="torch", **hyper),
        )
    )


def text_batches(steps: int, B: int = 8, T: int = 64) -> torch.Tensor:
    data = torch.tensor(list(make_text(steps * B * (T + 1) + 10, seed=3).encode()), dtype=torch.long)
    return data[: steps * B * (T + 1)].view(steps, B, T + 1)


def recorded(m, idx: torch.Tensor) -> dict:
    with m.recording(), torch.no_grad():
        m(idx)
    return m.recorded()


def train(m, steps: int = 60, lr: float = 3e-3) -> torch.Tensor:
    """AdamW on real text; returns a held-out batch for probing."""
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    batches = text_batches(steps + 1)
    for s in range(steps):
        x = batches[s]
        loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return batches[steps][:, :-1]
