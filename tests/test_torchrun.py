"""`mhc fit` started by torchrun (2 CPU processes over gloo): Lightning joins torchrun's processes instead of starting
its own, and the fit writes one MLflow run from rank 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from helpers import CONF, tiny_fit_args


@pytest.mark.slow
def test_torchrun_two_cpu_processes_write_one_run(tiny_corpus, mlflow_uri, tmp_path):
    steps = 4
    torchrun = Path(sys.executable).with_name("torchrun")
    args = tiny_fit_args(
        tiny_corpus, mlflow_uri, tmp_path / "root", steps=steps, experiment="torchrun", run_name="torchrun"
    )
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        "mhc",
        *args,
        "--model.diagnostics_every=0",  # no per-layer figures: seconds per validation, and nothing here reads them
        "-c",
        str(CONF / "machine" / "ddp-cpu.yaml"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.pathsep.join([str(torchrun.parent), os.environ["PATH"]]))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    logs = out.stdout + out.stderr
    assert "MEMBER: 1/2" in logs and "MEMBER: 2/2" in logs  # torchrun's two processes joined one group

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("torchrun").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer.devices"] == "2"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(steps))
    assert logs.count(f"MLflow run {run.info.run_id}") == 1  # announced by rank 0 only
