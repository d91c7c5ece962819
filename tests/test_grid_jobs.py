"""`mhc grid --launcher slurm`'s jobs (submitit), run here by submitit's LocalExecutor (`--launcher submitit-local`):
one tagged MLflow run per point, each point in its own checkpoint folder, and a requeued job resuming the same run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
from helpers import REPO, SLURM_LIKE, tiny_fit_args, tiny_grid_sets, wait_for


class PauseAt(L.Callback):
    """In the fit of a grid job: before optimizer step `step`, write <dirpath>/at<step> (holding this process's pid)
    and wait for <dirpath>/go<step>, or until the fit is asked to stop (SIGTERM from its job): the fit then stops as
    one that was training would, instead of sitting out the job's grace period until its SIGKILL."""

    def __init__(self, dirpath: str, step: int):
        self.dirpath, self.step = Path(dirpath), step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from mhc_lightning.callbacks.graceful_stop import STOP

        if trainer.global_step == self.step:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            (self.dirpath / f"at{self.step}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 600
            while not (self.dirpath / f"go{self.step}").exists() and STOP.signum is None:
                assert time.monotonic() < deadline, f"no go{self.step} within 600 s"
                time.sleep(0.1)


GRID = {
    "experiment": "jobs",
    "configs": ["conf/model/mhc.yaml", "conf/presets/debug.yaml"],
    "variants": {"mhc": {}},
    "axes": {"seed_everything": [1]},
}


def test_grid_help_offers_the_cluster_launcher():
    from mhc_lightning.grids.cli import build_parser

    text = build_parser().format_help()
    assert "--launcher {local,slurm,submitit-local}" in text and "--slurm KEY=VALUE" in text


def test_slurm_parameters_and_bad_ones(tmp_path):
    from mhc_lightning.grids.cli import GridError, build_parser, job_parameters

    args = build_parser().parse_args(
        [
            "g.yaml",
            "--launcher",
            "slurm",
            "--parallel",
            "4",
            "--gpus-per-node",
            "1",
            "--slurm",
            "account=proj",
            "--slurm",
            "mem_gb=64",
        ]
    )
    assert job_parameters(args, {"experiment": "x"}) == {
        "name": "mhc-grid-x",
        "timeout_min": 1440,
        "slurm_array_parallelism": 4,
        "tasks_per_node": 1,
        "gpus_per_node": 1,
        "slurm_account": "proj",
        "slurm_mem_gb": 64,
    }
    args = build_parser().parse_args(["g.yaml", "--slurm", "account"])
    with pytest.raises(GridError, match="--slurm 'account': expected KEY=VALUE"):
        job_parameters(args, {"experiment": "x"})


def test_a_job_with_two_gpus_runs_one_fit_on_both_under_slurm(tiny_corpus, mlflow_uri, tmp_path, monkeypatch):
    """`--gpus-per-node 2`: SLURM gives the job one task and two GPUs. The point's fit uses both (trainer.devices=2)
    and starts its second process itself; under SLURM's environment Lightning refuses devices=2 with one task per
    node. (Two CPU processes stand for the GPUs; the Trainer is built, not run.)"""
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from mhc_lightning.fit.child_processes import mhc_command
    from mhc_lightning.fit.cli import build_cli
    from mhc_lightning.grids.jobs import SLURM_PLUGIN, GridPoint

    for key, value in {**SLURM_LIKE, "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1"}.items():
        monkeypatch.setenv(key, value)
    argv = [*tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "runs"), "--trainer.accelerator=cpu"]
    point = GridPoint("mhc-s1", argv, {}, str(tmp_path / "runs"), str(tmp_path / "log"), mlflow_uri, "0", gpus=2)
    command = point.command()[len(mhc_command()) + 1 :]  # without `mhc fit`
    assert SLURM_PLUGIN not in command
    trainer = build_cli(command, run=False).trainer
    env = trainer.strategy.cluster_environment  # what the launcher checks, then starts the other process from
    assert trainer.num_devices == 2 and isinstance(env, LightningEnvironment) and not env.creates_processes_externally
    env.validate_settings(num_devices=2, num_nodes=1)
    slurm = build_cli([a for a in command if "LightningEnvironment" not in a], run=False).trainer
    with pytest.raises(ValueError, match="--ntasks-per-node=1"):
        slurm.strategy.cluster_environment.validate_settings(num_devices=2, num_nodes=1)


@pytest.mark.slow
def test_requeued_job_resumes_its_own_run_under_slurm_like_env(tiny_corpus, tmp_path, _mlflow_template):
    """The point's fit is paused at step 3 (a checkpoint at step 2 exists). Lightning's requeue signal (USR1) changes
    nothing: its auto-requeue is off and the fit ignores the signal. submitit's (USR2, to the job) checkpoints the
    job and requeues it; the requeued job runs `--ckpt_path last` and finishes the same MLflow run. A stray
    hpc_ckpt beside the points' folders is never loaded: each point has its own default_root_dir."""
    import mlflow

    grid = tmp_path / "grid.yaml"
    grid.write_text(json.dumps(GRID))
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    (runs_dir / "hpc_ckpt_1.ckpt").write_bytes(b"another job's checkpoint")  # would break a fit that loaded it
    pause = tmp_path / "pause"
    callback = json.dumps({"class_path": "test_grid_jobs.PauseAt", "init_args": {"dirpath": str(pause), "step": 3}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")  # a migrated store: migrations cost seconds
    env = {
        **os.environ,
        **SLURM_LIKE,
        "MLFLOW_TRACKING_URI": uri,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        str(Path(sys.executable).with_name("mhc")),
        "grid",
        str(grid),
        "--launcher",
        "submitit-local",
        "--timeout-min",
        "30",
        "--logs",
        str(tmp_path / "logs"),
        "--runs-dir",
        str(runs_dir),
        *tiny_grid_sets(tiny_corpus, 6),
        "--set",
        f"trainer.callbacks+={callback}",
    ]
    grid_proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log = tmp_path / "logs" / "mhc-s1.log"
    try:
        wait_for(pause / "at3", 300, grid_proc)
        fit = int((pause / "at3").read_text())
        os.kill(fit, signal.SIGUSR1)  # what SLURM sends for Lightning's own requeue
        time.sleep(2)
        os.kill(fit, 0)  # still running
        assert not list(runs_dir.rglob("hpc_ckpt_*.ckpt"))[1:], "Lightning saved an hpc checkpoint"
        import psutil

        os.kill(psutil.Process(fit).parent().pid, signal.SIGUSR2)  # submitit's signal, to the job
        deadline = time.monotonic() + 300
        while "resuming MLflow run" not in (log.read_text() if log.is_file() else ""):
            assert time.monotonic() < deadline and grid_proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        (pause / "go3").write_text("")
        out, _ = grid_proc.communicate(timeout=600)
    finally:
        if grid_proc.poll() is None:
            grid_proc.kill()
    assert grid_proc.returncode == 0, out[-3000:]
    assert "1/1 runs finished" in out
    assert [p.name for p in runs_dir.rglob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]  # only the decoy

    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
    assert run.info.run_name == "mhc-s1" and run.info.status == "FINISHED"
    assert run.data.tags["variant"] == "mhc" and run.data.tags["grid"] == "jobs"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(6))  # each step once, across both attempts
    # the point's own folder holds its checkpoints
    assert list((runs_dir / "mhc-s1").glob(f"*/{run.info.run_id}/checkpoints/last.ckpt"))
    assert log.read_text().count("resuming MLflow run") == 1
