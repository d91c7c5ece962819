"""Names the user chooses, where they become paths or MLflow search filters: a study name or grid variant with `../`
is refused before anything is written (one line, exit 2), a run name made of axis values stays one file name, and a
run name with quotes is found again by `--ckpt_path last`, the grid's tagging and the sweep's parent-run lookup.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from helpers import REPO, derived_spec, fast_first, mlflow_logger_arg, tiny_fit_args
from mlflow import MlflowClient

from mhc_lightning.grids.cli import GridError, expand, load_grid, log_path
from mhc_lightning.loggers.filters import equals
from mhc_lightning.names import ALLOWED, file_name, path_name_problem

QUOTED = 'o\'neil "run"'  # both quotes: MLflow's filter parser has no escape for either


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OPTUNA_"))}
    return {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}


def _mhc_here(args: list[str], work: Path, monkeypatch, capsys) -> tuple[int, str]:
    """`mhc ARGS` run in this process from `work` (the refusals below come before anything starts, so a process of
    its own adds only its start-up): its exit code and what it printed on stderr."""
    from mhc_lightning.commands import main

    monkeypatch.chdir(work)
    for k in [k for k in os.environ if k.startswith(("MLFLOW_", "OPTUNA_"))]:
        monkeypatch.delenv(k)
    for k, v in _env(work).items():
        if k.startswith("MLFLOW_"):
            monkeypatch.setenv(k, v)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(args)
    return stopped.value.code, capsys.readouterr().err


def _everything_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@fast_first("name", ["../x", "a/b", "..", "a\\b", "tab\there"])
def test_names_that_leave_their_folder_are_refused(name):
    assert path_name_problem(name) and "cannot be a file or folder name" in path_name_problem(name)


def test_run_names_become_one_file_name_inside_the_log_folder(tmp_path):
    assert path_name_problem("mhc-L12-s3") is None and path_name_problem("lr1e-3,a..b") is None
    assert file_name("mhc-corpus/data/../x.txt") == "mhc-corpus_data_.._x.txt" and file_name("..") == "_."
    assert log_path(tmp_path, "../../escape").parent == tmp_path


def test_a_study_name_with_dotdot_is_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    """`--study-name ../../x` wrote the workers' logs two folders above sweep_logs/, outside the working folder."""
    work = tmp_path / "work"
    work.mkdir()
    spec = derived_spec(tmp_path / "s.yaml", "names", enqueue=[], budget={"n_trials": 1, "max_failed": 0})
    escape = f"escape-{uuid.uuid4().hex[:6]}"
    code, err = _mhc_here(
        [
            "sweep",
            "run",
            str(spec),
            "--workers",
            "2",
            "--study-name",
            f"../../{escape}",
            "--storage",
            f"sqlite:///{work / 'sweeps.db'}",
            "--set",
            f"data.corpus={tmp_path / 'none'}",
        ],
        work,
        monkeypatch,
        capsys,
    )
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"mhc sweep: error: --study-name: '../../{escape}' cannot be a file or folder name ({ALLOWED}): it names the "
        "folder of the workers' logs"
    ]
    assert not (tmp_path / escape).exists() and _everything_under(work) == set()


def test_a_grid_variant_with_dotdot_is_refused_before_any_run_starts(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    escape = f"escape-{uuid.uuid4().hex[:6]}"
    grid = tmp_path / "g.yaml"
    grid.write_text(
        json.dumps(
            {
                "experiment": "names",
                "configs": ["conf/model/mhc.yaml"],
                "variants": {f"../../{escape}": {}},
                "axes": {"seed_everything": [1]},
            }
        )
    )
    code, err = _mhc_here(["grid", str(grid), "--logs", str(work / "logs")], work, monkeypatch, capsys)
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"mhc grid: error: {grid}: variants: '../../{escape}' cannot be a file or folder name ({ALLOWED})"
    ]
    assert not list(tmp_path.glob(f"{escape}*")) and _everything_under(work) == set()
    with pytest.raises(GridError, match="variants"):
        load_grid(grid)


def test_run_names_with_quotes_are_found_by_search_filters(mlflow_uri):
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("quotes")
    names = ["it's", 'say "hi"', QUOTED, "plain", 'o_neil "run"']  # the last one only LIKE-matches QUOTED
    for name in names:
        client.create_run(exp, run_name=name)
    for name in names[:4]:
        found = [r.info.run_name for r in client.search_runs([exp], equals("attributes.run_name", name))]
        assert name in found and (name == QUOTED or found == [name]), (name, found)


@pytest.mark.slow
def test_ckpt_path_last_resumes_a_run_whose_name_has_quotes(tiny_corpus, tmp_path, mlflow_uri, capsys):
    """The run lookup quoted the name in single quotes: a name with ' broke `--ckpt_path last` with a traceback.
    Both fits in this process (`mhc`'s own `main`): the lookup is the same, without two processes' start-up."""
    from mhc_lightning.fit.cli import main

    uri = mlflow_uri
    args = tiny_fit_args(tiny_corpus, uri, tmp_path / "runs", steps=4, experiment="quotes")
    args = [a for a in args if not a.startswith("--trainer.logger=")] + [mlflow_logger_arg(uri, "quotes", QUOTED)]
    args.append("--model.diagnostics_every=0")  # no per-layer figures: seconds, and nothing here reads them
    main(args)
    capsys.readouterr()
    main([*args, "--trainer.max_steps=6", "--extend", "--ckpt_path", "last"])
    err = capsys.readouterr().err
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("quotes").experiment_id])
    assert run.info.run_name == QUOTED and f"resuming MLflow run {run.info.run_id}" in err
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) >= 4


def test_grid_tags_runs_whose_names_have_quotes(mlflow_uri):
    from mhc_lightning.grids.jobs import tag_runs

    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("grid-quotes")
    run = client.create_run(exp, run_name=QUOTED)
    other = client.create_run(exp, run_name='o_neil "run"')
    tag_runs(client, exp, QUOTED, {"variant": "v"})
    assert client.get_run(run.info.run_id).data.tags["variant"] == "v"
    assert "variant" not in client.get_run(other.info.run_id).data.tags
    spec = load_grid(REPO / "conf" / "experiments" / "stability_grid.yaml")
    assert all(log_path(Path("logs"), name).parent == Path("logs") for name, _, _ in expand(spec, REPO, []))
