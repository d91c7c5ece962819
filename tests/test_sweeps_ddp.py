"""Sweeps whose trials are child `mhc fit` processes (`trial.launcher: subprocess`), here 2-process DDP on CPU (gloo).

The sweep worker runs in the test process (`sweeps.cli.main`); each trial starts `mhc fit` as a child, and Lightning
starts the second rank from it, as in tests/test_distributed.py. Spec checks of the `trial` block are at the end.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from helpers import CONF, REPO
from mlflow import MlflowClient

from mhc_lightning.fit import child_processes
from mhc_lightning.sweeps.cli import main as sweep_main
from mhc_lightning.sweeps.spec import SpecError, parse_spec
from mhc_lightning.sweeps.trial_args import trial_args

S = optuna.trial.TrialState
TINY = {
    "model.arch.n_layers": 2,
    "model.arch.d_model": 32,
    "model.arch.n_heads": 2,
    "model.optim.warmup_steps": 0,
    "data.seq_len": 32,
    "data.batch_size": 4,
    "trainer.max_steps": 4,
    "trainer.val_check_interval": 2,
    "trainer.limit_val_batches": 2,
    "model.diagnostics_every": 0,  # no per-layer figures: seconds per validation, and nothing here reads them
}


def ddp_spec(name: str, **over) -> dict:
    spec = {
        "name": name,
        "base": [str(CONF / "base.yaml"), str(CONF / "model" / "mhc.yaml"), str(CONF / "presets" / "debug.yaml")],
        "trial": {"launcher": "subprocess", "args": ["-c", str(CONF / "machine" / "ddp-cpu.yaml")], "timeout_s": 300},
        "fixed": dict(TINY),
        "space": {"model.optim.lr": {"type": "float", "low": 1.0e-5, "high": 3.0e-2, "log": True}},
        "objectives": [{"metric": "val/loss", "direction": "minimize"}],
        "sampler": {"name": "random", "seed": 0},
        "storage": {"heartbeat_interval": 5, "grace_period": 120},
    }
    spec.update(over)
    return spec


def run_sweep(tmp_path: Path, mlflow_uri: str, spec: dict, *sets: str):
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    argv = [
        "run",
        str(path),
        "--tracking-uri",
        mlflow_uri,
        "--storage",
        storage,
        "--spool-dir",
        str(tmp_path / "spool"),
        "--set",
        f"trainer.default_root_dir={tmp_path / 'runs'}",
        *[a for s in sets for a in ("--set", s)],
    ]
    code = sweep_main(argv)
    study = optuna.load_study(study_name=spec["name"], storage=storage)
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name(spec["name"])
    runs = client.search_runs([exp.experiment_id])
    trial_runs = {int(r.data.tags["optuna.trial"]): r for r in runs if r.data.tags.get("optuna.role") == "trial"}
    assert len(runs) == 1 + len(study.trials), "one parent run and one run per trial, none per rank"
    assert len(trial_runs) == len(study.trials)
    return code, study, client, trial_runs


def leftover_processes(tmp_path: Path) -> list[str]:
    """`mhc fit` ranks still alive: every rank's command line names the trial's files under tmp_path."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != psutil.Process().pid and str(tmp_path) in cmd and " fit " in cmd:
            out.append(cmd[:200])
    return out


def log_text(client, run_id: str, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run_id, "trial.log", str(tmp_path))).read_text()


