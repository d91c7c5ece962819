"""The compose topology with real processes: PostgreSQL at 127.0.0.1:5432 (MLflow's backend store and
Optuna's storage), an `mlflow server` started here on a free loopback port, sweep workers as separate
processes, optuna-dashboard; plus the MLflow server going away at start and in the middle of a run (`mhc fit`
against such a server: test_tracking_fit_outages.py; the servers themselves: tracking_servers.py).

Tests that need PostgreSQL skip, saying why, only when nothing answers at 127.0.0.1:5432. All of them start servers or
processes: marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
import requests
import yaml
from helpers import REPO, derived_spec, tiny_fit_args, wait_for_running_trial
from mlflow import MlflowClient
from tracking_servers import MlflowServer, Proxy, clean_env, free_port, fresh_databases, stop

from mhc_lightning.sweeps import factories
from mhc_lightning.sweeps.cli import main as sweep_main

pytestmark = pytest.mark.slow

S = optuna.trial.TrialState


@pytest.fixture(scope="module")
def postgres():
    """Two fresh databases (MLflow, sweeps) on the local server; dropped afterwards."""
    with fresh_databases("mlflow", "sweeps") as dbs:
        yield dbs


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """One server for the module's tests."""
    proxy_port = free_port()  # the outage test's relay needs its Host name allowed too
    srv = MlflowServer(postgres["mlflow"], tmp_path_factory.mktemp("mlflow_server"), (f"127.0.0.1:{proxy_port}",))
    try:
        srv.start()
        yield {"url": srv.url, "port": srv.port, "proxy_port": proxy_port, "root": srv.root, **postgres}
    finally:
        srv.stop()


def launch(
    spec: Path, cwd: Path, server, corpus: Path, *extra: str, log_name: str, env: dict | None = None
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "mhc_lightning.sweeps",
        "run",
        str(spec),
        "--storage",
        server["sweeps"],
        "--tracking-uri",
        server["url"],
        "--set",
        f"data.corpus={corpus}",
        "--set",
        f"trainer.default_root_dir={cwd / 'runs'}",
        "--spool-dir",
        str(cwd / "spool"),
        *extra,
    ]
    log = open(cwd / log_name, "w")
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env or clean_env(), start_new_session=True
    )


def wait(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"sweep did not finish in {timeout} s; log tail:\n{log.read_text()[-4000:]}")


def check_one_run_per_trial(client: MlflowClient, study, name: str) -> dict[int, object]:
    """Every Optuna trial has exactly one MLflow child run and every child run belongs to a trial."""
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], f"tags.`optuna.study_name` = '{name}'", max_results=1000)
    parents = [r for r in runs if r.data.tags.get("optuna.role") == "study"]
    children = [r for r in runs if r.data.tags.get("optuna.role") == "trial"]
    assert len(parents) == 1
    numbers = [int(r.data.tags["optuna.trial"]) for r in children]
    assert sorted(numbers) == sorted(set(numbers)), "duplicate MLflow runs for a trial"
    trials = {t.number: t for t in study.get_trials() if t.state != S.WAITING}
    assert sorted(numbers) == sorted(trials), "trials missing in MLflow, or runs without a trial"
    by_trial = {int(r.data.tags["optuna.trial"]): r for r in children}
    for n, t in trials.items():
        run = by_trial[n]
        assert run.info.run_id == t.user_attrs["mlflow_run_id"]
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.data.tags["optuna.state"] == {S.COMPLETE: "COMPLETE", S.PRUNED: "PRUNED", S.FAIL: "FAILED"}[t.state]
    return by_trial


# ---- tests -----------------------------------------------------------------------------------------
def test_unreachable_server_at_start_names_the_url(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    code = sweep_main(
        ["run", str(REPO / "sweeps" / "smoke.yaml"), "--tracking-uri", url, "--storage", f"sqlite:///{tmp_path}/s.db"]
    )
    err = capsys.readouterr().err
    assert code == 2 and url in err and "unreachable" in err, err
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "s.db").exists()  # nothing was started


def test_server_accepts_the_compose_host_names(server):
    """--allowed-hosts as in docker-compose.yml: other containers call it `mlflow:<port>`."""
    api = f"{server['url']}/api/2.0/mlflow/experiments/search?max_results=1"
    assert requests.get(api, headers={"Host": f"mlflow:{server['port']}"}, timeout=10).status_code == 200
    assert requests.get(api, headers={"Host": f"evil.example:{server['port']}"}, timeout=10).status_code == 403


