"""First-hour papercuts of the tools, each as a user meets it: the dashboard the sweep suggests, `mhc sweep status`
after an extension, the hint of an unreachable server, `--ckpt_path last` with nothing to resume, and what a fit
prints with its progress bar off."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_fit_args

MHC = str(Path(sys.executable).with_name("mhc"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OPTUNA_"))}
    return {**env, "MLFLOW_ENABLE_ASYNC_LOGGING": "false", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_a_fit_without_its_progress_bar_reports_each_validation_and_no_noise(tiny_corpus, tmp_path):
    """With the bar off nothing was printed until the end; every fit printed Lightning's litlogger tip and torch's
    LeafSpec deprecation warning."""
    args = tiny_fit_args(tiny_corpus, f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "runs", steps=4)
    res = subprocess.run([MHC, *args, "--trainer.val_check_interval=2"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    progress = [ln for ln in res.stdout.splitlines() if ln.startswith("[mhc fit] step ")]
    assert [ln.split()[3] for ln in progress] == ["2/4", "4/4"], res.stdout
    assert all(" val/loss " in ln and " train/loss " in ln and ln.endswith(" s") for ln in progress), progress
    both = res.stdout + res.stderr
    assert "litlogger" not in both and "LeafSpec" not in both, both[-3000:]