@pytest.mark.slow
def test_ddp_trials_complete_and_prune(tiny_corpus, mlflow_uri, tmp_path):
    """Trial 0 (lr 3e-2) completes; trial 1 (lr 1e-5, worse at the first validation) is pruned by the median pruner
    from inside its DDP child. One MLflow run per trial, written by rank 0; no rank outlives its trial."""
    spec = ddp_spec(
        "ddp-sweep",
        enqueue=[{"model.optim.lr": 3.0e-2}, {"model.optim.lr": 1.0e-5}],
        pruner={"name": "median", "options": {"n_startup_trials": 1, "n_warmup_steps": 0}},
        budget={"n_trials": 2, "max_failed": 0},
    )
    code, study, client, runs = run_sweep(tmp_path, mlflow_uri, spec, f"data.corpus={tiny_corpus}")
    assert code == 0
    assert not leftover_processes(tmp_path)
    done, pruned = study.trials
    assert done.state == S.COMPLETE and math.isfinite(done.value), done.user_attrs
    assert pruned.state == S.PRUNED, pruned.user_attrs
    # intermediate values come from the child's rank 0, through the study's storage
    assert sorted(done.intermediate_values) == [2, 4] and done.intermediate_values[4] == pytest.approx(done.value)
    assert list(pruned.intermediate_values) == [2]

    for t in (done, pruned):
        run = runs[t.number]
        assert run.info.run_id == t.user_attrs["mlflow_run_id"] and run.info.status == "FINISHED"
        assert run.data.tags["optuna.state"] == t.state.name
        assert run.data.params["trial.model.optim.lr"] == str(t.params["model.optim.lr"])
        assert {"config.yaml", "trial_command.txt", "trial.log"} <= {
            a.path for a in client.list_artifacts(run.info.run_id)
        }
        log = log_text(client, run.info.run_id, tmp_path / str(t.number))
        assert "Starting with 2 processes" in log and "MEMBER: 2/2" in log  # it really was a 2-rank DDP run
    run = runs[done.number]
    # the value is the metric rank 0 logged (val/loss is reduced over ranks), and it is on the run as the objective
    assert run.data.metrics["val/loss"] == pytest.approx(done.value, rel=1e-6)
    assert run.data.metrics["objective/val/loss"] == pytest.approx(done.value, rel=1e-6)
    history = client.get_metric_history(run.info.run_id, "val/loss")
    assert sorted(m.step for m in history) == [1, 3]  # once per validation (Lightning logs step-1), not once per rank
    assert runs[pruned.number].data.tags["optuna.pruned_at_step"] == "2"
    assert "DDPStrategy" in Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()


@pytest.mark.slow
def test_failing_child_fails_the_trial_with_its_log(mlflow_uri, tmp_path):
    """A child that fails at fit time (the corpus is missing) makes the trial FAIL, with the end of the child's log
    in the trial's error and the run's optuna.error tag, and the whole log as the run's trial.log. One process:
    a DDP child fails the same way, only later (test above for DDP)."""
    missing = tmp_path / "no_such_corpus.txt"
    spec = ddp_spec(
        "child-fail", trial={"launcher": "subprocess", "timeout_s": 300}, budget={"n_trials": 1, "max_failed": 0}
    )
    code, study, client, runs = run_sweep(tmp_path, mlflow_uri, spec, f"data.corpus={missing}")
    assert code == 3  # budget.max_failed exceeded: the worker stops
    assert not leftover_processes(tmp_path)
    (t,) = study.trials
    assert t.state == S.FAIL
    error = t.user_attrs["error"]
    assert "`mhc fit` exited with code 2" in error and f"corpus path {missing} does not exist" in error
    run = runs[t.number]
    assert run.data.tags["optuna.state"] == "FAILED" and run.info.status == "FAILED"
    assert f"corpus path {missing} does not exist" in run.data.tags["optuna.error"]
    assert f"mhc fit: error: corpus path {missing} does not exist" in log_text(client, run.info.run_id, tmp_path)


# ---- the `trial` block of a sweep file ------------------------------------------------------------
def test_trial_block_is_validated_and_its_args_follow_the_base_configs():
    relative = {"launcher": "subprocess", "args": ["-c", "conf/machine/ddp-cpu.yaml"], "timeout_s": 300}
    spec = parse_spec(ddp_spec("x", trial=relative), REPO / "sweeps" / "x.yaml")  # resolved like base: cwd, else repo
    assert spec.trial["launcher"] == "subprocess" and spec.trial["timeout_s"] == 300
    args = trial_args(spec, {"model.optim.lr": 1e-3})
    assert args[6:8] == ["-c", str(CONF / "machine" / "ddp-cpu.yaml")]  # after the 3 base configs, before the values
    assert parse_spec(ddp_spec("x", trial=None)).trial == {"launcher": "in_process", "args": [], "timeout_s": None}
    for trial, expected in (
        ({"launcher": "ddp"}, ["trial.launcher", "'ddp'", "['in_process', 'subprocess']"]),
        ({"launcher": "subprocess", "args": "-c x.yaml"}, ["trial.args", "list"]),
        ({"launcher": "subprocess", "args": ["-c", "conf/nope.yaml"]}, ["trial.args[1]", "not found"]),
        ({"launcher": "subprocess", "timeout_s": 0}, ["trial.timeout_s", "> 0"]),
        ({"launcher": "in_process", "timeout_s": 10}, ["trial.timeout_s", "subprocess"]),
        ({"launcher": "subprocess", "nodes": 2}, ["trial", "unknown key(s) ['nodes']"]),
    ):
        with pytest.raises(SpecError) as err:
            parse_spec(ddp_spec("x", trial=trial), Path("sweeps/x.yaml"))
        for piece in expected:
            assert piece in str(err.value), str(err.value)


