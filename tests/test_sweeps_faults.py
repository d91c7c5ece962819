"""Sweeps under faults, with real launcher and worker processes on SQLite and journal storages:
a SIGKILLed worker on journal storage, duplicate proposals, two launchers on a fresh store, a study stopped by
max_failed continued, and sweep-file mistakes that must stop the sweep before (or at the first of) its trials.

(PostgreSQL storages with heartbeats: tests/test_tracking_server.py.)
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from helpers import REPO, derived_spec, fast_first, make_text, trial_worker_pid, wait_for_running_trial
from mlflow import MlflowClient

from mhc_lightning.sweeps.cli import main as sweep_main
from mhc_lightning.sweeps.factories import make_storage

S = optuna.trial.TrialState
# no per-layer diagnostics: their figures cost seconds per validation, and no test here reads them
FAST = {"trainer.max_steps": 4, "trainer.val_check_interval": 2, "model.diagnostics_every": 0}


@pytest.fixture
def corpus(tmp_path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(make_text(60_000, seed=7))
    return p


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "OPTUNA_STORAGE")}
    return {**env, "MLFLOW_ENABLE_ASYNC_LOGGING": "false", "PYTHONUNBUFFERED": "1"}


def launcher(
    spec: Path, cwd: Path, corpus: Path, storage: str, uri: str, *extra: str, log: str, env: dict | None = None
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "mhc_lightning.sweeps",
        "run",
        str(spec),
        "--storage",
        storage,
        "--tracking-uri",
        uri,
        "--set",
        f"data.corpus={corpus}",
        "--set",
        f"trainer.default_root_dir={cwd / 'runs'}",
        "--spool-dir",
        str(cwd / "spool"),
        *extra,
    ]
    with open(cwd / log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env or _env(), start_new_session=True
        )


def finish(proc: subprocess.Popen, log: Path, timeout: float = 420) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"launcher still running after {timeout} s (hung); log tail:\n{log.read_text()[-4000:]}")


def trial_params(study) -> list[tuple]:
    return [
        tuple(sorted(t.params.items()))
        for t in study.trials
        if t.params and t.user_attrs.get("duplicate_of") is None and t.system_attrs.get("failed_trial") is None
    ]


# ---- item 3 (+ 5): a SIGKILLed worker on journal storage -------------------------------------------------------------
@pytest.mark.slow
def test_killed_worker_on_journal_storage_is_reaped_and_its_trial_rerun(corpus, tmp_path, _mlflow_template):
    """Two workers on a journal storage (no heartbeats); one is SIGKILLed inside a trial. The launcher reaps it, names
    it, fails and re-queues its trial; the other worker runs the copy; the launcher exits 0 with the budget met."""
    name = f"journal-{uuid.uuid4().hex[:6]}"
    gate = tmp_path / "gate"
    spec = derived_spec(
        tmp_path / "j.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        budget={"n_trials": 2, "max_failed": 1},
        # every trial waits before its step 1 until the test opens the gate: the kill lands inside a trial however
        # busy the machine (tests/helpers.py Handshake, which the workers import from tests/)
        fixed={**FAST, "callbacks.helpers.Handshake.dirpath": str(gate), "callbacks.helpers.Handshake.steps": [1]},
    )
    storage, uri = f"journal:{tmp_path / 'sweeps.journal.log'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")  # a migrated store: migrations cost seconds
    journal = make_storage(storage, {})
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = launcher(spec, tmp_path, corpus, storage, uri, "--workers", "2", log="launcher.log", env=env)
    try:
        trial = wait_for_running_trial(name, journal, proc, tmp_path / "launcher.log", 300, poll=0.2)
        assert trial is not None, "no worker ever ran a trial"
        killed = (trial.number, trial_worker_pid(trial))
        os.kill(killed[1], signal.SIGKILL)
        t_kill = time.monotonic()
        gate.mkdir(exist_ok=True)
        (gate / "go1").touch()
        code = finish(proc, tmp_path / "launcher.log")
        print(f"[figures] journal: launcher done {time.monotonic() - t_kill:.0f} s after the SIGKILL")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "launcher.log").read_text()
    assert code == 0, out[-4000:]
    assert f"(pid {killed[1]}) killed by SIGKILL; its trial(s) [{killed[0]}] failed and were queued again" in out
    study = optuna.load_study(study_name=name, storage=journal)
    trials = {t.number: t for t in study.trials}
    assert trials[killed[0]].state == S.FAIL
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed[0]]
    assert retry.state == S.COMPLETE and retry.params == trials[killed[0]].params
    assert sum(t.state == S.COMPLETE for t in study.trials) == 2 and not study.get_trials(states=(S.RUNNING, S.WAITING))
    client = MlflowClient(uri)
    dead = client.get_run(trials[killed[0]].user_attrs["mlflow_run_id"])
    assert dead.info.status == "FAILED" and dead.data.tags["optuna.state"] == "FAILED"


# ---- items 4 and 6: two launchers at once on a fresh store, and a re-run ---------------------------------------------
@pytest.mark.slow
def test_two_launchers_on_a_fresh_sqlite_store_propose_no_duplicates(corpus, tmp_path):
    """Two launchers on one host start at the same moment on a fresh SQLite MLflow store and sweeps database (same
    spec, same sampler seed): both finish, the store stays usable, and no two sampled trials share parameters; a
    re-run after that (a larger budget) proposes new points too."""
    name = f"dup-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(
        tmp_path / "d.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        fixed=FAST,
        space={"model.optim.lr": {"type": "float", "low": 1.0e-4, "high": 1.0e-2, "log": True}},
        budget={"n_trials": 4, "max_failed": 1},
    )
    storage, uri = f"sqlite:///{tmp_path / 'sweeps.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    procs = [launcher(spec, tmp_path, corpus, storage, uri, log=f"l{i}.log") for i in range(2)]
    codes = [finish(p, tmp_path / f"l{i}.log") for i, p in enumerate(procs)]
    assert codes == [0, 0], [(tmp_path / f"l{i}.log").read_text()[-3000:] for i in range(2)]
    study = optuna.load_study(study_name=name, storage=storage)
    first = trial_params(study)
    assert len(first) >= 4 and len(set(first)) == len(first), first
    assert len({t.user_attrs["sampler_seed"] for t in study.trials}) == 2  # one seed per worker process
    print(f"[figures] two launchers: {len(first)} sampled trials, {len(first) - len(set(first))} duplicates")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    parents = client.search_runs([exp.experiment_id], "tags.`optuna.role` = 'study'")
    assert len(parents) == 1  # the store is usable and both launchers share one parent run

    assert (
        sweep_main(
            [
                "run",
                str(spec),
                "--storage",
                storage,
                "--tracking-uri",
                uri,
                "--set",
                f"data.corpus={corpus}",
                "--set",
                f"trainer.default_root_dir={tmp_path / 'runs'}",
                "--n-trials",
                "6",
                "--spool-dir",
                str(tmp_path / "spool"),
            ]
        )
        == 0
    )
    again = trial_params(optuna.load_study(study_name=name, storage=storage))
    assert len(set(again)) == len(again) and set(first) < set(again)


PREPARE = """import os, sys, time
from pathlib import Path
from mhc_lightning.loggers.store import check_tracking, ensure_experiment
from mhc_lightning.sweeps.factories import make_storage
from mlflow import MlflowClient
gate, procs, rounds = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
for r, (uri, storage) in enumerate(zip(*[iter(rounds)] * 2)):
    # a barrier: every process starts the round at the same moment, once all of them are ready for it
    (gate / f"{r}-{os.getpid()}").touch()
    while len(ready := list(gate.glob(f"{r}-*"))) < procs:
        time.sleep(0.01)
    time.sleep(max(0.0, max(p.stat().st_mtime for p in ready) + 0.2 - time.time()))
    check_tracking(uri)
    ensure_experiment(MlflowClient(uri), "race")
    make_storage(storage, {"heartbeat_interval": 5, "grace_period": 10, "max_retry": 1})
