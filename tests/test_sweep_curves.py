"""optuna-dashboard's learning curves: every single-objective trial reports its intermediate values, with or
without a pruner."""

from __future__ import annotations

import shutil

import optuna
import pytest
from helpers import derived_spec, make_text

from mhc_lightning.sweeps.cli import main as sweep_main


@pytest.mark.slow
def test_a_study_without_pruner_reports_every_validation(tmp_path, _mlflow_template, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(60_000, seed=7))
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")
    spec = derived_spec(
        tmp_path / "curves.yaml",
        "curves",
        pruner={"name": "none"},
        budget={"n_trials": 1},
        enqueue=[
            {"model.arch.hyper.residual_mode": "mhc", "model.arch.hyper.sinkhorn_iters": 5, "model.optim.lr": 1e-2}
        ],
    )
    monkeypatch.chdir(tmp_path)
    code = sweep_main(
        [
            "run",
            str(spec),
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--set",
            f"data.corpus={corpus}",
            "--set",
            f"trainer.default_root_dir={tmp_path / 'runs'}",
            "--spool-dir",
            str(tmp_path / "spool"),
        ]
    )
    assert code == 0
    (trial,) = optuna.load_study(study_name="curves", storage=f"sqlite:///{tmp_path / 'sweeps.db'}").trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert sorted(trial.intermediate_values) == [2, 4, 6]  # val/loss at each validation, on the optimizer step
    assert trial.intermediate_values[6] == pytest.approx(trial.value)  # the objective: the last val/loss