def test_in_process_trial_refuses_several_processes(tmp_path, monkeypatch):
    """Lightning would start the other ranks by re-running the worker's own command line (`mhc sweep`)."""
    from mhc_lightning.sweeps.objective import TrialConfigError, TrialRunner

    monkeypatch.chdir(tmp_path)
    spec = parse_spec(ddp_spec("x", trial={"args": ["-c", str(CONF / "machine" / "ddp-cpu.yaml")]}))
    args = trial_args(spec, {"model.optim.lr": 1e-3}) + ["--trainer.logger=false"]
    with pytest.raises(TrialConfigError, match="asks for 2 processes.*launcher: subprocess"):
        TrialRunner(spec, None, "", {}, "")._fit_in_process(None, "run", args, ["val/loss"])


# ---- no process outlives its trial (stand-in children: plain Python, no torch) -------------------
def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(paths: list[Path], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not all(p.is_file() and p.read_text() for p in paths):
        assert time.monotonic() < deadline, "stand-in processes did not start"
        time.sleep(0.05)
    return [int(p.read_text()) for p in paths]


def _survivors(pids: list[int], wait: float = 0.0) -> list[int]:
    """The pids still alive after up to `wait` seconds; they are killed, so a failing test leaves nothing behind."""
    deadline = time.monotonic() + wait
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


# Stand-in for a rank: records its pid, calls die_with_parent (as `mhc` does first thing in every rank), starts the next
# process of the chain (as rank 0 starts rank 1) and sleeps. argv ends with: directory, processes left.
STAND_IN = """import os, subprocess, sys, time
from mhc_lightning.fit.child_processes import die_with_parent
die_with_parent()
d, n = sys.argv[-2], int(sys.argv[-1])
if n > 1:
    subprocess.Popen([sys.executable, __file__, d, str(n - 1)])
open(os.path.join(d, f"pid{n}"), "w").write(str(os.getpid()))
print(f"process {n} up", flush=True)
time.sleep(120)
"""


def _stand_in(tmp_path: Path) -> list[str]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return [sys.executable, str(script)]


@pytest.mark.slow
def test_timeout_stops_the_childs_whole_process_group(tmp_path, monkeypatch):
    """A child past trial.timeout_s (or interrupted: the same path) is stopped with every process it started."""
    with pytest.raises(
        child_processes.ChildFailed, match=r"ran past its timeout of 3 s and was stopped(.|\n)*process 2 up"
    ):
        child_processes.run(_stand_in(tmp_path) + [str(tmp_path), "2"], tmp_path / "trial.log", timeout_s=3)
    assert not _survivors(_wait_for([tmp_path / "pid1", tmp_path / "pid2"]))


@pytest.mark.slow
def test_sigkilled_worker_takes_its_ranks_along(tmp_path):
    """SIGKILL leaves the worker no chance to stop its child; every rank then dies with its parent."""
    worker = (
        f"import os, subprocess, time; os.environ[{child_processes.PARENT_ENV!r}] = str(os.getpid()); "
        f"subprocess.Popen({_stand_in(tmp_path) + [str(tmp_path), '2']!r}); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", worker])
    try:
        pids = _wait_for([tmp_path / "pid1", tmp_path / "pid2"])
        assert all(_alive(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()
    assert not _survivors(pids, wait=10)