"""


@pytest.mark.slow
def test_parallel_first_access_to_fresh_sqlite_stores(tmp_path):
    """What a launcher does first (tracking store, experiment, Optuna storage), by 4 processes at the same moment on
    fresh SQLite files, 3 rounds: every process succeeds and the stores stay usable (alembic's temporary tables used to
    collide and could leave the store unusable)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    rounds = [(f"sqlite:///{tmp_path / f'm{r}.db'}", f"sqlite:///{tmp_path / f's{r}.db'}") for r in range(3)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PREPARE, str(gate), "4", *[a for rnd in rounds for a in rnd]],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    for uri, storage in rounds:
        client = MlflowClient(uri)
        assert [e.name for e in client.search_experiments()].count("race") == 1
        client.create_run(client.get_experiment_by_name("race").experiment_id)  # usable
        optuna.create_study(storage=storage, study_name="s").optimize(lambda t: t.suggest_float("x", 0, 1), 1)
    print("[figures] parallel first access: 3 rounds x 4 processes, 0 failures")


@pytest.mark.slow
def test_only_the_studys_creator_makes_its_parent_run(tmp_path):
    """Launchers that start at once on a fresh store: only the one whose create_study made the study creates the MLflow
    parent run; the other waits for its id in the study's user attrs (CI once saw two parent runs when each
    launcher made one and saw the other's only after deciding), and makes a run of its own only if none comes."""
    import threading

    from mhc_lightning.sweeps.settings import Sweep
    from mhc_lightning.sweeps.spec import load_spec

    spec = load_spec(derived_spec(tmp_path / "p.yaml", f"parent-{uuid.uuid4().hex[:6]}", enqueue=[]))
    storage, uri = f"sqlite:///{tmp_path / 'sweeps.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    first, second = (Sweep(spec, storage, uri, str(tmp_path / "spool")) for _ in range(2))
    studies = [first.study(), second.study()]
    assert (first.created, second.created) == (True, False)
    got = {}
    waiter = threading.Thread(
        target=lambda: got.setdefault("second", second.tracker().ensure_parent(studies[1], creator=second.created))
    )
    waiter.start()
    time.sleep(1.0)  # the other launcher is waiting when the creator makes the run
    assert waiter.is_alive()
    got["first"] = first.tracker().ensure_parent(studies[0], spec, creator=first.created)
    waiter.join(timeout=60)
    assert got["first"] == got["second"]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(spec.mlflow["experiment"])
    assert len(client.search_runs([exp.experiment_id], "tags.`optuna.role` = 'study'")) == 1

    # a study whose creator never recorded a parent (it died first): the wait ends, and a run is found or made
    orphan = Sweep(
        load_spec(derived_spec(tmp_path / "o.yaml", f"orphan-{uuid.uuid4().hex[:6]}", enqueue=[])),
        storage,
        uri,
        str(tmp_path / "spool"),
    )
    orphan.study()
    late = Sweep(orphan.spec, storage, uri, str(tmp_path / "spool"))
    study = late.study()
    assert not late.created
    with pytest.warns(RuntimeWarning, match="recorded no MLflow parent run within 1 s"):
        pid = late.tracker().ensure_parent(study, creator=late.created, wait_s=1.0)
    assert optuna.load_study(study_name=orphan.spec.name, storage=storage).user_attrs["mlflow_parent_run_id"] == pid


