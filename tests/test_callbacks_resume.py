"""The stability preset through the real CLI: composition from YAML, and a SIGKILLed fit resumed from `last`
(README's resume command, with the preset)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CONF, mlflow_logger_arg, one_thread, tiny_fit_args

from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector, SinkhornScheduler
from mhc_lightning.fit.cli import build_cli

TESTS = Path(__file__).resolve().parent
STABILITY = str(CONF / "presets" / "stability.yaml")


def _args(corpus, uri, root, steps, experiment="tests", run_id=None) -> list[str]:
    args = tiny_fit_args(corpus, uri, root, "mhc", steps, experiment=experiment)
    i = args.index(str(CONF / "presets" / "debug.yaml")) + 1
    args[i:i] = ["-c", STABILITY]  # base + mhc + debug + stability
    if run_id is not None:  # resume the MLflow run too: same run id, same checkpoint folder
        args[-1] = mlflow_logger_arg(uri, experiment, "test", run_id=run_id)
    return args


def test_preset_composes_with_base_and_overrides(tiny_corpus, mlflow_uri, tmp_path):
    args = _args(tiny_corpus, mlflow_uri, tmp_path, 2) + ["--trainer.callbacks.init_args.intensity=2"]
    cli = build_cli(args[1:], run=False)  # run=False: no subcommand
    names = [type(cb).__name__ for cb in cli.trainer.callbacks]
    assert names.index("ModelCheckpoint") >= 0  # base.yaml's checkpoint is kept: callbacks+ appends
    sched = next(cb for cb in cli.trainer.callbacks if isinstance(cb, SinkhornScheduler))
    assert sched.intensity == 2.0 and sched.tol == pytest.approx(1e-4)  # the sweep knob
    det = next(cb for cb in cli.trainer.callbacks if isinstance(cb, InstabilityDetector))
    assert det.actions["loss_spike"] == "rollback" and det.loss_z_threshold == 6.0
    assert any(isinstance(cb, GradientSnapshots) for cb in cli.trainer.callbacks)


def test_bad_action_in_yaml_is_rejected_naming_the_field(tiny_corpus, mlflow_uri, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  callbacks+:\n    - class_path: mhc_lightning.callbacks.InstabilityDetector\n"
        "      init_args:\n        on_loss_spike: explode\n"
    )
    with pytest.raises(SystemExit):
        build_cli(_args(tiny_corpus, mlflow_uri, tmp_path, 2)[1:] + ["-c", str(bad)], run=False)
    err = capsys.readouterr().err
    assert "on_loss_spike" in err and "explode" in err


# ---- the documented resume command -----------------------------------------------------------------------------------
QUICKSTART = str(CONF / "quickstart.yaml")


def _quickstart(corpus, uri: str, root: Path, *extra: str) -> list[str]:
    """`mhc fit -c conf/quickstart.yaml` with the stability preset, made tiny: 12 steps, validation and checkpoint every
    4, every step logged."""
    return [
        str(Path(sys.executable).with_name("mhc")),
        "fit",
        "-c",
        QUICKSTART,
        "-c",
        STABILITY,
        f"--data.corpus={corpus}",
        "--data.seq_len=32",
        "--data.batch_size=4",
        "--model.arch.n_layers=1",
        "--model.arch.d_model=32",
        "--model.arch.n_heads=2",
        "--trainer.max_steps=12",
        "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.tracking_uri={uri}",
        *extra,
    ]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_killed_quickstart_resumes_the_same_run_with_ckpt_path_last(
    tiny_corpus, tmp_path, capsys, monkeypatch, _mlflow_template
):
    """SIGKILL `mhc fit -c conf/quickstart.yaml -c conf/presets/stability.yaml` before step 7 (last checkpoint: step 4),
    then run the same command with `--ckpt_path last`: the same MLflow run continues and ends FINISHED, no metric step
    is logged twice, every logged value equals an uninterrupted run's (so the data order continued where the
    checkpoint stopped), and the final weights, optimizer state and stability callbacks' state equal it bit for bit.
    (One killed fit for both the documented command and the stability preset, and the resumed and uninterrupted fits
    in this process: each `mhc fit` process costs CI its start-up.)"""
    import mlflow
    from helpers import handshake_arg, wait_for

    from mhc_lightning.fit.cli import main

    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    uri, straight_uri = f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 'straight.db'}"
    for db in ("mlflow.db", "straight.db"):  # migrated stores: migrations cost seconds
        shutil.copy(_mlflow_template, tmp_path / db)
    hs, log = tmp_path / "handshake", tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _quickstart(tiny_corpus, uri, tmp_path / "runs", handshake_arg(hs, [7])),
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(hs / "at7", proc=proc, log=log)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    (ckpt_dir,) = (tmp_path / "runs").glob("*/*/checkpoints")
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"] == 4  # lost: steps 5-6

    killed = mlflow.MlflowClient(uri).search_runs(
        [mlflow.MlflowClient(uri).get_experiment_by_name("quickstart").experiment_id]
    )[0]
    # steps 4-6 were logged after the step-4 checkpoint: the resumed run trains them again and must not log them twice
    assert [s for s, _ in _history(mlflow.MlflowClient(uri), killed.info.run_id, "train/loss")] == list(range(7))

    with pytest.raises(SystemExit) as stopped:  # in-process: the same `main` as the `mhc` script
        main(
            _quickstart(
                tiny_corpus,
                uri,
                tmp_path / "elsewhere",
                "--ckpt_path",
                "last",
                "--trainer.logger.init_args.run_name=never-ran",
            )[1:]
        )
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "mhc fit: error: --ckpt_path last: no checkpoint of an earlier training run named 'never-ran'" in err
    assert not (tmp_path / "elsewhere").exists()

    monkeypatch.chdir(tmp_path)  # where the subprocess ran: MLflow's artifacts go under ./mlruns
    with one_thread():  # the resumed run, in-process too (a second `mhc` start would only add its imports)
        main(_quickstart(tiny_corpus, uri, tmp_path / "runs", "--ckpt_path", "last")[1:])
    resumed = capsys.readouterr()
    assert "resuming MLflow run" in resumed.err and "not resumable" not in resumed.out + resumed.err
    with one_thread():  # the uninterrupted run, in-process (same thread count as the subprocess)
        main(_quickstart(tiny_corpus, straight_uri, tmp_path / "straight")[1:])

    client, reference = mlflow.MlflowClient(uri), mlflow.MlflowClient(straight_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    (ref,) = reference.search_runs([reference.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        got, want = _history(client, run.info.run_id, key), _history(reference, ref.info.run_id, key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # each step once, none missing
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    assert [s for s, _ in _history(client, run.info.run_id, "train/loss")] == list(range(12))

    (full_dir,) = (tmp_path / "straight").glob("*/*/checkpoints")
    a = torch.load(full_dir / "last.ckpt", weights_only=False)
    b = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 12
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    differ = [(i, k) for i in sa for k in sa[i] if not torch.equal(sa[i][k], sb[i][k])]
    assert not differ, differ[:5]
    assert a["callbacks"]["SinkhornScheduler"]["iters"] == b["callbacks"]["SinkhornScheduler"]["iters"]
    assert a["callbacks"]["InstabilityDetector"]["losses"] == b["callbacks"]["InstabilityDetector"]["losses"]
    print("[figures] resume: killed before step 7, checkpoint of step 4; 12/12 steps once each, values = straight run")


@pytest.mark.slow
def test_log_model_keeps_the_one_copy_in_mlflow_and_resume_downloads_it(tiny_corpus, mlflow_uri, tmp_path):
    """Checkpoint policy: with `log_model: true` the checkpoints end up as run artifacts only (the local files
    are removed once uploaded); `--ckpt_path last` then fetches last.ckpt from the run and continues the same run."""
    import mlflow

    from mhc_lightning.fit.cli import main

    root = tmp_path / "root"
    args = tiny_fit_args(tiny_corpus, mlflow_uri, root, steps=4, run_name="one-copy")
    args += ["--trainer.logger.init_args.log_model=true", "--trainer.log_every_n_steps=1"]
    args.append("--model.diagnostics_every=0")  # no per-layer figures: seconds, and nothing here reads them
    main(args)
    client = mlflow.MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert "last/last.ckpt" in {a.path for a in client.list_artifacts(run.info.run_id, "last")}
    assert not list(root.rglob("*.ckpt"))  # one copy: in MLflow

    main(
        [a if not a.startswith("--trainer.max_steps") else "--trainer.max_steps=6" for a in args]
        + ["--ckpt_path", "last", "--extend"]
    )  # 4 -> 6 steps: an explicit extension
    (again,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [
        m.step for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    ] == list(range(6))
