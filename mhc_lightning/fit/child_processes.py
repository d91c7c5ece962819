"""Child processes of `mhc`: the one place that starts them, waits for them and makes sure none outlives its job.

Used by `mhc grid` (parallel `mhc fit` runs), `mhc sweep` (worker processes) and subprocess trials (a child
`mhc fit`, possibly a multi-rank DDP run).

- Output goes to a log file; stdin is closed (a child never waits on a terminal).
- Each child runs in its own session, so its process group holds everything it starts (the DDP ranks Lightning
  starts by re-running the same command). Stopping a child stops the group: `linger` seconds to end by itself,
  then SIGTERM (Lightning shuts down cleanly), then SIGKILL (a rank stuck in a collective ignores SIGTERM).
- A parent killed with SIGKILL cannot clean up: every child, and every process a child starts, asks the kernel to
  SIGKILL it when its parent dies (`die_with_parent`, called first thing by `mhc` and by sweep workers; Linux
  PR_SET_PDEATHSIG), so a chain launcher -> worker -> rank 0 -> rank 1 dies link by link.
- `poll` reaps: a dead child is never left a zombie that liveness checks would mistake for a running process.

Cheap to import: no torch, no Lightning.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

PARENT_ENV = "MHC_PARENT_PID"  # pid of the process that started this one (launcher, worker, rank 0, ...)
TAIL_CHARS = 900  # of a failed child's log, quoted in its error; the log file has it all


def mhc_command() -> list[str]:
    """The `mhc` entry point of this environment (what the user runs), else the same through `-m`."""
    script = Path(sys.executable).with_name("mhc")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "mhc_lightning.fit.cli"]


def log_tail(log: Path, chars: int = TAIL_CHARS) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return (text[-chars:].split("\n", 1)[-1] if len(text) > chars else text).strip()


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Child:
    """One child process: started in its own session with its output in `log`, stopped as a whole group."""

    def __init__(
        self, argv: Sequence[str], log: Path, env: Optional[dict] = None, name: str = "", append_log: bool = False
    ):
        self.argv, self.log, self.name = list(argv), Path(log), name or Path(argv[0]).name
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if env is None else env, **{PARENT_ENV: str(os.getpid())})
        with open(self.log, "ab" if append_log else "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode

    def poll(self) -> Optional[int]:
        """The exit code once the child has ended (and reap it), else None."""
        return self.proc.poll()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """The exit code, or None if `timeout` seconds passed first. Ctrl-C / SIGTERM here stops the group."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        except BaseException:
            self.stop()
            raise

    def stop(self, linger: float = 0.0) -> None:
        """Give the group `linger` seconds to end by itself, then SIGTERM it, then SIGKILL what is left."""
        stop_all([self], linger)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _group_gone(self) -> bool:
        """No live process left in the child's group. Zombies do not count: a rank orphaned when rank 0 exits is
        reaped by PID 1, and in a container whose PID 1 is `mhc` itself nobody ever reaps it."""
        import psutil

        self.proc.poll()  # reap the leader ourselves
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == self.proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return False
            except (OSError, psutil.Error):  # gone meanwhile
                continue
        return True


# A fit stopped by SIGTERM ends its step, writes a checkpoint and marks its run KILLED; one that has just trained its
# last step is still ending its run. Both can take longer than a few seconds when many fits share a disk and a store.
TERM_GRACE_S = 30.0


def stop_all(children: Sequence[Child], linger: float = 0.0, grace: float = TERM_GRACE_S) -> None:
    """Stop every child's group together: `linger` seconds to end by themselves, then SIGTERM to all at once and
    `grace` seconds shared by all (signalled one by one, the last of many would be reached minutes later), then
    SIGKILL what is left."""
    left = list(children)
    for sig, wait in ((None, linger), (signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for child in left if sig is not None else ():
            child.signal_group(sig)
        deadline = time.monotonic() + wait
        while True:
            left = [c for c in left if not c._group_gone()]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not left:
            break
    for child in children:
        child.proc.poll()


class ChildFailed(RuntimeError):
    """A child exited non-zero or ran past its timeout; the message ends with the tail of its log."""

    def __init__(self, what: str, log: Path):
        super().__init__(f"{what}; end of its log:\n{log_tail(log)}")


def run(
    argv: Sequence[str],
    log: Path,
    env: Optional[dict] = None,
    timeout_s: Optional[float] = None,
    linger_s: float = 30.0,
    what: str = "",
) -> None:
    """Run one child to its end; raise ChildFailed unless it exits 0 within timeout_s. After the leader exits, the
    rest of its group (other DDP ranks) gets `linger_s` seconds to finish before it is stopped."""
    child = Child(argv, log, env)
    code = child.wait(timeout_s)
    child.stop(linger_s if code is not None else 0.0)
    what = what or f"`{' '.join(argv[:2])}`"
    if code is None:
        raise ChildFailed(f"{what} ran past its timeout of {timeout_s} s and was stopped", log)
    if code != 0:
        raise ChildFailed(f"{what} {describe_exit(code)}", log)


def die_with_parent() -> None:
    """In a child: have the kernel SIGKILL this process when its parent exits (Linux PR_SET_PDEATHSIG), and pass our
    pid on to the processes we start. A no-op unless a launcher of this module started us."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(1)  # the parent died before prctl: too late for the signal
    os.environ[PARENT_ENV] = str(os.getpid())  # Lightning copies os.environ into the ranks it starts


def visible_gpus() -> int:
    """CUDA devices children may use (0 without CUDA or torch)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def run_parallel(
    jobs: Sequence[tuple[str, list[str], Path]],
    parallel: int,
    on_done,
    poll_s: float = 0.5,
    env: Optional[dict] = None,
    spread_gpus: bool = False,
    may_start: Optional[Callable[[str], bool]] = None,
) -> list[str]:
    """Run (name, argv, log) jobs, at most `parallel` at a time, in order; call on_done(name, exit code) as each
    ends. spread_gpus: with several visible GPUs, the k-th job started sees only GPU k mod count. may_start(name):
    False keeps a job waiting (it is asked again as others end); when nothing runs and no waiting job may start, the
    rest are left. Returns the names of the jobs never started. Ctrl-C / SIGTERM stops every running child (its whole
    group) before returning."""
    pending, active = list(jobs), {}
    gpus, started = (visible_gpus() if spread_gpus else 0), 0
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while (pending or active) and stop["sig"] is None:
            while len(active) < parallel:
                startable = [job for job in pending if may_start is None or may_start(job[0])]
                if not startable:
                    break
                name, argv, log = startable[0]
                pending.remove(startable[0])
                child_env = env
                if gpus > 1:
                    child_env = dict(os.environ if env is None else env, CUDA_VISIBLE_DEVICES=str(started % gpus))
                started += 1
                active[name] = Child(argv, log, child_env, name)
            if not active:
                break  # nothing left that may start
            time.sleep(poll_s)
            for name, child in list(active.items()):  # poll every child each round: nothing stays a zombie
                code = child.poll()
                if code is not None:
                    del active[name]
                    child.stop(linger=5.0)  # leftovers of its group, if any
                    on_done(name, code)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        stop_all(list(active.values()))
    if stop["sig"] is not None:
        raise KeyboardInterrupt(f"signal {stop['sig']}: stopped {len(active)} running, {len(pending)} not started")
    return [name for name, _, _ in pending]
