"""Ctrl-C and SIGTERM sent to a real `mhc fit`: a checkpoint of the step reached, the MLflow run KILLED, exit 130 / 143,
and the printed resume command continues the run exactly (the stops used to exit 0 for SIGTERM, and Ctrl-C left a
FAILED run with no hint)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import CONF, REPO, handshake_arg, one_thread, wait_for
from lightning.pytorch.callbacks import ModelCheckpoint
from mlflow import MlflowClient

from mhc_lightning.callbacks.graceful_stop import keep_last_name
from mhc_lightning.fit.cli import main
from mhc_lightning.fit.resume import newest_last
from mhc_lightning.training.checkpoint_io import VerifiedCheckpointIO

MHC = str(Path(sys.executable).with_name("mhc"))


def _args(corpus, uri: str, root: Path, *extra: str) -> list[str]:
    """conf/quickstart.yaml made tiny: 12 steps, validation and checkpoint every 4, every step logged, no diagnostics
    (their figures cost seconds per validation and play no part in stopping or resuming)."""
    return [
        "fit",
        "-c",
        str(CONF / "quickstart.yaml"),
        f"--data.corpus={corpus}",
        "--data.seq_len=32",
        "--data.batch_size=4",
        "--model.arch.n_layers=1",
        "--model.arch.d_model=32",
        "--model.arch.n_heads=2",
        "--model.diagnostics_every=0",
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


def _stopped_line(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("mhc fit: stopped by")]
    return line


def _resume_argv(line: str) -> list[str]:
    """The command after `Resume with:`, as argv."""
    argv = shlex.split(line.partition("Resume with: ")[2])
    assert argv[0] == MHC  # by its full path: it runs without the venv activated
    return argv


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _step(folder: Path) -> int:
    return torch.load(folder / "last.ckpt", weights_only=True, mmap=True)["global_step"]


def _last_files(folder: Path) -> list[str]:
    """The folder's last*.ckpt: only last.ckpt, never a versioned last-v1.ckpt beside a stale one."""
    return sorted(p.name for p in folder.glob("last*.ckpt"))


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_with_a_checkpoint_killed_run_and_resume_command(
    tiny_corpus, tmp_path, mlflow_uri, _mlflow_template, capsys
):
    """Ctrl-C before step 2, then (resumed with the printed command) SIGTERM before step 6, then the printed command
    again: exits 130, 143, 0; checkpoints of steps 3 and 7 (the periodic ones are at 4 and 8); the run KILLED after
    each stop, then FINISHED; every step logged once, with the values of an uninterrupted run."""
    uri, root, hs = mlflow_uri, tmp_path / "runs", tmp_path / "handshake"  # a migrated store, as is straight.db
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    first = [MHC, *_args(tiny_corpus, uri, root, handshake_arg(hs, [2, 6]))]
    client = MlflowClient(uri)

    def stop_at(argv: list[str], step: int, signum: int, log: Path) -> tuple[int, str]:
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(hs / f"at{step}", proc=proc, log=log)
            proc.send_signal(signum)
            (hs / f"go{step}").touch()
            return proc.wait(timeout=300), log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()

    code, text = stop_at(first, 2, signal.SIGINT, tmp_path / "ctrl-c.log")
    assert code == 130, text[-3000:]
    (folder,) = root.glob("*/*/checkpoints")
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    line = _stopped_line(text)
    assert line.startswith(
        f"mhc fit: stopped by Ctrl-C (SIGINT) at step 3; checkpoint of step 3 saved as "
        f"{folder / 'last.ckpt'}; MLflow run {run.info.run_id} marked KILLED. Resume with: {MHC} fit "
    )
    assert _resume_argv(line) == [*first, "--ckpt_path", "last"]  # the same arguments, shell-quoted
    assert run.info.status == "KILLED" and _step(folder) == 3 and "Traceback" not in text

    code, text = stop_at(_resume_argv(line), 6, signal.SIGTERM, tmp_path / "sigterm.log")
    assert code == 143, text[-3000:]
    assert (
        f"resuming MLflow run {run.info.run_id} (quickstart-mhc, experiment 'quickstart') from "
        f"{folder / 'last.ckpt'}: it restarts at step 3 of 12" in text
    )
    line = _stopped_line(text)
    assert line.startswith("mhc fit: stopped by SIGTERM at step 7; checkpoint of step 7 saved as ")
    assert _resume_argv(line) == [*first, "--ckpt_path", "last"]
    assert client.get_run(run.info.run_id).info.status == "KILLED" and _step(folder) == 7 and "Traceback" not in text
    assert _last_files(folder) == ["last.ckpt"]  # the step-4 save after the resume overwrote it too

    # the printed command once more, to the end: in this process (a third `mhc` start would only add its imports)
    capsys.readouterr()
    with one_thread():
        main(_resume_argv(line)[1:])
    assert "it restarts at step 7 of 12" in capsys.readouterr().err
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert _step(folder) == 12 and _last_files(folder) == ["last.ckpt"]
    # the finished run resumed again: nothing to do, the run stays FINISHED at step 12
    with one_thread():
        main(_resume_argv(line)[1:])
    assert "it restarts at step 12 of 12" in capsys.readouterr().err
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert _step(folder) == 12 and _last_files(folder) == ["last.ckpt"]

    shutil.copy(_mlflow_template, tmp_path / "straight.db")
    straight_uri = f"sqlite:///{tmp_path / 'straight.db'}"
    with one_thread():
        main(_args(tiny_corpus, straight_uri, tmp_path / "straight"))
    reference = MlflowClient(straight_uri)
    (ref,) = reference.search_runs([reference.get_experiment_by_name("quickstart").experiment_id])
    for key in ("train/loss", "val/loss"):
        got, want = _history(client, run.info.run_id, key), _history(reference, ref.info.run_id, key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # each step once, none missing
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    print(
        f"[figures] Ctrl-C -> exit 130, SIGTERM -> exit 143, both KILLED with checkpoints of steps 3 and 7; "
        f"resumed run = uninterrupted run over {len(got)} validations and 12 training steps"
    )


class SigtermInValidation(L.Callback):
    """Sends this process SIGTERM at the first batch of the validation after training step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.step and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_during_a_validation_stops_once_it_is_complete(tiny_corpus, tmp_path, capsys, monkeypatch, mlflow_uri):
    """SIGTERM (real, to this process) inside the validation of step 4: the validation finishes and is logged, then the
    fit stops with a checkpoint of step 4, exit 143 (Lightning alone stops inside the validation, whose partial metrics
    no checkpoint holds)."""
    monkeypatch.chdir(tmp_path)
    # as in a fresh `mhc fit` process: no SIGTERM handler left by an earlier in-process test (a sweep worker's raises
    # KeyboardInterrupt, and Lightning would call it too)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    uri = mlflow_uri  # a migrated store: migrations cost seconds
    hook = "--trainer.callbacks+=" + json.dumps(
        {"class_path": f"{__name__}.SigtermInValidation", "init_args": {"step": 4}}
    )
    try:
        with one_thread(), pytest.raises(SystemExit) as stopped:
            main(_args(tiny_corpus, uri, tmp_path / "runs", hook))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert "mhc fit: stopped by SIGTERM at step 4; checkpoint of step 4 saved as " in capsys.readouterr().err
    (folder,) = (tmp_path / "runs").glob("*/*/checkpoints")
    assert _step(folder) == 4
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    # the validation after step 4 was completed and logged (under Lightning's logging step, 3)
    assert run.info.status == "KILLED" and [s for s, _ in _history(client, run.info.run_id, "val/loss")] == [3]


def test_a_fit_resumed_from_a_versioned_last_checkpoint_writes_last_ckpt_again(tmp_path):
    """A run whose last.ckpt was left at an early step beside a later last-v1.ckpt: `--ckpt_path last` takes the later
    one, and the fit resumed from it writes its next checkpoint as last.ckpt (not last-v2.ckpt)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name, step in (("last.ckpt", 15), ("last-v1.ckpt", 360)):
        torch.save({"global_step": step}, folder / name)
    assert newest_last(folder) == folder / "last-v1.ckpt"
    assert newest_last(tmp_path) is None
    unwritten = tmp_path / "unwritten"  # its last.ckpt could not be written: the newest good checkpoint resumes
    for name, step in (("epoch=0-step=2.ckpt", 2), ("epoch=0-step=4.ckpt", 4)):
        VerifiedCheckpointIO().save_checkpoint({"global_step": step}, unwritten / name)
    assert newest_last(unwritten) == unwritten / "epoch=0-step=4.ckpt"
    cb = ModelCheckpoint(dirpath=folder, save_last=True)
    cb.last_model_path = str(folder / "last-v1.ckpt")
    keep_last_name(SimpleNamespace(checkpoint_callbacks=[cb], ckpt_path=str(folder / "last-v1.ckpt")))
    assert Path(cb.last_model_path) == folder.resolve() / "last.ckpt"
    cb.last_model_path = ""  # a fresh fit, or one from a checkpoint elsewhere: left to ModelCheckpoint
    keep_last_name(SimpleNamespace(checkpoint_callbacks=[cb], ckpt_path=str(tmp_path / "other" / "last.ckpt")))
    assert cb.last_model_path == ""
