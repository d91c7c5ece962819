"""A plain `mhc fit` run as a SLURM batch job (the sbatch recipe in docs/distributed.md): the requeue signal stops it
with a checkpoint and requeues the job; the requeued job continues the MLflow run tagged with its job id; another job
in the same folder, under the same run name, never touches that run or its checkpoints. Each job runs through
submitit's LocalExecutor with SLURM-like environment variables, and `scontrol` is a script that records its
arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CONF, REPO, SLURM_LIKE, handshake_arg, wait_for
from mlflow import MlflowClient

MHC = str(Path(sys.executable).with_name("mhc"))


def fit_args(corpus: Path, uri: str, root: Path, *extra: str) -> list[str]:
    """conf/quickstart.yaml made tiny: 8 steps, a checkpoint every 4, no diagnostics."""
    return [
        "fit", "-c", str(CONF / "quickstart.yaml"), f"--data.corpus={corpus}", "--data.seq_len=32",
        "--data.batch_size=4", "--model.arch.n_layers=1", "--model.arch.d_model=32", "--model.arch.n_heads=2",
        "--model.diagnostics_every=0", "--trainer.max_steps=8", "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.tracking_uri={uri}", *extra,
    ]  # fmt: skip


def slurm_job(argv: list[str], env: dict, cwd: str, signal_at: Path | None = None) -> tuple[int, str]:
    """The batch script's `mhc fit`, inside a submitit job: with `signal_at` (a handshake folder), SLURM's requeue
    signal (USR1, as `#SBATCH --signal=USR1@90` sends it) reaches the fit before step 2."""
    log = Path(cwd) / f"job{env['SLURM_JOB_ID']}-{env['SLURM_RESTART_COUNT']}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        if signal_at is not None:
            wait_for(signal_at / "at2", proc=proc, log=log)
            proc.send_signal(signal.SIGUSR1)
            (signal_at / "go2").touch()
        return proc.wait(timeout=300), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_requeued_plain_fit_continues_its_own_run_and_no_other_job_does(
    tiny_corpus, tmp_path, mlflow_uri, monkeypatch
):
    submitit = pytest.importorskip("submitit")
    tests_path = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", tests_path)  # the submitit job unpickles slurm_job from this module
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    root, hs = tmp_path / "shared_runs", tmp_path / "handshake"
    env = {
        **os.environ, **SLURM_LIKE, "SLURM_JOB_NAME": "mhc", "SLURM_RESTART_COUNT": "0",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": tests_path,
    }  # fmt: skip
    argv = [MHC, *fit_args(tiny_corpus, mlflow_uri, root)]
    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(timeout_min=20)

    def run(job_env: dict, *extra: str, signal_at: Path | None = None) -> tuple[int, str]:
        return executor.submit(slurm_job, argv + list(extra), job_env, str(tmp_path), signal_at).result()

    code, text = run(env, handshake_arg(hs, [2]), signal_at=hs)
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("quickstart").experiment_id
    (run1,) = client.search_runs([exp])
    (folder,) = root.glob(f"*/{run1.info.run_id}/checkpoints")
    assert code == 128 + signal.SIGUSR1 and "Traceback" not in text, text[-3000:]
    assert "SIGUSR1: stopping after this step with a checkpoint; then the SLURM job is requeued" in text
    assert (
        f"mhc fit: stopped by SIGUSR1 at step 3; checkpoint of step 3 saved as {folder / 'last.ckpt'}; MLflow run "
        f"{run1.info.run_id} marked KILLED. SLURM job 4242 requeued: started again, it continues MLflow run "
        f"{run1.info.run_id} from its last checkpoint." in text
    )
    assert calls.read_text().split() == ["requeue", "4242"]
    assert run1.info.status == "KILLED" and run1.data.tags["mhc.slurm.job_id"] == "4242"

    # SLURM starts the same batch script again, same job id: no --ckpt_path, and it continues the same run
    code, text = run({**env, "SLURM_RESTART_COUNT": "1"})
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert (
        f"resuming SLURM job 4242 (requeued 1x): MLflow run {run1.info.run_id} (quickstart-mhc) from "
        f"{folder / 'last.ckpt'}: it restarts at step 3 of 8" in text
    )
    (run1,) = client.search_runs([exp])
    assert run1.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run1.info.run_id, "train/loss")) == list(range(8))
    assert torch.load(folder / "last.ckpt", weights_only=True, mmap=True)["global_step"] == 8

    # another job, requeued too, in the same folder under the same run name: a run of its own, from step 0
    code, text = run({**env, "SLURM_JOB_ID": "4243", "SLURM_RESTART_COUNT": "1"})
    assert code == 0 and "resuming" not in text, text[-3000:]
    runs = client.search_runs([exp], order_by=["attributes.start_time ASC"])
    assert [r.data.tags["mhc.slurm.job_id"] for r in runs] == ["4242", "4243"]
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert sorted(m.step for m in client.get_metric_history(runs[1].info.run_id, "train/loss")) == list(range(8))
    assert calls.read_text().split() == ["requeue", "4242"]  # asked once, by the signalled job only
