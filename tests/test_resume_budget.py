"""A resume that would change the experiment: `--ckpt_path last` with another trainer.max_steps than the run was planned
for is refused unless `--extend` says to continue it, and then the learning rate goes on from where it was."""

from __future__ import annotations

import pytest
from helpers import tiny_fit_args
from mlflow import MlflowClient

from mhc_lightning.fit.cli import main


def _args(corpus, uri, root, steps: int, *extra: str) -> list[str]:
    # no per-layer diagnostics: their figures cost seconds per validation, and nothing here reads them
    return [
        *tiny_fit_args(corpus, uri, root, steps=steps),
        "--model.optim.warmup_steps=2",
        "--model.diagnostics_every=0",
        *extra,
    ]


def _lr(client: MlflowClient, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/lr"))


@pytest.mark.slow
def test_extending_a_finished_run_is_refused_without_extend_and_continues_the_lr_with_it(
    tiny_corpus, mlflow_uri, tmp_path, capsys
):
    """A 4-step run FINISHED; the same command with max_steps 6 and `--ckpt_path last` stops with one line naming both
    budgets and --extend, exit 2, nothing written (it used to reopen the run and restart the cosine: the lr went back
    up). With --extend the same run goes on to step 6 at the lr it had reached (its minimum), and the run records
    both budgets."""
    root = tmp_path / "runs"
    main(_args(tiny_corpus, mlflow_uri, root, 4))
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    before_lr = _lr(client, run.info.run_id)
    files = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    capsys.readouterr()

    with pytest.raises(SystemExit) as stopped:
        main(_args(tiny_corpus, mlflow_uri, root, 6, "--ckpt_path", "last"))
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    (line,) = [ln for ln in err.splitlines() if ln.startswith("mhc fit: error:")]
    assert "planned for trainer.max_steps=4 (finished)" in line and "asks for trainer.max_steps=6" in line
    assert "add --extend" in line and "or resume with --trainer.max_steps=4" in line
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == files
    assert client.get_run(run.info.run_id).info.status == "FINISHED" and _lr(client, run.info.run_id) == before_lr

    main(_args(tiny_corpus, mlflow_uri, root, 6, "--ckpt_path", "last", "--extend"))
    assert "it restarts at step 4 of 6" in capsys.readouterr().err
    (again,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    lr = _lr(client, run.info.run_id)
    assert [s for s, _ in lr] == list(range(6))
    lr_min = 2e-3 * 0.1  # base.yaml's lr x min_lr_ratio, reached at the end of the first 4 steps
    assert before_lr[-1][1] == pytest.approx(lr_min)
    assert [v for _, v in lr[4:]] == pytest.approx([lr_min, lr_min])  # no jump (before: 4.6e-4, then 1.1e-3 ...)
    assert again.data.params["trainer.max_steps"] == "4"
    assert again.data.tags["mhc.changed_on_resume.trainer.max_steps"] == "4 -> 6"
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    text = open(config).read()
    assert "max_steps: 6" in text and "extend: true" in text
    print(f"[figures] extend 4 -> 6: lr {[f'{v:.3g}' for _, v in lr]}")


def test_extend_continues_the_cosine_from_the_factor_reached():
    """The policy, in numbers: extended mid-decay the factor goes on from where it was, down to the minimum at the new
    last step; extended during warmup it is the plan for the new total; unextended it is the plain warmup + cosine."""
    from mhc_lightning.training.schedule import WarmupCosine

    plan = WarmupCosine(warmup=10, total=30, min_ratio=0.1)
    assert plan(9) == pytest.approx(1.0) and plan(30) == pytest.approx(0.1) and plan(20) == pytest.approx(0.55)
    reached = plan(20)
    plan.extend(20, 40)
    assert plan(20) == pytest.approx(reached) and plan(40) == pytest.approx(0.1)
    assert all(plan(s) >= plan(s + 1) for s in range(20, 40))
    early = WarmupCosine(warmup=10, total=30, min_ratio=0.1)
    early.extend(5, 50)
    assert [early(s) for s in range(60)] == pytest.approx([WarmupCosine(10, 50, 0.1)(s) for s in range(60)])


@pytest.mark.slow
def test_a_corpus_edited_before_the_resume_is_refused_unless_data_changed(tiny_corpus, mlflow_uri, tmp_path, capsys):
    """The corpus is edited after a 2-step run: `--ckpt_path last` stops with one line naming the split's digest now
    and the one the run trained on, exit 2, nothing written; with --data_changed the run goes on and its data tags
    keep both digests, in order."""
    root = tmp_path / "runs"
    main(_args(tiny_corpus, mlflow_uri, root, 2))
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    first = run.data.tags["mhc.data.train_sha256"]
    tiny_corpus.write_text(tiny_corpus.read_text().replace("the", "a"))
    files = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    capsys.readouterr()

    with pytest.raises(SystemExit) as stopped:
        main(_args(tiny_corpus, mlflow_uri, root, 2, "--ckpt_path", "last"))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("mhc fit: error:")]
    assert f"run {run.info.run_id} trained on {first} (tag mhc.data.train_sha256)" in line
    assert "its train split has sha256 " in line and "add --data_changed" in line
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == files
    assert client.get_run(run.info.run_id).info.status == "FINISHED"

    main(_args(tiny_corpus, mlflow_uri, root, 2, "--ckpt_path", "last", "--data_changed"))
    assert "changed on purpose (--data_changed)" in capsys.readouterr().err
    tags = client.get_run(run.info.run_id).data.tags
    history = tags["mhc.data.train_sha256"].split(",")
    assert len(history) == 2 and history[0] == first and history[1] in line