def test_two_workers_one_study_on_postgres(server, corpus, tmp_path, monkeypatch):
    """`mhc sweep --workers 2`: two processes share one study; every trial is recorded once in Optuna and MLflow.
    The launcher runs in this process (its workers are the processes that matter): one process's start-up less."""
    name = f"two-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(tmp_path / "two.yaml", name, budget={"n_trials": 4, "max_failed": 2})
    monkeypatch.chdir(tmp_path)  # worker logs under ./sweep_logs
    for k, v in clean_env().items():  # as launch() gives its launcher, for the workers and their trials
        monkeypatch.setenv(k, v)
    for k in ("MLFLOW_TRACKING_URI", "OPTUNA_STORAGE"):
        monkeypatch.delenv(k, raising=False)
    argv = ["run", str(spec), "--storage", server["sweeps"], "--tracking-uri", server["url"], "--workers", "2"]
    argv += ["--set", f"data.corpus={corpus}", "--set", f"trainer.default_root_dir={tmp_path / 'runs'}"]
    assert sweep_main([*argv, "--spool-dir", str(tmp_path / "spool")]) == 0

    study = optuna.load_study(study_name=name, storage=server["sweeps"])
    finished = [t for t in study.trials if t.state in (S.COMPLETE, S.PRUNED)]
    assert 4 <= len(finished) <= 5 and not [t for t in study.trials if t.state == S.RUNNING]
    workers = {t.user_attrs["worker"] for t in study.trials}
    seeds = {t.user_attrs["sampler_seed"] for t in study.trials}
    assert len(workers) == 2 and len(seeds) == 2  # two processes, each with its own sampler seed
    client = MlflowClient(server["url"])
    check_one_run_per_trial(client, study, name)
    parent = client.get_run(study.user_attrs["mlflow_parent_run_id"])
    assert parent.data.tags["best.trial"] == str(study.best_trial.number)
    logs = sorted((tmp_path / "sweep_logs" / name).glob("worker-*.log"))
    assert len(logs) == 2

    # mhc compare against the tracking server: artifacts come through --serve-artifacts
    from mhc_lightning.reports.cli import main as compare_main

    out = tmp_path / "report"
    assert compare_main(["--study", name, "--tracking-uri", server["url"], "--out", str(out)]) == 0
    assert (out / "runs.csv").read_text().count("\n") >= 5
    assert (out / "val_loss.png").stat().st_size > 10_000 and (out / "amax_vs_layer.png").exists()
    assert "comparison/val_loss.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}


def test_dashboard_reads_the_sweeps_database_without_its_password_on_the_command_line(postgres):
    """optuna-dashboard started exactly as the compose service starts it (its entrypoint, the storage URL with a
    password in $OPTUNA_STORAGE): it serves the study, and the password is not on its command line."""
    import psutil

    pytest.importorskip("optuna_dashboard")  # the [dashboard] extra
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["optuna-dashboard"]
    name = f"dash-{uuid.uuid4().hex[:6]}"
    study = optuna.create_study(study_name=name, storage=factories.make_storage(postgres["sweeps"], {}))
    study.optimize(lambda t: t.suggest_float("x", 0, 1) ** 2, n_trials=2)
    port, secret = free_port(), f"pw{uuid.uuid4().hex[:8]}"  # trust authentication ignores the password
    url = postgres["sweeps"].replace("postgres@", f"postgres:{secret}@")
    argv = [
        sys.executable if a == "python" else a.replace("0.0.0.0", "127.0.0.1").replace("8080", str(port))
        for a in compose["entrypoint"]
    ]
    dash = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**clean_env(), "OPTUNA_STORAGE": url},
    )
    try:
        deadline, studies = time.monotonic() + 60, None
        while time.monotonic() < deadline and studies is None:
            try:
                studies = requests.get(f"http://127.0.0.1:{port}/api/studies", timeout=2).json()
            except requests.RequestException:
                time.sleep(0.5)
        assert studies is not None, "optuna-dashboard did not answer within 60 s"
        assert name in [s["study_name"] for s in studies["study_summaries"]]
        assert secret not in " ".join(psutil.Process(dash.pid).cmdline())
    finally:
        stop(dash)


