"""Checkpoint files that are written whole and can be verified (docs/stability.md, "Checkpoint files").

- Written to a temporary name in the target's folder, fsynced, then renamed over the target (and the folder fsynced):
  a full disk, a read-only folder or a kill during the write leaves the earlier file as it was and no partial one. A
  write that fails is a `CheckpointWriteError`: one line naming the folder, the cause and the newest good checkpoint.
- Each file carries the sha256 of its own bytes: torch.save writes a zip archive, whose format ends with an optional
  comment that torch.load ignores; the comment is `mhc-sha256:<hex>` over every byte before the comment's length
  field. One file, so the digest travels with it (copies, MLflow artifacts).
- `verify` checks a file before a fit resumes from it or an evaluation reads it: a mismatch is a `CorruptCheckpoint`
  naming the file and the newest good checkpoint beside it (`good_beside`, also named for a file cut short). A file
  without the comment (written by another tool) is accepted, unverified.
- The temporary file is named by its writer's host and pid: one that a killed writer left (SIGKILL mid-write) is
  removed when a fit or an evaluation next reads a checkpoint of that folder (`remove_stale_temporaries`).

`VerifiedCheckpointIO` is the Trainer's checkpoint plugin that does both; the CLI installs it in every Trainer whose
strategy uses Lightning's default TorchCheckpointIO (`use_verified_checkpoints`).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import shlex
import socket
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from ..errors import UserError

MARK = b"mhc-sha256:"
COMMENT_LEN = len(MARK) + 64
EOCD = b"PK\x05\x06"  # zip end-of-central-directory signature; the record is 22 bytes plus the comment
CHUNK = 1 << 22
_os_write = os.write  # the one call that puts checkpoint bytes on disk (fault tests replace it)
_verified: dict[tuple[str, int, int], bool] = {}  # (path, size, mtime_ns) -> had a digest; a file is hashed once


class CorruptCheckpoint(UserError):
    """A checkpoint whose bytes differ from the digest written with it."""


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (disk full, read-only folder); `resumable`: a good one is there, and the
    CLI adds the command that resumes from it."""

    def __init__(self, message: str, resumable: bool):
        super().__init__(message)
        self.resumable = resumable


def with_digest(archive: memoryview) -> list:
    """torch.save's archive with its sha256 as the zip comment, as the parts to write (views, not copies: a
    checkpoint can be gigabytes)."""
    if bytes(archive[-22:-18]) != EOCD or bytes(archive[-2:]) != b"\0\0":
        raise ValueError("not a zip archive without comment (torch.save's format)")
    body = archive[:-2]
    return [body, COMMENT_LEN.to_bytes(2, "little") + MARK + hashlib.sha256(body).hexdigest().encode()]