# ---- item 5: a study stopped by max_failed continues once the cause is fixed -----------------------------------------
@pytest.mark.slow
def test_study_stopped_by_max_failed_continues_after_the_fix(corpus, tmp_path, capsys, mlflow_uri):
    name = f"maxf-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(
        tmp_path / "m.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        fixed=FAST,
        budget={"n_trials": 2, "max_failed": 1},
    )
    storage, uri = f"sqlite:///{tmp_path / 'sweeps.db'}", mlflow_uri  # a migrated store: migrations cost seconds
    common = [
        "run",
        str(spec),
        "--storage",
        storage,
        "--tracking-uri",
        uri,
        "--spool-dir",
        str(tmp_path / "spool"),
        "--set",
        f"trainer.default_root_dir={tmp_path / 'runs'}",
    ]
    assert sweep_main(common + ["--set", f"data.corpus={tmp_path / 'missing.txt'}"]) == 3
    out = capsys.readouterr().out
    assert "2 trials failed in this launch (budget.max_failed=1)" in out and "run the same command again" in out
    assert sweep_main(common + ["--set", f"data.corpus={corpus}"]) == 0
    study = optuna.load_study(study_name=name, storage=storage)
    assert sum(t.state == S.COMPLETE for t in study.trials) == 2 and sum(t.state == S.FAIL for t in study.trials) == 2
    print("[figures] max_failed: stopped after 2 failed trials (exit 3); after the fix 2/2 complete in the same study")


