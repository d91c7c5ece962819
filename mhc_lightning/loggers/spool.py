"""Writes to MLflow that wait on local disk while the tracking server is down, and their replay.

Policy (docs/sweeps.md, "When the MLflow server is down"): every write that fails because the server is unreachable
is appended, in order and self-contained (artifacts copied), to a JSONL file under the spool directory and retried
after `retry_every` seconds, then after twice as long while it keeps failing (up to 10 min), so that training waits
on the server for at most one failed request per retry. At the end of fit the spool is retried for a while; what is
left stays on disk and `mhc sweep replay <spool dir> --tracking-uri URI` sends it later, original timestamps and
steps kept.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import Optional

from .store import check_tracking, is_outage, outage_reason, redact


# ---- spool: failed writes kept on disk, replayed in order ------------------------------------------
class GuardedClient:
    """Wraps MlflowClient: writes that fail because the server is down go to a spool instead of raising."""

    WRITES = {
        "log_batch",
        "log_metric",
        "log_param",
        "set_tag",
        "delete_tag",
        "log_text",
        "log_dict",
        "log_figure",
        "log_artifact",
        "log_artifacts",
        "set_terminated",
        "update_run",
    }

    def __init__(self, client, spool_root, retry_every: float = 30.0, label: str = ""):
        self._client = client
        self.spool_root = Path(spool_root)
        self.retry_every = retry_every
        self.label = label
        self._file: Optional[Path] = None  # this guard's journal; created at the first failure
        self._pending = 0
        self._last_try = 0.0
        self._delay = retry_every  # doubles while retries keep failing (a black-holed server costs a timeout each)
        self.dropped = 0
        self.reason = ""  # why the store did not take the first spooled write, in a few words

    @property
    def pending(self) -> int:
        return self._pending

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        return functools.partial(self._write, name) if name in self.WRITES else attr

    def _write(self, name: str, *args, **kwargs):
        if self._pending and not self.flush():
            self._spool(name, args, kwargs)  # keep order: nothing overtakes what is already queued
            return None
        try:
            return getattr(self._client, name)(*args, **kwargs)
        except Exception as err:
            if not is_outage(err):
                raise
            self._last_try = time.monotonic()
            self.reason = outage_reason(err)
            warnings.warn(
                f"MLflow unreachable{self.label} ({self.reason}): keeping writes in {self.spool_root} and going on",
                RuntimeWarning,
                stacklevel=3,
            )
            self._spool(name, args, kwargs)
            return None

    def flush(self, force: bool = False) -> bool:
        """Send the spooled writes; True when nothing is left. Tries at most every retry_every seconds."""
        if not self._pending:
            return True
        if not force and time.monotonic() - self._last_try < self._delay:
            return False
        self._last_try = time.monotonic()
        left = replay_file(self._file, self._client)
        self._pending = left
        if left:
            self._delay = min(2 * self._delay, max(self.retry_every, 600.0))
        else:
            self._file = None  # replay_file removed it; the next outage starts a new one
            self._delay = self.retry_every
        return left == 0

    def drain(self, timeout: float) -> bool:
        """Retry until the spool is empty or timeout seconds have passed (end of fit); False: writes are left
        (`pending_note` says where)."""
        deadline = time.monotonic() + timeout
        while not self.flush(force=True):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        return True

    def pending_note(self, uri: Optional[str] = None) -> str:
        """One line for the end of a command: how many writes wait, where, and the command that sends them ('' when
        none wait). uri: the store's, as the user gave it (default: the client's)."""
        uri = uri or str(getattr(self._client, "tracking_uri", ""))
        lost = f"{self.dropped} MLflow writes could not be kept and are lost" if self.dropped else ""
        if not self._pending:
            return f"{lost} ({self.reason})" if lost and self.reason else lost
        note = waiting_note(self._pending, 1, self.spool_root, uri, self.reason, where=self._file.parent)
        return f"{note}; {lost}" if lost else note

    # Each record is self-contained JSON; artifacts are copied into the spool so that rotated
    # checkpoints or temporary directories can still be uploaded later.
    def _spool(self, name: str, args: tuple, kwargs: dict) -> None:
        run_id = kwargs.get("run_id", args[0] if args else "unknown")
        if self._file is None:
            file_name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            self._file = self.spool_root / str(run_id) / file_name
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            record = _to_record(name, args, kwargs, self._file.parent / "files" / uuid.uuid4().hex[:12])
            record["t"] = time.time()
            with open(self._file, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:  # the spool's own disk is full or read-only: say so once, the run goes on
            self.dropped += 1
            if self.dropped == 1:
                warnings.warn(
                    f"cannot keep MLflow writes in {self.spool_root} either ({err.strerror or err}): they are lost "
                    "until the store takes writes again",
                    RuntimeWarning,
                    stacklevel=1,
                )
            return
        except Exception as err:  # an object we cannot serialise: say so rather than fail the run
            self.dropped += 1
            warnings.warn(f"could not keep MLflow call {name} for later ({err}); dropped", RuntimeWarning, stacklevel=1)
            return
        self._pending += 1


def _bind(fn, args, kwargs) -> dict:
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    return dict(bound.arguments)


def _to_record(name: str, args: tuple, kwargs: dict, files: Path) -> dict:
    from mlflow import MlflowClient

    a = _bind(getattr(MlflowClient, name), (None, *args), kwargs)
    a.pop("self", None)
    run_id = a.pop("run_id")
    if name == "log_batch":
        return {
            "op": name,
            "run_id": run_id,
            "metrics": [[m.key, m.value, m.timestamp, m.step] for m in a.get("metrics") or []],
            "params": [[p.key, p.value] for p in a.get("params") or []],
            "tags": [[t.key, t.value] for t in a.get("tags") or []],
        }
    if name in ("log_text", "log_dict", "log_figure"):
        artifact_file = a["artifact_file"]
        files.mkdir(parents=True, exist_ok=True)
        local = files / Path(artifact_file).name
        if name == "log_text":
            local.write_text(a["text"])
        elif name == "log_dict":
            import yaml

            with open(local, "w") as f:
                if local.suffix in (".yaml", ".yml"):
                    yaml.safe_dump(a["dictionary"], f)
                else:
                    json.dump(a["dictionary"], f, indent=2)
        else:
            a["figure"].savefig(local, **(a.get("save_kwargs") or {}))
        parent = str(Path(artifact_file).parent)
        return {
            "op": "log_artifact",
            "run_id": run_id,
            "local_path": str(local),
            "artifact_path": None if parent == "." else parent,
        }
    if name == "log_artifact":
        files.mkdir(parents=True, exist_ok=True)
        local = files / Path(a["local_path"]).name
        shutil.copy2(a["local_path"], local)
        return {"op": name, "run_id": run_id, "local_path": str(local), "artifact_path": a.get("artifact_path")}
    if name == "log_artifacts":
        local = files / "dir"
        shutil.copytree(a["local_dir"], local)
        return {"op": name, "run_id": run_id, "local_dir": str(local), "artifact_path": a.get("artifact_path")}
    a.pop("synchronous", None)
    json.dumps(a)  # raises for values that cannot be kept
    return {"op": name, "run_id": run_id, "kwargs": a}


def _apply(client, rec: dict) -> None:
    from mlflow.entities import Metric, Param, RunTag

    op, run_id = rec["op"], rec["run_id"]
    if op == "log_batch":
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, ts, st) for k, v, ts, st in rec["metrics"]],
            params=[Param(k, v) for k, v in rec["params"]],
            tags=[RunTag(k, v) for k, v in rec["tags"]],
        )
    elif op == "log_artifact":
        client.log_artifact(run_id, rec["local_path"], rec["artifact_path"])
    elif op == "log_artifacts":
        client.log_artifacts(run_id, rec["local_dir"], rec["artifact_path"])
    else:
        getattr(client, op)(run_id, **rec["kwargs"])


def replay_file(path: Optional[Path], client) -> int:
    """Apply a spool file's records in order; rewrite it with what is left; return how many are left."""
    if path is None or not path.exists():
        return 0
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = 0
    for rec in records:
        try:
            _apply(client, rec)
        except Exception as err:
            if not is_outage(err):
                # a write the server refuses (e.g. a param logged twice on replay): skip it, keep going
                warnings.warn(f"spooled MLflow call {rec['op']} refused: {err}", RuntimeWarning, stacklevel=1)
            else:
                break
        done += 1
    left = records[done:]
    if left:
        path.write_text("".join(json.dumps(r) + "\n" for r in left))
    else:
        path.unlink()
        if path.parent.exists() and not any(p.suffix == ".jsonl" for p in path.parent.iterdir()):
            shutil.rmtree(path.parent, ignore_errors=True)
    return len(left)


