"""Sweep files: validation messages, sampling, the `mhc fit` arguments of a trial, storages and seeds (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import REPO, fast_first

from mhc_lightning.loggers.store import redact
from mhc_lightning.sweeps import factories, liveness
from mhc_lightning.sweeps.cli import _parse_set
from mhc_lightning.sweeps.cli import main as sweep_main
from mhc_lightning.sweeps.settings import counts
from mhc_lightning.sweeps.spec import SpecError, load_spec, parse_spec
from mhc_lightning.sweeps.trial_args import check_callbacks, sample, trial_args
from mhc_lightning.sweeps.worker import worker_seed

SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))


def minimal(**over) -> dict:
    d = {
        "name": "t",
        "base": [str(REPO / "conf" / "base.yaml")],
        "space": {"model.optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
    }
    d.update(over)
    return d


@fast_first("path", SWEEPS, ids=lambda p: p.name)
def test_shipped_sweeps_load(path):
    spec = load_spec(path)
    assert spec.space and spec.objectives and spec.n_trials >= 1
    factories.make_sampler(spec, 0)
    factories.make_pruner(spec)


def test_shipped_sweeps_cover_the_issue_space():
    spec = load_spec(REPO / "sweeps" / "constraint_intensity.yaml")
    keys = {p.key for p in spec.space}
    assert {
        "model.arch.hyper.sinkhorn_iters",
        "callbacks.SinkhornScheduler.intensity",
        "model.arch.hyper.alpha_init",
        "model.arch.hyper.bias_init",
        "model.arch.hyper.n_streams",
        "model.optim.lr",
        "model.arch.hyper.residual_mode",
    } <= keys
    assert next(p for p in spec.space if p.key == "model.arch.hyper.residual_mode").type == "categorical"
    assert load_spec(REPO / "sweeps" / "loss_vs_amax.yaml").multi_objective


@fast_first(
    "over, expected",
    [
        ({"sampler": {"name": "annealing"}}, ["sampler.name", "'annealing'", "tpe", "nsga2"]),
        ({"pruner": {"name": "median", "extra": 1}}, ["pruner", "unknown key(s) ['extra']", "options"]),
        (
            {"space": {"model.arch.hyper.bias_init": {"type": "categorical", "choices": ["zeros", "ones"]}}},
            ["space.model.arch.hyper.bias_init.choices", "['ones']", "hc_identity", "near_identity"],
        ),
        (
            {"space": {"model.arch.hyper.sinkhorn_iter": {"type": "int", "low": 1, "high": 9}}},
            ["space.model.arch.hyper.sinkhorn_iter", "HyperConfig has no field 'sinkhorn_iter'", "sinkhorn_iters"],
        ),
        (
            {"space": {"model.arch.hyper.residual_mode": {"type": "float", "low": 0, "high": 1}}},
            ["residual_mode.type", "must be categorical", "identity"],
        ),
        (
            {"space": {"model.optim.lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}},
            ["space.model.optim.lr.low", "> 0 with log"],
        ),
        (
            {"space": {"model.optim.lr": {"type": "normal", "low": 0.0, "high": 1.0}}},
            ["space.model.optim.lr.type", "'normal'", "categorical"],
        ),
        (
            {"space": {"optim.lr": {"type": "float", "low": 0.1, "high": 1.0}}},
            ["space.optim.lr", "not a `mhc fit` key"],
        ),
        (
            {"objectives": [{"metric": "val/loss", "direction": "down"}]},
            ["objectives[0].direction", "minimize", "maximize"],
        ),
        (
            {
                "objectives": ["val/loss", {"metric": "amax/composite_bwd_max", "reduce": "max"}],
                "pruner": {"name": "median"},
            },
            ["pruner.name", "multi-objective"],
        ),
        ({"name": "two words"}, ["name", "without spaces"]),
        ({"base": ["conf/nope.yaml"]}, ["base[0]", "nope.yaml", "not found"]),
        ({"budget": {"n_trials": 0}}, ["budget.n_trials", ">= 1"]),
        ({"budget": {"max_failed": -1}}, ["budget.max_failed", "must be an integer >= 0", "got -1"]),
        ({"budget": {"timeout_s": -5}}, ["budget.timeout_s", "> 0 per worker, or null, got -5"]),
        ({"name": "s" * 300}, ["name", "too long for a file name: 300 bytes, at most 255"]),
        ({"name": "s" * 246}, ["name", "too long for an MLflow run name (its trials' runs", "252 characters"]),
        ({"enqueue": [{"model.optim.momentum": 0.9}]}, ["enqueue[0].model.optim.momentum", "not a key of space"]),
    ],
)
def test_errors_name_the_field_and_allowed_values(over, expected):
    with pytest.raises(SpecError) as err:
        parse_spec(minimal(**over), Path("sweeps/x.yaml"))
    for piece in expected:
        assert piece in str(err.value), str(err.value)


LR = "model.optim.lr"
ITERS = "model.arch.hyper.sinkhorn_iters"


@fast_first(
    "key, dist, field, says",
    [
        (LR, {"type": "float", "low": 1e-4, "high": 1e-2, "step": 0}, "step", "a number > 0, got 0"),
        (LR, {"type": "float", "low": 1e-4, "high": 1e-2, "step": -0.001}, "step", "a number > 0"),
        (LR, {"type": "float", "low": 1e-4, "high": 1e-2, "step": float("inf")}, "step", "a number > 0"),
        (ITERS, {"type": "int", "low": 1, "high": 9, "step": -2}, "step", "an integer >= 1, got -2"),
        (ITERS, {"type": "int", "low": 1, "high": 9, "step": 0}, "step", "an integer >= 1, got 0"),
        (ITERS, {"type": "int", "low": 1, "high": 9, "step": 0.5}, "step", "an integer >= 1, got 0.5"),
        (ITERS, {"type": "int", "low": 1, "high": 9, "step": True}, "step", "an integer >= 1, got True"),
        (LR, {"type": "float", "low": 0.0, "high": 1.0, "log": True}, "low", "> 0 with log: true"),
        (LR, {"type": "float", "low": -1.0, "high": 1.0, "log": True}, "low", "> 0 with log: true"),
        (ITERS, {"type": "int", "low": 0, "high": 9, "log": True}, "low", ">= 1 with log: true"),
        (LR, {"type": "float", "low": 1e-2, "high": 1e-4}, "low", "must be <= high"),
        (LR, {"type": "float", "low": float("nan"), "high": 1e-2}, "low", "finite number"),
        (LR, {"type": "float", "low": 1e-4, "high": float("inf")}, "high", "finite number"),
        (ITERS, {"type": "int", "low": 1.5, "high": 9}, "low", "an integer"),
        (LR, {"type": "float", "low": 1e-4, "high": 1e-2, "log": "yes"}, "log", "true or false"),
        (LR, {"type": "float", "low": 1e-4, "high": 1e-2, "log": True, "step": 1e-4}, "step", "log: true"),
        ("model.arch.hyper.residual_mode", {"type": "categorical", "choices": []}, "choices", "non-empty list"),
        (
            "model.optim.warmup_steps",
            {"type": "categorical", "choices": [[1, 2], 3]},
            "choices",
            "[[1, 2]] not allowed",
        ),
        ("model.optim.warmup_steps", {"type": "categorical", "choices": [1], "log": True}, "log", "not used"),
    ],
)
def test_degenerate_distributions_are_refused_naming_the_key(key, dist, field, says):
    """Each of these passed validation and failed every trial in `suggest_*`."""
    with pytest.raises(SpecError) as err:
        parse_spec(minimal(space={key: dist}), Path("sweeps/x.yaml"))
    msg = str(err.value)
    assert msg.startswith(f"sweeps/x.yaml: space.{key}.{field}: ") and says in msg and "\n" not in msg, msg


def test_distributions_optuna_accepts_still_load():
    space = {
        ITERS: {"type": "int", "low": 2, "high": 2, "step": 3},  # one point, a step wider than the range
        LR: {"type": "float", "low": 1e-3, "high": 1e-2, "step": 1e-3},
        "model.optim.warmup_steps": {"type": "categorical", "choices": [0, None, "10"]},
    }
    spec = parse_spec(minimal(space=space), Path("sweeps/x.yaml"))
    values = sample(optuna.create_study().ask(), spec)
    assert values[ITERS] == 2 and 1e-3 <= values[LR] <= 1e-2


def test_conditions_must_name_earlier_params():
    space = {
        "model.arch.hyper.sinkhorn_iters": {
            "type": "int",
            "low": 1,
            "high": 5,
            "when": {"model.arch.hyper.residual_mode": ["mhc"]},
        },
        "model.arch.hyper.residual_mode": {"type": "categorical", "choices": ["mhc", "hc"]},
    }
    with pytest.raises(SpecError, match="must be listed before"):
        parse_spec(minimal(space=space))


def test_conditional_sampling_and_trial_args():
    spec = parse_spec(
        minimal(
            fixed={"trainer.max_steps": 7, "data.corpus": "/x/y.txt"},
            space={
                "model.arch.hyper.residual_mode": {"type": "categorical", "choices": ["mhc", "residual"]},
                "model.arch.hyper.sinkhorn_iters": {
                    "type": "int",
                    "low": 3,
                    "high": 3,
                    "when": {"model.arch.hyper.residual_mode": ["mhc"]},
                },
                "callbacks.SinkhornScheduler.intensity": {
                    "type": "float",
                    "low": 1.5,
                    "high": 1.5,
                    "optional": True,
                    "when": {"model.arch.hyper.residual_mode": ["mhc"]},
                },
            },
        )
    )
    study = optuna.create_study()
    study.enqueue_trial({"model.arch.hyper.residual_mode": "residual"})
    study.enqueue_trial({"model.arch.hyper.residual_mode": "mhc"})
    residual = sample(study.ask(), spec)
    assert residual == {"model.arch.hyper.residual_mode": "residual"}  # the mhc-only parameters are skipped
    values = sample(study.ask(), spec)
    assert values["model.arch.hyper.sinkhorn_iters"] == 3
    args = trial_args(spec, values, {"class_path": "L", "init_args": {}})
    assert args[:2] == ["--config", str(REPO / "conf" / "base.yaml")]
    assert "--trainer.max_steps=7" in args and "--data.corpus=/x/y.txt" in args
    assert "--model.arch.hyper.residual_mode=mhc" in args and "--model.arch.hyper.sinkhorn_iters=3" in args
    assert "--trainer.enable_progress_bar=false" in args
    cb = [a for a in args if a.startswith("--trainer.callbacks+=")]
    assert len(cb) == 1
    cb = json.loads(cb[0].split("=", 1)[1])
    assert cb["class_path"].endswith("SinkhornScheduler") and cb["init_args"] == {"intensity": 1.5}
    assert args[-1].startswith("--trainer.logger=")


def test_missing_optional_callback_is_skipped_and_required_one_is_an_error(tmp_path):
    space = {
        "model.optim.lr": {"type": "float", "low": 1e-3, "high": 1e-2},
        "callbacks.NoSuchScheduler.intensity": {"type": "float", "low": 0, "high": 1, "optional": True},
    }
    spec = parse_spec(minimal(space=space))
    warnings = check_callbacks(spec)
    assert "callbacks.NoSuchScheduler.intensity" in spec.skipped and "optional" in warnings[0]
    assert set(sample(optuna.create_study().ask(), spec)) == {"model.optim.lr"}
    space["callbacks.NoSuchScheduler.intensity"]["optional"] = False
    with pytest.raises(SpecError, match="not found in mhc_lightning.callbacks"):
        check_callbacks(parse_spec(minimal(space=space)))
    bad_arg = {
        "callbacks.lightning.pytorch.callbacks.LearningRateMonitor.intensity": {"type": "float", "low": 0, "high": 1}
    }
    with pytest.raises(SpecError, match="takes no argument 'intensity'"):
        check_callbacks(parse_spec(minimal(space=bad_arg)))


def test_set_overrides_and_yaml_file(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(minimal(fixed={"trainer.max_steps": 5})))
    spec = load_spec(p, _parse_set(["trainer.max_steps=9", "data.corpus=/a b.txt"]))
    assert spec.fixed == {"trainer.max_steps": 9, "data.corpus": "/a b.txt"}
    assert spec.raw_text.startswith("base:") or "name: t" in spec.raw_text


def test_storages_seeds_and_urls(tmp_path):
    spec = parse_spec(minimal(sampler={"name": "tpe", "seed": 10}))
    # every worker process its own seed (host:pid:start-time) in every launch, the same for the same worker and launch
    wids = [f"host{m}:{pid}:1700000000" for m in range(2) for pid in (100, 101, 102)]
    seeds = {worker_seed(10, w, launch) for w in wids for launch in (1700000001.5, 1700000002.25)}
    assert len(seeds) == 12 and worker_seed(10, wids[0], 1.5) == worker_seed(10, wids[0], 1.5)
    assert worker_seed(None, wids[0], 1.5) is None
    assert factories.default_storage(f"sqlite:///{tmp_path}/mlflow.db") == f"sqlite:///{tmp_path}/sweeps.db"
    assert factories.normalize_db_url("postgresql://u:p@h/db") == "postgresql+psycopg2://u:p@h/db"
    assert factories.normalize_db_url("postgres://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert (
        redact("postgresql+psycopg2://user:secret@host:5432/sweeps")
        == "postgresql+psycopg2://user:***@host:5432/sweeps"
    )
    journal = factories.make_storage(f"journal:{tmp_path}/j.journal.log", spec.storage)
    assert isinstance(journal, optuna.storages.JournalStorage)
    rdb = factories.make_storage(f"sqlite:///{tmp_path}/s.db", spec.storage)
    assert rdb.heartbeat_interval == spec.storage["heartbeat_interval"]
    assert rdb.get_heartbeat_stale_trial_callback() is not None


def test_dead_local_worker_trials_are_failed_and_requeued(tmp_path):
    """The journal storage has no heartbeat: a RUNNING trial whose local worker process is gone is failed and
    retried."""
    storage = factories.make_storage(f"journal:{tmp_path}/j.journal.log", {})
    study = optuna.create_study(storage=storage, study_name="s")
    t = study.ask()
    t.suggest_float("x", 0, 1)
    import socket

    t.set_user_attr("worker", f"{socket.gethostname()}:999999999:1")  # a pid that does not exist
    alive = study.ask()
    alive.set_user_attr("worker", liveness.worker_id())
    assert liveness.fail_dead_local_trials(study, max_retry=1) == [t.number]
    states = {tr.number: tr.state for tr in study.get_trials()}
    assert states[t.number] == optuna.trial.TrialState.FAIL
    assert states[alive.number] == optuna.trial.TrialState.RUNNING
    retry = [tr for tr in study.get_trials() if tr.state == optuna.trial.TrialState.WAITING]
    assert len(retry) == 1 and retry[0].params == t.params and retry[0].system_attrs["failed_trial"] == t.number


def test_dry_run_prints_a_fit_command(capsys):
    assert (
        sweep_main(
            [
                "run",
                str(REPO / "sweeps" / "smoke.yaml"),
                "--dry-run",
                "--set",
                "data.corpus=/c.txt",
                "--tracking-uri",
                "sqlite:////nonexistent/mlflow.db",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "mhc fit --config" in out and "--data.corpus=/c.txt" in out


def test_bad_spec_exits_with_message(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(minimal(sampler={"name": "annealing"})))
    assert sweep_main(["run", str(p), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    assert "sampler.name" in capsys.readouterr().err


def test_counts_only_trials_that_raised_as_errors():
    study = optuna.create_study()
    for attrs in ({"error": "ValueError: nan"}, {"error": None}, {"error": "SystemExit: 1", "interrupted": True}, {}):
        t = study.ask()
        for k, v in attrs.items():
            t.set_user_attr(k, v)
        study.tell(t, state=optuna.trial.TrialState.FAIL)
    c = counts(study)
    assert c["failed"] == 4 and c["errors"] == 1