# ---- item 7: sweep-file mistakes found before, or at the first of, the trials ----------------------------------------
@pytest.mark.slow  # the `mhc fit` parser is built in the launcher: a few seconds
@fast_first(
    "change, named",
    [
        ({"fixed": {"trainer.max_stepz": 5}}, "trainer.max_stepz"),
        ({"space": {"model.optim.lrr": {"type": "float", "low": 1e-4, "high": 1e-2}}}, "model.optim.lrr"),
    ],
)
def test_unknown_fit_keys_are_refused_before_any_trial(change, named, corpus, tmp_path, capsys):
    name = f"keys-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(tmp_path / "k.yaml", name, enqueue=[], **change)
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    t0 = time.monotonic()
    assert (
        sweep_main(
            [
                "run",
                str(spec),
                "--storage",
                storage,
                "--tracking-uri",
                f"sqlite:///{tmp_path / 'm.db'}",
                "--set",
                f"data.corpus={corpus}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mhc sweep: error:")]
    assert len(lines) == 1 and named in lines[0] and "rejects the sweep's arguments" in lines[0], err
    assert time.monotonic() - t0 < 60
    assert optuna.get_all_study_names(storage) == []  # not one trial, not even a study
    assert not (tmp_path / "m.db").exists()  # nor an MLflow store
    print(f"[figures] unknown key {named}: refused after {time.monotonic() - t0:.1f} s, 0 trials")


@pytest.mark.slow
@fast_first("metric", ["val/los", "train/tokens_per_secc"])
def test_an_objective_metric_never_logged_stops_the_sweep_at_the_first_trial(metric, corpus, tmp_path, capsys):
    """val/* metrics are checked at the first validation, others at the end of the first trial: one trial, not
    budget.max_failed + 1 of them, and one line naming the metric."""
    name = f"metric-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(
        tmp_path / "o.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        fixed={"trainer.max_steps": 8, "trainer.val_check_interval": 2},
        objectives=[{"metric": metric, "direction": "minimize"}],
        budget={"n_trials": 4, "max_failed": 3},
    )
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    assert (
        sweep_main(
            [
                "run",
                str(spec),
                "--storage",
                storage,
                "--tracking-uri",
                f"sqlite:///{tmp_path / 'm.db'}",
                "--set",
                f"data.corpus={corpus}",
                "--set",
                f"trainer.default_root_dir={tmp_path / 'runs'}",
                "--spool-dir",
                str(tmp_path / "spool"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"mhc sweep: error: {spec}: objective metric(s) ['{metric}'] never logged" in err
    study = optuna.load_study(study_name=name, storage=storage)
    (trial,) = study.trials
    assert trial.state == S.FAIL
    print(f"[figures] objective {metric} never logged: 1 trial, sweep stopped")
    if metric.startswith("val/"):  # stopped at the first validation (step 2), not after all 8 steps
        run = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").get_run(trial.user_attrs["mlflow_run_id"])
        assert (
            max(
                m.step
                for m in MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").get_metric_history(
                    run.info.run_id, "train/loss"
                )
            )
            < 4
        )


# ---- item 4: duplicate proposals are not trained and do not count ----------------------------------------------------
@pytest.mark.slow
def test_duplicate_proposals_are_not_trained_and_do_not_count(corpus, tmp_path, capsys, mlflow_uri):
    """A space of two points and a budget of three: the two points train once each; the sampler's repeats are recorded
    as duplicates (no MLflow run, not an error) and the worker stops when it keeps proposing them."""
    name = f"exhaust-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(
        tmp_path / "e.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        fixed=FAST,
        space={"model.arch.hyper.residual_mode": {"type": "categorical", "choices": ["mhc", "hc"]}},
        budget={"n_trials": 3, "max_failed": 0},
    )
    storage, uri = f"sqlite:///{tmp_path / 'sweeps.db'}", mlflow_uri  # a migrated store: migrations cost seconds
    code = sweep_main(
        [
            "run",
            str(spec),
            "--storage",
            storage,
            "--tracking-uri",
            uri,
            "--set",
            f"data.corpus={corpus}",
            "--set",
            f"trainer.default_root_dir={tmp_path / 'runs'}",
            "--spool-dir",
            str(tmp_path / "spool"),
        ]
    )
    assert code == 1  # budget not met (the space has two points), and it said why
    assert "the space looks exhausted" in capsys.readouterr().err
    study = optuna.load_study(study_name=name, storage=storage)
    trained = [t for t in study.trials if t.user_attrs.get("duplicate_of") is None]
    dups = [t for t in study.trials if t.user_attrs.get("duplicate_of") is not None]
    assert sorted(t.params["model.arch.hyper.residual_mode"] for t in trained) == ["hc", "mhc"]
    assert all(t.state == S.COMPLETE for t in trained) and len(dups) >= 10 and all(t.state == S.FAIL for t in dups)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id], "tags.`optuna.role` = 'trial'")
    assert len(runs) == 2
    print(f"[figures] exhausted space: 2 trials trained, {len(dups)} duplicate proposals not trained")


