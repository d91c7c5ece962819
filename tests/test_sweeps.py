"""A 4-trial CPU sweep on SQLite (one worker, in process): MLflow parent/child runs, pruning, best trial,
Optuna plots, resuming, and `mhc compare` on the sweep's runs."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import optuna
import pytest
from helpers import REPO, make_text
from mlflow import MlflowClient

from mhc_lightning.sweeps.cli import main as sweep_main

SMOKE = REPO / "sweeps" / "smoke.yaml"


pytestmark = pytest.mark.slow  # a real 4-trial sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, _mlflow_template):
    """Run sweeps/smoke.yaml once for the module: 4 trials, 6 steps each, median pruner from the second trial."""
    root = tmp_path_factory.mktemp("sweep")
    corpus = root / "corpus.txt"
    corpus.write_text(make_text(60_000, seed=7))
    shutil.copy(_mlflow_template, root / "mlflow.db")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    argv = [
        "run",
        str(SMOKE),
        "--tracking-uri",
        uri,
        "--set",
        f"data.corpus={corpus}",
        "--set",
        f"trainer.default_root_dir={root / 'runs'}",
        "--spool-dir",
        str(root / "spool"),
    ]
    mp = pytest.MonkeyPatch()
    mp.chdir(root)  # MLflow's sqlite store puts artifacts under ./mlruns
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = sweep_main(argv)
    finally:
        mp.undo()
    storage = f"sqlite:///{root / 'sweeps.db'}"  # the default: beside the MLflow store
    return {
        "root": root,
        "uri": uri,
        "storage": storage,
        "argv": argv,
        "code": code,
        "corpus": corpus,
        "stdout": out.getvalue(),
    }


def _children(client, study="smoke"):
    exp = client.get_experiment_by_name(study)
    runs = client.search_runs([exp.experiment_id], f"tags.`optuna.study_name` = '{study}'")
    parents = [r for r in runs if r.data.tags.get("optuna.role") == "study"]
    return parents, [r for r in runs if r.data.tags.get("optuna.role") == "trial"]


def test_sqlite_sweep_end_to_end(sweep, capsys):
    """One test on purpose: under `pytest -n 2`, tests sharing a module fixture may land on both xdist workers
    and run the sweep twice."""
    check_records(sweep)
    check_resume(sweep)
    check_compare(sweep)


def check_records(sweep):
    assert sweep["code"] == 0
    study = optuna.load_study(study_name="smoke", storage=sweep["storage"])
    states = [t.state for t in study.trials]
    S = optuna.trial.TrialState
    assert len(study.trials) == 4 and states.count(S.COMPLETE) + states.count(S.PRUNED) == 4
    assert states.count(S.PRUNED) >= 1  # trial 1 (lr 1e-5, enqueued) is worse than trial 0 at step 2
    assert states[0] == S.COMPLETE
    pruned = next(t for t in study.trials if t.state == S.PRUNED)
    assert list(pruned.intermediate_values) == [2]  # reported on global_step (val every 2 steps), not epoch 0

    client = MlflowClient(sweep["uri"])
    parents, children = _children(client)
    assert len(parents) == 1 and len(children) == 4
    # the experiment the sweep created opens in MLflow's training-runs view, not the GenAI one
    assert client.get_experiment_by_name("smoke").tags["mlflow.experimentKind"] == "custom_model_development"
    parent = parents[0]
    assert study.user_attrs["mlflow_parent_run_id"] == parent.info.run_id
    by_trial = {int(r.data.tags["optuna.trial"]): r for r in children}
    assert sorted(by_trial) == [t.number for t in study.trials]
    for t in study.trials:
        run = by_trial[t.number]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.run_id == t.user_attrs["mlflow_run_id"]
        assert run.data.tags["optuna.state"] == t.state.name.replace("FAIL", "FAILED")
        assert run.info.status == "FINISHED"
        for k, v in t.params.items():
            assert run.data.params[f"trial.{k}"] == str(v)
        arts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "trial_command.txt"} <= arts
    best = study.best_trial
    assert by_trial[best.number].data.metrics["objective/val/loss"] == pytest.approx(best.value)
    assert parent.data.tags["best.trial"] == str(best.number)
    assert parent.data.tags["best.run_id"] == best.user_attrs["mlflow_run_id"]
    assert parent.data.metrics["best/val/loss"] == pytest.approx(best.value)
    assert parent.data.tags["sweep.status"] == "complete" and parent.info.status == "FINISHED"
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert "plots/history.png" in plots and "plots/parallel_coordinate.png" in plots
    assert {"best_trial.json", "trials.csv", "sweep.yaml"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id)
    }

    # every line about a trial says which trial it is: the worker's, and the fit's own progress lines
    lines = sweep["stdout"].splitlines()
    for t in study.trials:
        assert any(ln.startswith(f"[worker 0.0, trial {t.number}] started: ") for ln in lines), sweep["stdout"]
        end = "complete: val/loss " if t.state == S.COMPLETE else "pruned at step 2"
        assert any(ln.startswith(f"[worker 0.0, trial {t.number}] {end}") for ln in lines), sweep["stdout"]
    assert any(ln.startswith("[mhc fit, trial 0] step 2/") for ln in lines), sweep["stdout"]
    assert not any(ln.startswith("[mhc fit] ") for ln in lines), sweep["stdout"]

    # the trial is what `mhc fit` would run: its command line is the base configs plus the trial's values
    cmd = Path(client.download_artifacts(by_trial[0].info.run_id, "trial_command.txt", str(sweep["root"]))).read_text()
    assert cmd.startswith("mhc fit --config ") and "--model.optim.lr=0.01" in cmd


def check_resume(sweep):
    """The same command again runs nothing new; a larger budget continues the same study and parent run."""
    mp = pytest.MonkeyPatch()
    mp.chdir(sweep["root"])
    try:
        assert sweep_main(sweep["argv"]) == 0
        assert len(optuna.load_study(study_name="smoke", storage=sweep["storage"]).trials) == 4
        assert sweep_main(sweep["argv"] + ["--n-trials", "5"]) == 0
    finally:
        mp.undo()
    study = optuna.load_study(study_name="smoke", storage=sweep["storage"])
    done = [t for t in study.trials if t.state.is_finished() and t.state != optuna.trial.TrialState.FAIL]
    assert len(study.trials) == 5 and len(done) == 5
    # both launches ran in this process, one worker each: the second drew from a stream of its own, not a replay
    first, second = {t.user_attrs["sampler_seed"] for t in study.trials[:4]}, study.trials[4].user_attrs["sampler_seed"]
    assert len(first) == 1 and second not in first
    parents, children = _children(MlflowClient(sweep["uri"]))
    assert len(parents) == 1 and len(children) == 5


def check_compare(sweep):
    from mhc_lightning.reports.cli import main as compare_main

    out = sweep["root"] / "report"
    assert compare_main(["--study", "smoke", "--tracking-uri", sweep["uri"], "--out", str(out)]) == 0
    md = (out / "runs.md").read_text()
    assert md.count("\n") >= 2 + 4 and "val/loss" in md and "residual_mode" in md
    csv_lines = (out / "runs.csv").read_text().splitlines()
    assert len(csv_lines) >= 1 + 4
    for name in ("val_loss", "grad_norm", "tokens_per_sec", "amax_vs_layer"):
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    img = mpimg.imread(out / "val_loss.png")[..., :3]
    # curves: the best run's line in matplotlib's first colour (C0), and the other runs' markers in C1..C3
    tab = [(0.12, 0.47, 0.71), (1.0, 0.50, 0.05), (0.17, 0.63, 0.17), (0.84, 0.15, 0.16)]
    px = [int((np.abs(img - np.array(rgb)).max(axis=-1) < 0.06).sum()) for rgb in tab]
    assert px[0] > 500 and sum(p > 20 for p in px) >= 3, px
    client = MlflowClient(sweep["uri"])
    parent = _children(client)[0][0]
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
    assert {"comparison/runs.md", "comparison/val_loss.png", "comparison/amax_vs_layer.png"} <= logged
