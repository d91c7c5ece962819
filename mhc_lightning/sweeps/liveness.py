"""Which sweep workers are alive, and what happens to the trials of those that are not.

A worker is named host:pid:start-time, so that a recycled pid is never mistaken for a live worker. On its own host a
worker's liveness is known at once (a zombie, i.e. a dead process its parent has not reaped yet, counts as dead);
elsewhere only the storage's heartbeat can tell. Journal storages have no heartbeat, so for them this is the only
way a killed worker's trial is failed and run again.
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Optional


def worker_id(pid: Optional[int] = None) -> str:
    """host:pid:start-time of this process (or of `pid`, a process of this host)."""
    import psutil

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{psutil.Process(pid).create_time():.0f}"


def is_alive(wid: str) -> Optional[bool]:
    """True/False for a worker on this host; None when it runs elsewhere (only heartbeats can tell)."""
    import psutil

    host, _, rest = wid.partition(":")
    pid, _, created = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        proc = psutil.Process(int(pid))
        return f"{proc.create_time():.0f}" == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fail_dead_local_trials(study, max_retry: Optional[int], only: Optional[set[str]] = None) -> list[int]:
    """Mark FAIL, and queue again with the same parameters (up to max_retry times), the RUNNING trials whose worker
    process on this host is gone (or, with `only`, those of these workers). Returns the failed trial numbers."""
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        wid = t.user_attrs.get("worker")
        if not wid or (only is not None and wid not in only) or (only is None and is_alive(wid) is not False):
            continue
        try:
            study.tell(t.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):  # finished meanwhile (another worker got there first)
            continue
        failed.append(t.number)
        frozen = next(x for x in study.get_trials(deepcopy=False) if x.number == t.number)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            RetryHeartbeatStaleTrialCallback(max_retry=max_retry)(study, frozen)
    return failed