def test_optuna_says_nothing_of_a_duplicate_proposal_and_still_names_a_failure():
    """The worker's filter on Optuna's log: a duplicate proposal's two warnings (one with a traceback) are dropped, a
    real failure's are kept."""
    from mhc_lightning.sweeps.objective import DuplicateTrial
    from mhc_lightning.sweeps.worker import quiet_duplicates

    def objective(trial):
        trial.suggest_categorical("x", ["only"])
        raise DuplicateTrial("same parameters") if trial.number < 3 else ValueError("a real failure")

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # optuna.logging's own handler, to stderr (pytest may add its capturing one)
    handler = next(h for h in logging.getLogger("optuna").handlers if type(h) is logging.StreamHandler)
    said = io.StringIO()
    stream = handler.setStream(said)
    try:
        quiet_duplicates()
        optuna.create_study().optimize(objective, n_trials=4, catch=(Exception,))
    finally:
        handler.setStream(stream)
    lines = said.getvalue().splitlines()
    assert not [line for line in lines if line.startswith("[W") and "Trial 3 " not in line], lines
    assert "Trial 3 failed with parameters" in lines[0] and "ValueError: a real failure" in said.getvalue()


# ---- a sweep whose every trial fails must end ------------------------------------------------------------------------
def test_a_step_of_zero_is_refused_by_mhc_sweep_before_anything_starts(corpus, tmp_path, monkeypatch, capsys):
    """`step: 0` passed validation; every trial then failed in suggest_float and the sweep never ended (~800 failed
    trials in 5 minutes). Now: one line naming the key, exit 2, no study, no store."""
    spec = derived_spec(
        tmp_path / "s.yaml",
        f"step0-{uuid.uuid4().hex[:6]}",
        enqueue=[],
        space={"model.optim.lr": {"type": "float", "low": 1e-3, "high": 1e-2, "step": 0}},
    )
    storage, uri = f"sqlite:///{tmp_path / 'sweeps.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)  # in this process: refused before anything starts, a process adds only its start-up
    capsys.readouterr()
    code = sweep_main(["run", str(spec), "--storage", storage, "--tracking-uri", uri, "--set", f"data.corpus={corpus}"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"mhc sweep: error: {spec}: space.model.optim.lr.step: must be a number > 0, got 0"
    ]
    assert not (tmp_path / "sweeps.db").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_trials_that_fail_before_recording_an_error_still_stop_at_max_failed(tmp_path, monkeypatch):
    """Whatever makes a trial fail counts toward budget.max_failed. A trial that raised before its error was recorded
    (here in sampling: a distribution forced past validation) looked like a killed worker's and never counted."""
    from mhc_lightning.sweeps.settings import Sweep
    from mhc_lightning.sweeps.spec import load_spec
    from mhc_lightning.sweeps.worker import run_worker

    monkeypatch.chdir(tmp_path)  # a SQLite store's artifacts go to ./mlruns
    path = derived_spec(
        tmp_path / "f.yaml",
        f"fail-{uuid.uuid4().hex[:6]}",
        enqueue=[],
        pruner={"name": "none"},
        budget={"n_trials": 4, "max_failed": 2, "timeout_s": 30},
    )
    spec = load_spec(path)
    next(p for p in spec.space if p.key == "model.optim.lr").step = 0
    storage, uri = f"sqlite:///{tmp_path / 'sweeps.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = Sweep(spec, storage, uri, str(tmp_path / "spool"))
    sweep.tracker().ensure_parent(sweep.study(), spec, creator=sweep.created)
    t0 = time.monotonic()
    assert run_worker(sweep, 0, 0, since=time.time()) == 3  # max_failed, not the worker's 30 s timeout
    trials = optuna.load_study(study_name=spec.name, storage=storage).trials
    assert len(trials) == 3 and all(t.state == S.FAIL for t in trials)
    assert all("step" in t.user_attrs["error"] for t in trials), [t.user_attrs for t in trials]
    print(f"[figures] trials failing in sampling: stopped after {len(trials)} trials, {time.monotonic() - t0:.1f} s")