def read_digest(path: Path) -> tuple[Optional[str], Optional[str]]:
    """(digest written with the file, digest of its bytes now); (None, None) for a file without one."""
    size = path.stat().st_size
    tail_len = 2 + COMMENT_LEN
    if size < 22 + COMMENT_LEN:
        return None, None
    with open(path, "rb") as f:
        f.seek(size - 22 - COMMENT_LEN)
        tail = f.read()
        if (
            tail[:4] != EOCD
            or tail[-tail_len:-COMMENT_LEN] != COMMENT_LEN.to_bytes(2, "little")
            or not tail[-COMMENT_LEN:].startswith(MARK)
        ):
            return None, None
        stored = tail[-64:].decode("ascii", "replace")
        h, left = hashlib.sha256(), size - tail_len
        f.seek(0)
        while left:
            block = f.read(min(CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return stored, h.hexdigest()


def checkpoint_step(path: Path) -> Optional[int]:
    """The global step a checkpoint was written at (None if it cannot be read)."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step"))
    except Exception:
        return None


def last_good(folder: Path, exclude: Optional[Path] = None) -> Optional[tuple[Path, int]]:
    """The newest checkpoint in `folder` that verifies against its digest, with its step."""
    found = []
    for p in folder.glob("*.ckpt") if folder.is_dir() else []:
        if exclude is not None and p.resolve() == exclude.resolve():
            continue
        stored, actual = read_digest(p)
        step = checkpoint_step(p) if stored is not None and stored == actual else None
        if step is not None:
            found.append((step, p.stat().st_mtime_ns, p))
    if not found:
        return None
    step, _, path = max(found)
    return path, step


def verify(path: Path, run_id: Optional[str] = None) -> bool:
    """Raise CorruptCheckpoint unless `path` matches the digest written with it; False: it has none (unverified)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return _verified[key]
    stored, actual = read_digest(path)
    if stored is not None and stored != actual:
        raise CorruptCheckpoint(
            f"checkpoint {path} is corrupted: its bytes do not match the sha256 written with it "
            f"({stored[:12]}..., now {actual[:12]}...), nothing was started; {good_beside(path, run_id)}"
        )
    _verified[key] = stored is not None
    return _verified[key]


def good_beside(path: Path, run_id: Optional[str] = None, otherwise: Optional[str] = None) -> str:
    """What to do instead of a checkpoint that cannot be used: the newest good one in its folder and the flags that
    resume from it (in run `run_id`), else `otherwise` (default: that there is none)."""
    good = last_good(path.parent, exclude=path)
    if good is None:
        return (
            otherwise
            or f"no other good checkpoint in {path.parent}: run the command without --ckpt_path to start again"
        )
    again = f"--ckpt_path {shlex.quote(str(good[0]))}"
    if run_id:
        again += f" --trainer.logger.init_args.run_id={run_id}"
    return f"the last good checkpoint is {good[0]} (step {good[1]}): resume from it with {again}"


def _temporary(path: Path) -> Path:
    """The temporary file a write of `path` goes through, named by its writer (host, pid) so that one a killed writer
    left can be told from one being written (remove_stale_temporaries)."""
    return path.parent / f".{path.name}.{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporary files in `folder` whose writer, a process of this host, is gone (a SIGKILL mid-write);
    returns them."""
    mine, removed = re.compile(rf"\.{re.escape(socket.gethostname())}-(\d+)-[0-9a-f]{{8}}\.tmp$"), []
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        writer = mine.search(tmp.name)
        if writer is None or _alive(int(writer.group(1))):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_whole(path: Path, parts: list) -> None:
    """Write the byte strings `parts` to `path` through a temporary file in the same folder: the target is replaced
    only once every byte is on disk. Whatever fails, no temporary file is left behind."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[_os_write(fd, view[:CHUNK]) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def write_failure(path: Path, err: OSError) -> CheckpointWriteError:
    """The one-line error for a checkpoint that could not be written, naming what is safe."""
    cause = f"{err.strerror or err} ({errno.errorcode.get(err.errno, 'OSError')})"
    fix = {
        errno.ENOSPC: "Free space on its disk",
        errno.EDQUOT: "Free space within your quota",
        errno.EACCES: "Make that folder writable",
        errno.EPERM: "Make that folder writable",
        errno.EROFS: "Put the checkpoints on a writable file system",
    }.get(err.errno, "Fix that")
    good = last_good(path.parent)
    if good:
        safe = f"the last good checkpoint is {good[0]} (step {good[1]}), untouched; no partial file was left. {fix}."
    else:
        safe = f"no checkpoint of this fit was written yet; no partial file was left. {fix}, then run it again."
    return CheckpointWriteError(
        f"cannot write checkpoint {path.name} in {path.parent}: {cause}; {safe}", good is not None
    )


class VerifiedCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose local files are written whole with their digest and verified before they are loaded."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote file systems: Lightning's own writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        path = Path(path)
        try:
            write_whole(path, with_digest(buffer.getbuffer()))
        except OSError as err:
            raise write_failure(path, err) from None

    def remove_checkpoint(self, path) -> None:
        try:
            super().remove_checkpoint(path)
        except OSError as err:  # an outdated checkpoint left behind costs disk space only: the fit goes on
            rank_zero_warn(f"could not remove the outdated checkpoint {path} ({err.strerror or err}); left in place")

    def load_checkpoint(self, path, map_location: Any = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if "://" not in str(path) and Path(path).is_file():
            verify(Path(path))
        if map_location is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def use_verified_checkpoints(trainer) -> None:
    """Give the strategy a VerifiedCheckpointIO in place of Lightning's default one (a custom plugin stays)."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = VerifiedCheckpointIO()
