"""Checkpoint files under faults: a corrupted checkpoint (same size) is refused before a resume starts, naming the last
good one; a full disk or a read-only checkpoint folder stops the fit with one line and leaves no partial file."""

from __future__ import annotations

import ctypes
import errno
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, handshake_arg, tiny_fit_args, wait_for
from mlflow import MlflowClient

from mhc_lightning.fit.child_processes import mhc_command
from mhc_lightning.fit.cli import main

TESTS = REPO / "tests"
MHC = shlex.join(mhc_command())  # the entry point the printed commands name


_NO_DIAGNOSTICS = ("--model.diagnostics_every=0",)


def _fit_args(corpus, uri, root, steps: int, *extra: str) -> list[str]:
    # no per-layer diagnostics: their figures cost seconds per validation and have nothing to do with checkpoints
    return [*tiny_fit_args(corpus, uri, root, steps=steps), "--trainer.val_check_interval=2", *_NO_DIAGNOSTICS, *extra]


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _runs(uri: str) -> list[tuple[str, str]]:
    client = MlflowClient(uri)
    return sorted(
        (r.info.run_id, r.info.status)
        for r in client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    )


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("mhc fit: error:")]


def test_digest_travels_in_the_file_and_catches_one_changed_byte(tmp_path):
    """The Trainer's plugin writes a checkpoint that torch.load reads as before and that verifies; one byte changed in
    the middle (same size) is refused, also through the plugin's own load; a file without a digest is unverified."""
    from mhc_lightning.training.checkpoint_io import CorruptCheckpoint, VerifiedCheckpointIO, read_digest, verify

    io = VerifiedCheckpointIO()
    path = tmp_path / "a.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.arange(4096.0)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4096.0))
    assert verify(path) is True and read_digest(path)[0] == read_digest(path)[1]
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no temporary file left

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=r"a\.ckpt is corrupted.*no other good checkpoint"):
        io.load_checkpoint(path)

    plain = tmp_path / "plain.ckpt"
    torch.save({"global_step": 1}, plain)
    assert verify(plain) is False  # no digest: accepted, unverified