def waiting_writes(spool_root) -> dict[str, int]:
    """{run id: spooled writes} under spool_root, whoever wrote them (a fit, a sweep's workers and trials)."""
    root = Path(spool_root)
    counts = {}
    for f in root.glob("*/*.jsonl") if root.is_dir() else []:
        try:
            n = sum(1 for line in f.read_text().splitlines() if line.strip())
        except OSError:
            continue
        if n:
            counts[f.parent.name] = counts.get(f.parent.name, 0) + n
    return counts


def waiting_note(writes: int, runs: int, spool_root, uri: str, reason: str = "", where=None) -> str:
    """The one line that ends a command whose MLflow writes are not all in the store; where: their folder, if not
    spool_root."""
    why = f" ({reason})" if reason else ""
    of = f" of {runs} runs" if runs > 1 else ""
    return (
        f"{writes} MLflow writes{of} not in the store yet{why}, kept in {where or spool_root} (a run shows RUNNING "
        f"there until they are sent); send them with:  mhc sweep replay {spool_root} --tracking-uri {redact(uri)}"
    )


def replay_spool(spool_root, tracking_uri: str) -> dict[str, int]:
    """`mhc sweep replay`: send every spooled write under spool_root; returns {run_id: writes left}."""
    from mlflow import MlflowClient

    check_tracking(tracking_uri, option="--tracking-uri")
    client = MlflowClient(tracking_uri)
    out = {}
    for run_dir in sorted(p for p in Path(spool_root).iterdir() if p.is_dir()):
        # several writers per run (logger, sweep): merge by time so that set_terminated comes last
        files = sorted(run_dir.glob("*.jsonl"))
        records = sorted(
            (json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()),
            key=lambda r: r["t"],
        )
        merged = run_dir / "merged.jsonl"
        merged.write_text("".join(json.dumps(r) + "\n" for r in records))
        for f in files:
            if f != merged:
                f.unlink()
        out[run_dir.name] = replay_file(merged, client)
    return out
