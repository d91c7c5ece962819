"""`mhc fit` (the shipped quickstart config) and the tracking server: a server unreachable at start stops the fit at
once with one line; a real `mlflow server` on PostgreSQL that crashes in the middle of a run loses nothing. Both start
processes: marked slow."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, handshake_arg, wait_for
from mlflow import MlflowClient
from tracking_servers import MlflowServer, clean_env, free_port, fresh_databases, stop

pytestmark = pytest.mark.slow

QUICKSTART = str(REPO / "conf" / "quickstart.yaml")
TINY = [
    "--data.seq_len=32",
    "--data.batch_size=4",
    "--model.arch.n_layers=1",
    "--model.arch.d_model=32",
    "--model.arch.n_heads=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=2",
]


def mhc(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("mhc")), *args]


def test_fit_with_an_unreachable_server_stops_at_once_with_one_line(corpus, tmp_path):
    """The shipped config with MLFLOW_TRACKING_URI at a dead port: exit 2 within 30 s, one line naming the URI, no
    traceback, and nothing written (no run, no store, no checkpoint folder, no spool)."""
    url = f"http://127.0.0.1:{free_port()}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    t0 = time.monotonic()
    res = subprocess.run(
        mhc("fit", "-c", QUICKSTART, f"--data.corpus={corpus}", *TINY),
        cwd=cwd,
        env={**clean_env(), "MLFLOW_TRACKING_URI": url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    named = [line for line in out.splitlines() if url in line]
    assert res.returncode == 2, out[-3000:]
    assert (
        len(named) == 1 and named[0].startswith("mhc fit: error: MLflow tracking server") and "unreachable" in named[0]
    )
    assert "Traceback" not in out
    if took >= 30:  # a loaded machine: allow for what Python needs to import `mhc` on it (a process more)
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import mhc_lightning.fit.cli"], env=clean_env(), check=True, timeout=300)
        startup = time.monotonic() - t0
        assert took - startup < 15, (took, startup)  # no waiting on HTTP retries (minutes, before)
    assert list(cwd.iterdir()) == []
    print(f"[figures] dead tracking URI: exit 2 after {took:.1f} s")


def test_fit_survives_a_server_crash_and_loses_nothing(corpus, tmp_path):
    """`mhc fit` (shipped quickstart config) against a real `mlflow server` on PostgreSQL; the server is SIGKILLed
    before step 3 and started again before step 8. Training never waits on it, the writes of steps 3-7 are kept and sent
    when it is back, and the run ends FINISHED with every step's metrics exactly once."""
    with fresh_databases("outage") as dbs:
        (tmp_path / "server").mkdir()
        srv = MlflowServer(dbs["outage"], tmp_path / "server")
        srv.start()
        hs, log = tmp_path / "handshake", tmp_path / "fit.log"
        steps = 12
        cmd = mhc(
            "fit",
            "-c",
            QUICKSTART,
            f"--data.corpus={corpus}",
            *TINY,
            f"--trainer.max_steps={steps}",
            "--trainer.val_check_interval=4",
            "--trainer.log_every_n_steps=1",
            "--model.diagnostics_every=4",
            "--trainer.logger.init_args.retry_every=1",
            "--trainer.logger.init_args.flush_timeout=120",
            f"--trainer.logger.init_args.spool_dir={tmp_path / 'spool'}",
            handshake_arg(hs, [3, 8]),
        )
        env = {
            **clean_env(),
            "MLFLOW_TRACKING_URI": srv.url,
            "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        }
        try:
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            wait_for(hs / "at3", proc=proc, log=log)
            srv.kill()
            (hs / "go3").touch()
            t_down = time.monotonic()
            wait_for(hs / "at8", proc=proc, log=log)
            steps_while_down_s = time.monotonic() - t_down  # steps 3..7 and a validation, server away
            srv.start()
            (hs / "go8").touch()
            assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
            text = log.read_text()
            assert "MLflow unreachable" in text  # it noticed, warned once, and trained on
            assert steps_while_down_s < 60, steps_while_down_s
            client = MlflowClient(srv.url)
            exp = client.get_experiment_by_name("quickstart")
            assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"  # the training-runs view
            (run,) = client.search_runs([exp.experiment_id])
            assert run.info.status == "FINISHED"
            assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(
                range(steps)
            )
            assert len(client.get_metric_history(run.info.run_id, "val/loss")) == steps // 4
            diag = {a.path for a in client.list_artifacts(run.info.run_id, "diagnostics")}
            assert "diagnostics/per_layer_step0000004.json" in diag  # written while the server was down
            assert not list((tmp_path / "spool").rglob("*.jsonl"))  # everything sent
            print(
                f"[figures] server crash: {steps_while_down_s:.1f} s for steps 3-7 with the server down; "
                f"{steps} of {steps} steps in MLflow"
            )
        finally:
            if "proc" in locals() and proc.poll() is None:
                stop(proc)
            srv.stop()
