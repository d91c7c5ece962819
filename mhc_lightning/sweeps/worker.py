"""A sweep worker: trials one at a time until the study holds `budget.n_trials` COMPLETE + PRUNED trials.

Run in the launcher's process (`--workers 1`) or as `python -m mhc_lightning.sweeps worker ...` (supervisor.py).
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
import warnings
import zlib
from typing import Optional

from ..loggers.store import store_error
from .factories import is_journal, make_sampler
from .settings import STOP_ATTR, Sweep, counts

POLL_S = 2.0
MAX_DUPLICATES = 10  # proposals in a row that the study already has: the sampler has run out of new points


class _QuietDuplicates(logging.Filter):
    """Optuna logs a failed trial as two warnings, the first with its traceback; a duplicate proposal (a FAIL trial
    that trained nothing, objective.py) is not a failure to show: the worker says once when the space runs out."""

    def __init__(self):
        super().__init__()
        self._numbers: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        from .objective import DuplicateTrial

        number = re.match(r"Trial (\d+) failed", str(record.msg))
        if number is None:
            return True
        if record.exc_info and isinstance(record.exc_info[1], DuplicateTrial):
            self._numbers.add(number.group(1))
            return False
        if number.group(1) in self._numbers:  # its second line, "failed with value None"
            self._numbers.discard(number.group(1))
            return False
        return True


_QUIET_DUPLICATES = _QuietDuplicates()


def quiet_duplicates() -> None:
    """Idempotent: _QuietDuplicates on the handlers of Optuna's log (optuna.logging's own, on its root logger)."""
    for handler in logging.getLogger("optuna").handlers:
        if _QUIET_DUPLICATES not in handler.filters:
            handler.addFilter(_QUIET_DUPLICATES)


def worker_seed(base: Optional[int], wid: str, launch: float) -> Optional[int]:
    """A seed of its own for every worker and launch, derived from the sweep file's seed, the worker's id
    (host:pid:start-time) and the launch's start time. Seeds from the worker's index alone repeat: a re-run after a
    crash, or a second launcher on the same host, would propose the trials of the first again; from the id alone, so
    would a second launch in the same process (`mhc sweep` run twice from Python, one worker each: the sampler's
    random stream replayed, and the continued study's new trials drew the first launch's values again)."""
    return None if base is None else zlib.crc32(f"{base}:{wid}:{launch!r}".encode()) & 0x7FFFFFFF


def run_worker(
    sweep: Sweep, index: int, machine: int, threads: Optional[int] = None, since: Optional[float] = None
) -> int:
    """Returns an exit code: 0 budget met (or worker timeout), 2 the sweep cannot go on (reason printed),
    3 budget.max_failed exceeded, 130 interrupted. `since`: start of this launch, for budget.max_failed."""
    import optuna

    from .liveness import fail_dead_local_trials, worker_id
    from .objective import TrialRunner
    from .trial_args import check_callbacks

    if threads:
        import torch

        torch.set_num_threads(threads)
    spec = sweep.spec
    check_callbacks(spec)  # same skipped-parameter decisions as the launcher
    wid = worker_id()
    since = time.time() if since is None else since
    seed = worker_seed(spec.sampler.get("seed"), wid, since)
    study = sweep.study(sampler=make_sampler(spec, seed))
    tracker = sweep.tracker()
    tracker.ensure_parent(study, creator=sweep.created)
    worker = {"id": wid, "index": index, "machine": machine, "seed": seed}
    runner = TrialRunner(spec, tracker, sweep.tracking_uri, worker, sweep.spool_dir, sweep.storage_url)
    journal = is_journal(sweep.storage_url)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM between trials: same clean path as Ctrl-C
    deadline = time.monotonic() + spec.timeout_s if spec.timeout_s else None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    quiet_duplicates()
    me = f"[worker {machine}.{index}]"
    print(f"{me} {wid} seed={seed} study={spec.name} storage={sweep.storage_label}", flush=True)
    code, duplicates = 0, 0
    try:
        while True:
            optuna.storages.fail_stale_trials(study)  # heartbeat storages; no-op otherwise
            if journal:
                fail_dead_local_trials(study, spec.storage.get("max_retry"))
            stopped = study.user_attrs.get(STOP_ATTR)
            if stopped:
                print(f"{me} stopping: {stopped}", file=sys.stderr, flush=True)
                code = 2
                break
            c = counts(study, since)
            if c["complete"] + c["pruned"] >= spec.n_trials:
                break
            if c["errors"] > spec.max_failed:
                print(
                    f"{me} {c['errors']} trials failed in this launch (budget.max_failed={spec.max_failed}); "
                    "stopping: see the failed runs' optuna.error tag",
                    file=sys.stderr,
                    flush=True,
                )
                code = 3
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            if duplicates >= MAX_DUPLICATES:
                print(
                    f"{me} the sampler proposed {duplicates} trials in a row that the study already has: the "
                    "space looks exhausted; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                break
            if c["complete"] + c["pruned"] + c["running"] >= spec.n_trials and not c["waiting"]:
                time.sleep(POLL_S)  # the last trials run elsewhere; stay to re-run them if their worker dies
                continue
            study.optimize(runner, n_trials=1, catch=(Exception,), gc_after_trial=True)
            duplicates = duplicates + 1 if runner.duplicate else 0
            runner.current = None  # an interrupt from now on is not inside a trial
    except KeyboardInterrupt:
        # The interrupted trial is FAIL now; queue it again so that a re-run of the sweep resumes it.
        t = runner.current
        if t is not None:
            from optuna.storages import RetryHeartbeatStaleTrialCallback
            from optuna.trial import TrialState

            frozen = next(x for x in study.get_trials(deepcopy=False) if x.number == t.number)
            if frozen.state == TrialState.FAIL:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    RetryHeartbeatStaleTrialCallback(max_retry=None)(study, frozen)
        code = 130
    finally:
        try:
            tracker.reconcile(study)
        except Exception as err:  # the tracking server may be the reason we stop
            print(f"{me} MLflow reconcile skipped: {store_error(err)}", file=sys.stderr)
    return code


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
