"""The launcher of `mhc sweep run`: checks before any trial, worker processes, supervision, and the summary.

Every launcher, here or on another machine, creates or loads the same study (load_if_exists) and runs workers until
the study holds `budget.n_trials` COMPLETE + PRUNED trials, so a re-run resumes and a second machine joins.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from ..loggers.credentials import mask
from ..loggers.store import store_error
from .factories import is_journal, make_sampler
from .settings import BUDGET_ATTR, STOP_ATTR, TRACKING_ENV, Sweep, counts

POLL_S = 2.0


def prepare(sweep: Sweep):
    """Launcher-side checks and setup, once per launch, before any worker starts: callback parameters resolved, every
    `mhc fit` key of the sweep accepted by the parser, sampler options valid (before any store is created), tracking
    store reachable; then the study (with its enqueued points) and its MLflow parent run."""
    from ..loggers.store import check_tracking
    from .trial_args import check_callbacks
    from .trial_args_check import check_trial_args

    for w in check_callbacks(sweep.spec):
        print(f"[mhc sweep] {w}", file=sys.stderr)
    check_trial_args(sweep.spec)
    make_sampler(sweep.spec, 0)
    check_tracking(sweep.tracking_uri, option="--tracking-uri")  # creates a new SQLite store
    study = sweep.study()
    # the budget this study was last asked to reach (--n-trials extends it), for `mhc sweep status`
    study.set_user_attr(BUDGET_ATTR, max(study.user_attrs.get(BUDGET_ATTR, 0), sweep.spec.n_trials))
    if study.user_attrs.get(STOP_ATTR):
        print(f"[mhc sweep] the last launch stopped with: {study.user_attrs[STOP_ATTR]}; trying again", file=sys.stderr)
        study.set_user_attr(STOP_ATTR, "")
    for point in sweep.spec.enqueue:
        study.enqueue_trial(point, skip_if_exists=True)
    tracker = sweep.tracker()
    tracker.ensure_parent(study, sweep.spec, creator=sweep.created)
    return study, tracker


def _worker_cmd(sweep: Sweep, args, index: int, machine: int, threads: int, since: float) -> list[str]:
    # the storage URL and the tracking URI (either may hold a password) go through the environment, not the visible
    # command line (_run_workers)
    cmd = [
        sys.executable,
        "-m",
        "mhc_lightning.sweeps",
        "worker",
        str(sweep.spec.path),
        "--index",
        str(index),
        "--machine-rank",
        str(machine),
        "--spool-dir",
        sweep.spool_dir,
        "--threads",
        str(threads),
        "--since",
        f"{since:.3f}",
    ]
    for s in args.set or []:
        cmd += ["--set", s]
    if args.n_trials is not None:
        cmd += ["--n-trials", str(args.n_trials)]
    if args.study_name:
        cmd += ["--study-name", args.study_name]
    return cmd


def launch(sweep: Sweep, args) -> int:
    """Start --workers processes (or run one in this process), wait, then write the study's summary to MLflow.

    Exit code: 0 when the study holds its budget (even if a worker died on the way: its trials were re-run),
    2 the sweep cannot go on (reason printed), 3 too many failed trials in this launch, 130 interrupted, else 1."""
    from .worker import run_worker

    since = time.time()
    study, tracker = prepare(sweep)
    machine = args.machine_rank or 0
    n = args.workers
    print(
        f"[mhc sweep] study {sweep.spec.name!r}: storage {sweep.storage_label}, MLflow {mask(tracker.uri)} "
        f"(experiment {sweep.spec.mlflow['experiment']!r}, parent run {tracker.parent_id}), {n} worker(s)",
        flush=True,
    )
    if n == 1:
        code = run_worker(sweep, 0, machine, args.threads or None, since)
    else:
        code = _run_workers(sweep, study, args, machine, since)
    c = counts(study, since)
    complete = c["complete"] + c["pruned"] >= sweep.spec.n_trials
    try:
        tracker.reconcile(study)
        summary = tracker.finalize(study, sweep.spec, complete)
    except Exception as err:
        print(
            f"[mhc sweep] could not write the summary to MLflow ({store_error(err)}); re-run the same command to retry",
            file=sys.stderr,
        )
        summary = {"counts": c}
    stopped = study.user_attrs.get(STOP_ATTR)
    _print_summary(sweep, tracker, summary, complete, c, stopped)
    _print_waiting(sweep, tracker.client.reason)
    if complete and code != 130:
        return 0
    if stopped:
        print(f"mhc sweep: error: {stopped}", file=sys.stderr)
        return 2
    return code or 1


def _run_workers(sweep: Sweep, study, args, machine: int, since: float) -> int:
    from optuna.trial import TrialState

    from ..fit.child_processes import Child, describe_exit
    from .liveness import fail_dead_local_trials, worker_id

    n = args.workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    log_dir = Path(args.log_dir or Path("sweep_logs") / sweep.spec.name)
    gpus = [g for g in (args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "")).split(",") if g.strip()]
    workers: list[tuple[str, Child, str]] = []
    for i in range(n):
        env = dict(os.environ, MHC_SWEEP_STORAGE=sweep.storage_url, **{TRACKING_ENV: sweep.tracking_uri})
        if len(gpus) > 1:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]  # one GPU per worker, round robin
        child = Child(
            _worker_cmd(sweep, args, i, machine, threads, since),
            log_dir / f"worker-{machine}-{i}.log",
            env,
            name=f"worker {machine}.{i}",
            append_log=True,
        )
        workers.append((child.name, child, worker_id(child.pid)))
    print(f"[mhc sweep] worker logs: {log_dir}/", flush=True)

    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    last, reported = None, set()
    try:
        while True:
            codes = {name: child.poll() for name, child, _ in workers}  # every worker, every round: no zombies
            for name, child, wid in workers:
                code = codes[name]
                if code is None or name in reported:
                    continue
                reported.add(name)
                # Its RUNNING trials (if it died) fail and are queued again now, not after a heartbeat timeout (another
                # worker may have done so already: a killed trial is the one FAIL of this worker without an error).
                fail_dead_local_trials(study, sweep.spec.storage.get("max_retry"), only={wid})
                lost = [
                    t.number
                    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                    if t.user_attrs.get("worker") == wid and not t.user_attrs.get("error")
                ]
                if code != 0 or lost:
                    print(
                        f"[mhc sweep] {name} (pid {child.pid}) {describe_exit(code)}"
                        + (f"; its trial(s) {lost} failed and were queued again" if lost else "")
                        + f"; log: {child.log}",
                        file=sys.stderr,
                        flush=True,
                    )
            if all(code is not None for code in codes.values()):
                break
            if stop["sig"] is not None:
                for _, child, _ in workers:  # each worker fails and re-queues its trial, then exits
                    if child.poll() is None:
                        child.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 60
                while any(child.poll() is None for _, child, _ in workers) and time.monotonic() < deadline:
                    time.sleep(0.5)
                for _, child, _ in workers:
                    child.stop()
                return 130
            c = counts(study, since)
            line = f"complete {c['complete']}, pruned {c['pruned']}, failed {c['failed']}, running {c['running']}"
            if line != last:
                print(f"[mhc sweep] {line} (budget {sweep.spec.n_trials})", flush=True)
                last = line
            # a round every POLL_S, sooner when a worker ends: its trials are queued again (and the sweep ends) at once
            deadline = time.monotonic() + POLL_S
            while time.monotonic() < deadline and stop["sig"] is None:
                if any(child.poll() is not None and name not in reported for name, child, _ in workers):
                    break
                time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    codes = [child.returncode for _, child, _ in workers]
    return next((c for c in codes if c and c > 0), 0 if all(c == 0 for c in codes) else 1)


def _print_summary(sweep: Sweep, tracker, summary: dict, complete: bool, c: dict, stopped: Optional[str]) -> None:
    from ..loggers.store import ui_hint

    counts_ = summary.get("counts", c)
    if complete:
        state = "complete"
    elif stopped:
        state = "stopped"
    elif c["errors"] > sweep.spec.max_failed:
        state = (
            f"not complete: {c['errors']} trials failed in this launch "
            f"(budget.max_failed={sweep.spec.max_failed}); fix the cause (the failed runs' optuna.error tag), "
            "then run the same command again to continue"
        )
    else:
        state = "not complete (run the same command again to continue)"
    print(f"[mhc sweep] study {sweep.spec.name!r} {state}: " + ", ".join(f"{k} {v}" for k, v in counts_.items()))
    if "best" in summary:
        b = summary["best"]
        print(
            f"[mhc sweep] best trial {b['trial']}: {sweep.spec.objectives[0].label} = {b['value']:.4f}, "
            f"run {b['run_id']}, params {b['params']}"
        )
    if "pareto_front" in summary:
        print(f"[mhc sweep] Pareto front: trials {[t['trial'] for t in summary['pareto_front']]}")
    print(f"[mhc sweep] MLflow parent run {tracker.parent_id} at {mask(tracker.uri)}")
    if sweep.tracking_uri.startswith("sqlite:"):
        print(f"[mhc sweep] view:  {ui_hint(sweep.tracking_uri)}")
    if not is_journal(sweep.storage_url):
        print(dashboard_hint(sweep.storage_label))


def _print_waiting(sweep: Sweep, reason: str) -> None:
    """The last line when MLflow writes of this launch (its summary, its workers' and trials' runs) wait in the spool:
    the parent run, or a trial's, shows RUNNING in MLflow until they are sent."""
    from ..loggers.spool import waiting_note, waiting_writes

    waiting = waiting_writes(sweep.spool_dir)
    if waiting:
        note = waiting_note(sum(waiting.values()), len(waiting), sweep.spool_dir, sweep.tracking_uri, reason)
        print(f"[mhc sweep] {note}", flush=True)