def test_killed_worker_trial_is_failed_and_retried(server, corpus, tmp_path):
    """Two launchers (as on two machines); one is SIGKILLed mid-trial. The heartbeat marks its trial FAIL, the
    retry callback re-queues it, the other worker runs it, and the study finishes with nothing lost."""
    name = f"kill-{uuid.uuid4().hex[:6]}"
    gate = tmp_path / "gate"
    spec = derived_spec(
        tmp_path / "kill.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        budget={"n_trials": 2, "max_failed": 2},
        storage={"heartbeat_interval": 1, "grace_period": 4, "max_retry": 2},
        # every trial waits before its step 1 until the test opens the gate: the victim is killed inside its trial
        # however busy the machine (tests/helpers.py Handshake, which the launchers import from tests/)
        fixed={
            "trainer.max_steps": 4,
            "trainer.val_check_interval": 2,
            "model.diagnostics_every": 0,
            "callbacks.helpers.Handshake.dirpath": str(gate),
            "callbacks.helpers.Handshake.steps": [1],
        },
    )
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    survivor = launch(spec, tmp_path, server, corpus, "--machine-rank", "0", log_name="survivor.log", env=env)
    victim = launch(spec, tmp_path, server, corpus, "--machine-rank", "1", log_name="victim.log", env=env)
    try:
        trial = wait_for_running_trial(
            name, server["sweeps"], victim, tmp_path / "victim.log", 240, worker_pid=victim.pid, poll=0.2
        )
        assert trial is not None, "the victim never started a trial"
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=20)
        killed = trial.number
        gate.mkdir(exist_ok=True)
        (gate / "go1").touch()
        assert wait(survivor, 420, tmp_path / "survivor.log") == 0, (tmp_path / "survivor.log").read_text()[-4000:]
    finally:
        stop(victim)
        stop(survivor)

    study = optuna.load_study(study_name=name, storage=server["sweeps"])
    trials = {t.number: t for t in study.trials}
    assert trials[killed].state == S.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed]
    assert len(retries) == 1 and retries[0].state == S.COMPLETE and retries[0].params == trials[killed].params
    assert sum(t.state == S.COMPLETE for t in study.trials) == 2 and not study.get_trials(states=(S.RUNNING, S.WAITING))
    client = MlflowClient(server["url"])
    by_trial = check_one_run_per_trial(client, study, name)
    dead = by_trial[killed]
    assert dead.info.status == "FAILED" and dead.data.tags["optuna.state"] == "FAILED"  # reconciled by the survivor
    assert by_trial[retries[0].number].data.tags["optuna.retry_of"] == str(killed)


def test_server_down_during_run_training_continues_then_replay(server, corpus, tmp_path, monkeypatch):
    """The server disappears at step 3, returns at step 6 (kept writes flushed during training), disappears
    again at step 9 until the end: training finishes, what is left waits in the spool, `mhc sweep replay`
    sends it, and the run ends up complete with every step's metrics."""
    from lightning.pytorch.callbacks import Callback

    from mhc_lightning.fit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast; the guard retries on its own schedule
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    proxy = Proxy(server["port"], server["proxy_port"])
    uri = f"http://127.0.0.1:{proxy.port}"
    events = []

    class Outage(Callback):
        def on_train_batch_end(self, trainer, *args):
            step = trainer.global_step
            if step in (3, 9):
                proxy.down()
                events.append(("down", step))
            elif step == 6:
                proxy.up()
                events.append(("up", step))

    spool = tmp_path / "spool"
    args = tiny_fit_args(corpus, uri, tmp_path / "runs", steps=12, experiment="outage", run_name="outage")[1:]
    args = [a for a in args if not a.startswith("--trainer.logger=")]
    logger = {
        "class_path": "mhc_lightning.loggers.ResilientMLFlowLogger",
        "init_args": {
            "experiment_name": "outage",
            "run_name": "outage",
            "tracking_uri": uri,
            "spool_dir": str(spool),
            "retry_every": 0.05,
            "flush_timeout": 1.0,
        },
    }
    args += [
        "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=4",
        "--model.diagnostics_every=4",
        "--trainer.logger=" + json.dumps(logger),
    ]
    try:
        with pytest.warns(RuntimeWarning, match="MLflow"):
            cli = build_cli(args, run=False, trainer_defaults={"callbacks": [Outage()]})
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert cli.trainer.global_step == 12 and cli.trainer.state.finished  # training never stopped
        assert events == [("down", 3), ("up", 6), ("down", 9)]
        run_id = cli.trainer.logger.run_id
        client = MlflowClient(server["url"])
        assert client.get_run(run_id).info.status == "RUNNING"  # its end is still in the spool
        kept = list(spool.glob(f"{run_id}/*.jsonl"))
        assert kept and kept[0].read_text().count("\n") > 3
        # steps 3..5 were kept and flushed once the server returned at step 6, during training
        steps_before_replay = {m.step for m in client.get_metric_history(run_id, "train/loss")}
        assert {3, 4, 5} <= steps_before_replay and 11 not in steps_before_replay
        proxy.up()
        assert sweep_main(["replay", str(spool), "--tracking-uri", uri]) == 0
    finally:
        proxy.down()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run_id, "train/loss")} == set(range(12))
    diag = {a.path for a in client.list_artifacts(run_id, "diagnostics")}
    # logged while the server was down: the validation at step 12 writes the per-layer values of the last
    # diagnostics step, 8 (the validations at steps 4 and 8 wrote those of steps 0 and 4)
    assert "diagnostics/per_layer_step0000008.json" in diag
    assert not list(spool.glob("*/*.jsonl"))
