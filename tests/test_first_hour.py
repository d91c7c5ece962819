"""First-hour papercuts of the tools, each as a user meets it: the dashboard the sweep suggests, `mhc sweep status`
after an extension, the hint of an unreachable server, `--ckpt_path last` with nothing to resume, and what a fit
prints with its progress bar off."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import derived_spec, tiny_fit_args

from mhc_lightning.loggers.store import TrackingUnreachable, check_tracking
from mhc_lightning.sweeps.cli import main as sweep_main
from mhc_lightning.sweeps.supervisor import dashboard_hint

MHC = str(Path(sys.executable).with_name("mhc"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OPTUNA_"))}
    return {**env, "MLFLOW_ENABLE_ASYNC_LOGGING": "false", "PYTHONUNBUFFERED": "1"}


def test_the_dashboard_hint_says_how_to_install_it(monkeypatch):
    """README's first command does not install optuna-dashboard (an extra): the hint says how."""
    label = "sqlite:////tmp/sweeps.db"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "optuna_dashboard" else real(name)
    )
    assert dashboard_hint(label) == (
        f"[mhc sweep] dashboard:  optuna-dashboard {label}   (not installed here: "
        'pip install optuna-dashboard, or pip install -e ".[dashboard]")'
    )
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert dashboard_hint(label) == f"[mhc sweep] dashboard:  optuna-dashboard {label}"


@pytest.mark.slow
def test_status_shows_the_budget_the_study_was_extended_to(tmp_path, monkeypatch, capsys, _mlflow_template):
    monkeypatch.chdir(tmp_path)
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")  # a migrated store: migrations cost seconds
    name = f"budget-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(tmp_path / "b.yaml", name, enqueue=[], budget={"n_trials": 1, "max_failed": 0})
    common = [
        str(spec),
        "--storage",
        f"sqlite:///{tmp_path / 'sweeps.db'}",
        "--tracking-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    # the trial fails at once (no corpus): only the launch's record of its budget matters here
    assert sweep_main(["run", *common, "--n-trials", "3", "--set", f"data.corpus={tmp_path / 'none'}"]) == 3
    capsys.readouterr()
    assert sweep_main(["status", *common]) == 0
    assert f"study '{name}' in " in (out := capsys.readouterr().out) and out.splitlines()[0].endswith("(budget 3)"), out


def test_an_unreachable_server_hint_names_what_the_command_accepts(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TrackingUnreachable) as err:  # as `mhc fit` (its logger, `--ckpt_path last`) checks it
        check_tracking(url, timeout=2)
    assert "MLFLOW_TRACKING_URI or --trainer.logger.init_args.tracking_uri at a running one" in str(err.value)
    assert "--tracking-uri" not in str(err.value)  # `mhc fit` rejects that option
    assert sweep_main(["run", str(derived_spec(tmp_path / "u.yaml", "u")), "--tracking-uri", url]) == 2
    assert "MLFLOW_TRACKING_URI or --tracking-uri at a running one" in capsys.readouterr().err


@pytest.mark.slow
def test_ckpt_path_last_with_no_earlier_run_writes_nothing(tiny_corpus, tmp_path, monkeypatch, capsys):
    """It left an empty mlflow.db (checking the store created it); the docs promise nothing written. In this process:
    the refusal comes before anything starts, so a process of its own adds only its start-up."""
    from mhc_lightning.fit.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for k in [k for k in os.environ if k.startswith(("MLFLOW_", "OPTUNA_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    args = tiny_fit_args(tiny_corpus, "sqlite:///mlflow.db", Path("runs"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mhc fit: error: --ckpt_path last: no MLflow store at "), lines
    assert sorted(p.name for p in work.iterdir()) == []


@pytest.mark.slow
def test_a_fit_without_its_progress_bar_reports_each_validation_and_no_noise(tiny_corpus, tmp_path, _mlflow_template):
    """With the bar off nothing was printed until the end; every fit printed Lightning's litlogger tip and torch's
    LeafSpec deprecation warning. A run that is all warm-up says so."""
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")  # a migrated store: migrations cost seconds
    args = tiny_fit_args(tiny_corpus, f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "runs", steps=4)
    res = subprocess.run(
        [MHC, *args, "--trainer.val_check_interval=2"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    progress = [ln for ln in res.stdout.splitlines() if ln.startswith("[mhc fit] step ")]
    assert [ln.split()[3] for ln in progress] == ["2/4", "4/4"], res.stdout
    assert all(" val/loss " in ln and " train/loss " in ln and ln.endswith(" s") for ln in progress), progress
    both = res.stdout + res.stderr
    assert "litlogger" not in both and "LeafSpec" not in both, both[-3000:]
    # the debug preset's 4 steps are all warm-up (base.yaml: 30 steps), said once before the run
    assert res.stderr.count("mhc fit: warning: model.optim.warmup_steps=30 >= trainer.max_steps=4: ") == 1


def test_a_resumed_fit_s_progress_bar_has_its_total_and_eta(tmp_path):
    """Lightning skips on_train_epoch_start when it resumes mid-epoch, where its bar learns its total: the resumed
    bar had neither total nor ETA. It counts from the batch it resumed at, to the step budget."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, TQDMProgressBar
    from lightning.pytorch.demos.boring_classes import BoringModel

    from mhc_lightning.callbacks.progress_lines import ProgressLines

    seen = []

    class Seen(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar = trainer.progress_bar_callback.train_progress_bar
            seen.append((bar.n, bar.total, bar.initial, "<" in str(bar)))  # "<" leads tqdm's time left

    def fit(steps, ckpt=None):
        trainer = L.Trainer(
            max_steps=steps,
            default_root_dir=tmp_path,
            callbacks=[TQDMProgressBar(), ProgressLines(), Seen()],
            logger=False,
            enable_model_summary=False,
            limit_val_batches=0,
            accelerator="cpu",
        )
        trainer.fit(BoringModel(), ckpt_path=ckpt)
        return trainer

    fit(3)
    seen.clear()
    fit(6, ckpt=str(next(tmp_path.rglob("*.ckpt"))))
    assert [(n, total, initial) for n, total, initial, _ in seen] == [(4, 6, 3), (5, 6, 3), (6, 6, 3)]
    assert all(eta for *_, eta in seen)