@pytest.mark.slow
def test_corrupted_last_checkpoint_is_refused_naming_the_last_good_one(tiny_corpus, mlflow_uri, tmp_path, capsys):
    """1 KiB overwritten inside last.ckpt, same size (the resume used to go on with a loss of 11.65 instead of 2.06):
    `--ckpt_path last` stops with one line naming the file and the newest good checkpoint, exit 2, nothing written; the
    command it suggests then resumes the same run."""
    root = tmp_path / "runs"
    args = _fit_args(tiny_corpus, mlflow_uri, root, 4)
    main(args)
    (folder,) = root.glob("*/*/checkpoints")
    last = folder / "last.ckpt"
    size = last.stat().st_size
    with open(last, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(1024))
    assert last.stat().st_size == size
    before_files, before_runs = _files(tmp_path), _runs(mlflow_uri)
    capsys.readouterr()

    with pytest.raises(SystemExit) as stopped:
        main([*args, "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    (line,) = _error_lines(err)
    from mhc_lightning.training.checkpoint_io import checkpoint_step

    run_id = before_runs[0][0]
    good = next(p for p in folder.glob("*.ckpt") if p.name != "last.ckpt")
    assert f"checkpoint {last} is corrupted" in line
    assert f"the last good checkpoint is {good} (step {checkpoint_step(good)})" in line
    assert f"--ckpt_path {good} --trainer.logger.init_args.run_id={run_id}" in line
    assert "Traceback" not in err
    assert _files(tmp_path) == before_files and _runs(mlflow_uri) == before_runs  # nothing written
    print(f"[figures] corrupted last.ckpt: exit 2, stderr {err.splitlines()}")

    # cut short instead, beside the temporary file of a write that was killed (its writer, pid 2**22 + 1, is gone)
    last.write_bytes(last.read_bytes()[: size // 2])
    stale = folder / f".last.ckpt.{socket.gethostname()}-{2**22 + 1}-0123abcd.tmp"
    stale.write_bytes(b"partial")
    with pytest.raises(SystemExit):
        main([*args, "--ckpt_path", "last"])
    err = capsys.readouterr().err
    (line,) = _error_lines(err)
    assert f"checkpoint {last} is not a whole torch.save archive (cut short, or not a checkpoint)" in line
    assert f"the last good checkpoint is {good} (step {checkpoint_step(good)})" in line
    assert not stale.exists() and f"removed {stale.name}, left in {folder} by a checkpoint write" in err

    main([*args, "--ckpt_path", str(good), f"--trainer.logger.init_args.run_id={run_id}"])
    assert _runs(mlflow_uri) == [(run_id, "FINISHED")]


def test_full_disk_stops_with_one_line_and_leaves_no_partial_file(
    tiny_corpus, mlflow_uri, tmp_path, capsys, monkeypatch
):
    """The disk fills up halfway through the checkpoint of step 4 (writes after the step-2 checkpoints fail with
    ENOSPC): one line naming the folder and the last good checkpoint, exit 2; the folder holds only whole, verified
    files (before: a truncated best checkpoint and an 83-102-line traceback)."""
    from mhc_lightning.training import checkpoint_io

    real_write, written = os.write, []

    def filling_disk(fd, data):
        name = os.readlink(f"/proc/self/fd/{fd}")  # each checkpoint goes through a temporary file of its own
        if name not in written:
            written.append(name)
        if len(written) <= 2:  # step 2: best and last
            return real_write(fd, data)
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_io, "_os_write", filling_disk)
    root = tmp_path / "runs"
    args = _fit_args(tiny_corpus, mlflow_uri, root, 6)
    with pytest.raises(SystemExit) as stopped:
        main(args)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    (folder,) = root.glob("*/*/checkpoints")
    (line,) = _error_lines(err)
    assert f"in {folder}: No space left on device (ENOSPC)" in line
    assert f"the last good checkpoint is {folder / 'last.ckpt'} (step 2)" in line
    assert line.endswith(" --ckpt_path last") and f"Resume with: {MHC} fit -c " in line
    assert "Traceback" not in err
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["epoch=0-step=2.ckpt", "last.ckpt"], files  # no temporary or partial file
    assert all(checkpoint_io.verify(folder / name) for name in files)
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2
    print(f"[figures] disk full at the step-4 checkpoint: exit 2, files {files}: {line}")


def _without_root_override() -> None:
    """As root, file permissions bind only without CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2): drop them from
    the child's bounding set (PR_CAPBSET_DROP = 24; a non-root user has nothing to drop)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        libc.prctl(24, cap, 0, 0, 0)


@pytest.mark.slow
def test_read_only_checkpoint_folder_stops_a_real_fit_with_one_line(tiny_corpus, tmp_path, mlflow_uri):
    """`mhc fit` whose checkpoint folder becomes read-only after the step-2 checkpoint: at step 4 it stops with exit 2
    and one line naming the folder, the cause, the last good checkpoint and the resume command; no traceback."""
    uri, root, hs, log = mlflow_uri, tmp_path / "runs", tmp_path / "hs", tmp_path / "fit.log"  # a migrated store
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    extra = (handshake_arg(hs, [3]),)  # diagnostics off, as in every fit here (_fit_args)
    cmd = [str(Path(sys.executable).with_name("mhc")), *_fit_args(tiny_corpus, uri, root, 6, *extra)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_without_root_override
        )
    try:
        wait_for(hs / "at3", proc=proc, log=log)
        (folder,) = root.glob("*/*/checkpoints")
        before = _files(folder)
        folder.chmod(0o555)
        (hs / "go3").touch()
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for f in root.glob("*/*/checkpoints"):
            f.chmod(0o755)
    text = log.read_text()
    assert code == 2, text[-3000:]
    (line,) = _error_lines(text)
    assert f"in {folder}: Permission denied (EACCES)" in line
    assert f"the last good checkpoint is {folder / 'last.ckpt'} (step 2)" in line
    assert line.endswith(" --ckpt_path last") and f"Resume with: {MHC} fit " in line
    assert "Traceback" not in text
    assert _files(folder) == before
    print(f"[figures] read-only checkpoint folder: exit 2, {len(text.splitlines())} lines of output: {line}")