def dashboard_hint(storage_label: str) -> str:
    """The optuna-dashboard command for the study's storage, and how to install it where it is not (an extra)."""
    import importlib.util

    line = f"[mhc sweep] dashboard:  optuna-dashboard {storage_label}"
    if "***" in storage_label:
        line += "   (with your password for ***)"
    if importlib.util.find_spec("optuna_dashboard") is None:
        line += '   (not installed here: pip install optuna-dashboard, or pip install -e ".[dashboard]")'
    return line


def status(sweep: Sweep) -> int:
    import optuna

    try:
        study = optuna.load_study(study_name=sweep.spec.name, storage=sweep.storage())
    except KeyError:
        print(f"no study {sweep.spec.name!r} in {sweep.storage_label}")
        return 1
    c = counts(study)
    shown = ", ".join(f"{k} {v}" for k, v in c.items() if k != "errors")
    budget = max(study.user_attrs.get(BUDGET_ATTR, 0), sweep.spec.n_trials)
    print(f"study {sweep.spec.name!r} in {sweep.storage_label}: {shown} (budget {budget})")
    for t in study.get_trials(deepcopy=False):
        vals = t.values if t.values is not None else "-"
        print(f"  trial {t.number:4d} {t.state.name:8s} {vals} {t.params} run={t.user_attrs.get('mlflow_run_id', '-')}")
    return 0


def dry_run(sweep: Sweep) -> int:
    import optuna

    from .objective import fit_command
    from .trial_args import check_callbacks, sample, trial_args
    from .trial_args_check import check_trial_args

    for w in check_callbacks(sweep.spec):
        print(f"# {w}")
    check_trial_args(sweep.spec)
    study = optuna.create_study(
        sampler=make_sampler(sweep.spec, sweep.spec.sampler.get("seed")),
        directions=[o.direction for o in sweep.spec.objectives],
    )
    trial = study.ask()
    print(mask(fit_command(trial_args(sweep.spec, sample(trial, sweep.spec)))))
    return 0
