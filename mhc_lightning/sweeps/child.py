"""A subprocess trial's processes: the sweep worker starts one child `mhc fit`, waits for it, and makes sure that
nothing of it outlives the trial.

The child runs in its own session, so its process group holds every rank that Lightning starts from it
(DDP re-runs the same `mhc fit` command per extra rank). Whatever ends the wait (normal exit, a failure, a
timeout, Ctrl-C or SIGTERM in the worker), the group is stopped before the trial is recorded. A worker killed
with SIGKILL cannot do that: there every rank dies with its parent instead (`die_with_parent`, called in each
rank by link.py). Cheap to import: no torch, no Lightning.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

STORAGE_ENV = "MHC_SWEEP_STORAGE"  # the Optuna storage URL, for the child's rank 0
PARENT_ENV = "MHC_TRIAL_PARENT_PID"  # pid of the process that started this one: the worker, then rank 0, ...
TAIL_CHARS = 900  # of the child's log, in the trial's error (Optuna user attr, MLflow tag); trial.log has it all
LINGER_S = 30.0  # after rank 0 exits, how long the other ranks may take to finish by themselves


class ChildFailed(RuntimeError):
    """The child `mhc fit` failed (exit code, timeout); the message ends with the tail of its log."""

    def __init__(self, what: str, log: Path):
        text = log.read_text(errors="replace") if log.is_file() else ""
        tail = text[-TAIL_CHARS:].split("\n", 1)[-1] if len(text) > TAIL_CHARS else text
        super().__init__(f"{what}; end of its log:\n{tail.strip()}")


def mhc_command() -> list[str]:
    """The `mhc` entry point of this environment (what the user runs), else the same through `-m`."""
    script = Path(sys.executable).with_name("mhc")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "mhc_lightning.cli"]


def run_child(args: list[str], log: Path, storage_url: Optional[str], timeout_s: Optional[float]) -> None:
    """Run `mhc fit ARGS` with its output in `log`; raise ChildFailed unless it exits 0 within timeout_s."""
    # the storage URL may hold a password: environment, not command line (nor the config.yaml the run logs)
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid())}, **({STORAGE_ENV: storage_url} if storage_url else {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen([*mhc_command(), "fit", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rc: Optional[int] = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    except BaseException:  # Ctrl-C / SIGTERM in the worker: stop the ranks now
        stop_group(proc)
        raise
    stop_group(proc, LINGER_S if rc is not None else 0.0)
    if rc is None:
        raise ChildFailed(f"`mhc fit` ran past trial.timeout_s={timeout_s} and was stopped", log)
    if rc != 0:
        raise ChildFailed(f"`mhc fit` exited with code {rc}", log)


def _gone(proc: subprocess.Popen) -> bool:
    """No live process left in the child's group. Zombies do not count: a rank orphaned when rank 0 exits is
    reaped by PID 1, and in a container whose PID 1 is `mhc` itself nobody ever reaps it."""
    import psutil

    proc.poll()  # reap the leader ourselves
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return False
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    return True


def _wait_gone(proc: subprocess.Popen, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def stop_group(proc: subprocess.Popen, linger: float = 0.0) -> None:
    """Give the child's process group `linger` seconds to end by itself, then SIGTERM it (Lightning shuts down
    cleanly), then SIGKILL what is left (a rank stuck in a collective ignores SIGTERM)."""
    for sig, wait in ((None, linger), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
        if _wait_gone(proc, wait):
            return


def die_with_parent() -> None:
    """In a child: SIGKILL this process when its parent exits (Linux PR_SET_PDEATHSIG), and pass our pid on to the
    processes we start, so that a chain worker -> rank 0 -> rank 1 dies link by link."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(1)  # the parent died before prctl: too late for the signal
    os.environ[PARENT_ENV] = str(os.getpid())  # Lightning copies os.environ into the ranks it starts
