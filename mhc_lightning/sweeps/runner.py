"""`mhc sweep`: storages, samplers, pruners, worker processes, and the command line.

    mhc sweep run sweeps/smoke.yaml [--workers N] [--storage URL] [--tracking-uri URI] [--set key=value ...]
    mhc sweep status sweeps/smoke.yaml [--storage URL]
    mhc sweep replay mlflow_spool --tracking-uri URI

`mhc sweep SPEC ...` is short for `mhc sweep run SPEC ...`. Every launcher, here or on another
machine, creates or loads the same study (load_if_exists) and runs workers until the study holds
`budget.n_trials` COMPLETE + PRUNED trials, so a re-run resumes and a second machine joins.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Optional

from .spec import SpecError, SweepSpec, load_spec

POLL_S = 2.0


# ---- storage / sampler / pruner -----------------------------------------------------------------
def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def default_storage(tracking_uri: str) -> str:
    """One SQLite file beside a local MLflow store (or in the current directory)."""
    if tracking_uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(tracking_uri[len('sqlite:///'):]).resolve().parent / 'sweeps.db'}"
    return f"sqlite:///{Path.cwd() / 'sweeps.db'}"


def is_journal(url: str) -> bool:
    return url.startswith("journal:") or url.endswith((".journal", ".journal.log"))


def normalize_db_url(url: str) -> str:
    """postgres:// and postgresql:// -> postgresql+psycopg2://: SQLAlchemy 2.1 defaults to psycopg 3, which the
    project does not install (psycopg2-binary is its PostgreSQL driver, also in the compose images)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix):]
    return url


def make_storage(url: str, cfg: dict[str, Any]):
    """sqlite:/postgresql:/mysql: -> RDBStorage with heartbeat + retry; journal:PATH or *.journal.log -> JournalStorage.

    Heartbeat: a RUNNING trial whose worker stopped beating for grace_period seconds is marked FAIL by the
    next worker that polls, and re-queued (same parameters) up to max_retry times.
    """
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    if is_journal(url):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal:"):] if url.startswith("journal:") else url).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    url = normalize_db_url(url)
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 60}}  # several local processes share the file
    hb = cfg.get("heartbeat_interval")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(
            url, engine_kwargs=engine_kwargs, heartbeat_interval=hb,
            grace_period=cfg.get("grace_period") if hb else None,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=cfg.get("max_retry")) if hb else None,
        )


def make_sampler(spec: SweepSpec, seed: Optional[int]):
    import optuna.samplers as S

    name, opts = spec.sampler["name"], dict(spec.sampler["options"])
    classes = {"tpe": S.TPESampler, "random": S.RandomSampler, "gp": S.GPSampler, "nsga2": S.NSGAIISampler,
               "nsga3": S.NSGAIIISampler, "qmc": S.QMCSampler, "cmaes": S.CmaEsSampler, "bruteforce": S.BruteForceSampler}
    try:
        return classes[name](seed=seed, **opts)
    except (TypeError, ValueError, ImportError) as err:
        raise SpecError(f"{spec.path}: sampler: cannot build {name} with options {opts}: {err}") from err


def make_pruner(spec: SweepSpec):
    return build_pruner(spec.pruner, where=str(spec.path))


def build_pruner(block: dict[str, Any], where: str = "<sweep>"):
    """The pruner of a spec's `pruner` block ({name, options}); also built by a subprocess trial (link.py)."""
    import optuna.pruners as P

    name, opts = block["name"], dict(block.get("options") or {})
    classes = {"none": P.NopPruner, "median": P.MedianPruner, "percentile": P.PercentilePruner,
               "successive_halving": P.SuccessiveHalvingPruner, "hyperband": P.HyperbandPruner,
               "threshold": P.ThresholdPruner, "patient": P.PatientPruner, "wilcoxon": P.WilcoxonPruner}
    try:
        if name == "patient":
            opts.setdefault("wrapped_pruner", None)
        return classes[name](**opts)
    except (TypeError, ValueError) as err:
        raise SpecError(f"{where}: pruner: cannot build {name} with options {opts}: {err}") from err


def worker_seed(spec: SweepSpec, index: int, machine: int) -> Optional[int]:
    """Each worker its own seed: identical TPE seeds in two workers propose identical trials."""
    base = spec.sampler.get("seed")
    return None if base is None else base + index + 1000 * machine


def machine_rank(explicit: Optional[int]) -> int:
    """--machine-rank, else a stable number from the hostname so that the same command on two hosts differs."""
    if explicit is not None:
        return explicit
    return zlib.crc32(socket.gethostname().encode()) % 997


def worker_id() -> str:
    """host:pid:start-time, so that a recycled pid is never mistaken for a live worker."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time():.0f}"


def _alive(wid: str) -> Optional[bool]:
    """True/False for a worker on this host; None when it runs elsewhere (only heartbeats can tell)."""
    import psutil

    host, _, rest = wid.partition(":")
    pid, _, created = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        return f"{psutil.Process(int(pid)).create_time():.0f}" == created
    except psutil.NoSuchProcess:
        return False


def fail_dead_local_trials(study, max_retry: Optional[int], only: Optional[set[str]] = None) -> list[int]:
    """Mark FAIL (and re-queue) RUNNING trials whose worker process on this host is gone.

    Used where heartbeats do not exist (journal storage) and by a launcher for its own dead workers.
    """
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        wid = t.user_attrs.get("worker")
        if not wid or (only is not None and wid not in only) or _alive(wid) is not False:
            continue
        try:
            if study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                failed.append(t.number)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    RetryHeartbeatStaleTrialCallback(max_retry=max_retry)(study, study._storage.get_trial(t._trial_id))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker got there first
    return failed


def counts(study) -> dict[str, int]:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    c = {s: sum(t.state == s for t in trials) for s in TrialState}
    return {"complete": c[TrialState.COMPLETE], "pruned": c[TrialState.PRUNED], "failed": c[TrialState.FAIL],
            "running": c[TrialState.RUNNING], "waiting": c[TrialState.WAITING],
            # trials whose objective raised (not interrupted, not heartbeat-stale): what max_failed limits
            "errors": sum(t.state == TrialState.FAIL and bool(t.user_attrs.get("error")) and not t.user_attrs.get("interrupted")
                          for t in trials)}


# ---- resolved settings shared by the launcher and its workers -------------------------------------
class Sweep:
    def __init__(self, spec: SweepSpec, storage_url: str, tracking_uri: str, spool_dir: str):
        self.spec, self.storage_url, self.tracking_uri, self.spool_dir = spec, storage_url, tracking_uri, spool_dir

    @property
    def storage_label(self) -> str:
        from .tracking import redact

        return redact(self.storage_url)

    def storage(self):
        return make_storage(self.storage_url, self.spec.storage)

    def study(self, sampler=None, storage=None):
        import optuna

        directions = [o.direction for o in self.spec.objectives]
        study = optuna.create_study(storage=storage or self.storage(), study_name=self.spec.name, directions=directions,
                                    sampler=sampler, pruner=make_pruner(self.spec), load_if_exists=True)
        have = [d.name.lower() for d in study.directions]
        if have != directions:
            raise SpecError(f"study {self.spec.name!r} in {self.storage_label} was created with directions {have}, "
                            f"the sweep file asks for {directions}: use another name")
        return study

    def tracker(self):
        from .tracking import SweepTracker

        return SweepTracker(self.tracking_uri, self.spec.mlflow["experiment"], self.spec.name, self.storage_label,
                            self.spool_dir)


def prepare(sweep: Sweep, quiet: bool = False):
    """Launcher-side setup, once per launch: tracking reachable, study created, enqueued points, parent run."""
    from .spec import check_callbacks
    from .tracking import check_tracking

    check_tracking(sweep.tracking_uri)
    for w in check_callbacks(sweep.spec):
        print(f"[mhc sweep] {w}", file=sys.stderr)
    make_sampler(sweep.spec, 0)  # fail on bad sampler options before any worker starts
    study = sweep.study()
    for point in sweep.spec.enqueue:
        study.enqueue_trial(point, skip_if_exists=True)
    tracker = sweep.tracker()
    tracker.ensure_parent(study, sweep.spec)
    return study, tracker


def run_worker(sweep: Sweep, index: int, machine: int, threads: Optional[int] = None) -> int:
    """One worker: trials one at a time until the study's budget is met. Returns an exit code."""
    import optuna

    from .objective import TrialRunner
    from .spec import check_callbacks

    if threads:
        import torch

        torch.set_num_threads(threads)
    spec = sweep.spec
    check_callbacks(spec)  # same skipped-parameter decisions as the launcher
    seed = worker_seed(spec, index, machine)
    storage = sweep.storage()
    study = sweep.study(sampler=make_sampler(spec, seed), storage=storage)
    tracker = sweep.tracker()
    tracker.ensure_parent(study)
    wid = worker_id()
    runner = TrialRunner(spec, tracker, sweep.tracking_uri, {"id": wid, "index": index, "machine": machine, "seed": seed},
                         sweep.spool_dir, sweep.storage_url)
    journal = is_journal(sweep.storage_url)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM between trials: same clean path as Ctrl-C
    deadline = time.monotonic() + spec.timeout_s if spec.timeout_s else None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"[worker {machine}.{index}] {wid} seed={seed} study={spec.name} storage={sweep.storage_label}", flush=True)
    code = 0
    try:
        while True:
            optuna.storages.fail_stale_trials(study)  # heartbeat storages; no-op otherwise
            if journal:
                fail_dead_local_trials(study, spec.storage.get("max_retry"))
            c = counts(study)
            if c["complete"] + c["pruned"] >= spec.n_trials:
                break
            if c["errors"] > spec.max_failed:
                print(f"[worker {machine}.{index}] {c['errors']} trials failed (budget.max_failed={spec.max_failed}); "
                      "stopping: see the failed runs' optuna.error tag", file=sys.stderr, flush=True)
                code = 3
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            if c["complete"] + c["pruned"] + c["running"] >= spec.n_trials and not c["waiting"]:
                time.sleep(POLL_S)  # the last trials run elsewhere; stay to re-run them if their worker dies
                continue
            study.optimize(runner, n_trials=1, catch=(Exception,), gc_after_trial=True)
            runner.current = None  # an interrupt from now on is not inside a trial
    except KeyboardInterrupt:
        # The interrupted trial is FAIL now; queue it again so that a re-run of the sweep resumes it.
        t = runner.current
        if t is not None:
            from optuna.storages import RetryHeartbeatStaleTrialCallback
            from optuna.trial import TrialState

            frozen = study._storage.get_trial(t._trial_id)
            if frozen.state == TrialState.FAIL:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    RetryHeartbeatStaleTrialCallback(max_retry=None)(study, frozen)
        code = 130
    finally:
        try:
            tracker.reconcile(study)
        except Exception as err:  # the tracking server may be the reason we stop
            print(f"[worker {machine}.{index}] MLflow reconcile skipped: {err}", file=sys.stderr)
    return code


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _worker_cmd(sweep: Sweep, args, index: int, machine: int, threads: int) -> list[str]:
    # the storage URL (it may hold a password) goes through the environment, not the visible command line
    cmd = [sys.executable, "-m", "mhc_lightning.sweeps", "worker", str(sweep.spec.path), "--index", str(index),
           "--machine-rank", str(machine), "--tracking-uri", sweep.tracking_uri,
           "--spool-dir", sweep.spool_dir, "--threads", str(threads)]
    for s in args.set or []:
        cmd += ["--set", s]
    if args.n_trials is not None:
        cmd += ["--n-trials", str(args.n_trials)]
    if args.study_name:
        cmd += ["--study-name", args.study_name]
    return cmd


def launch(sweep: Sweep, args) -> int:
    """Start --workers processes (or run one in this process), wait, then write the study's summary to MLflow."""
    study, tracker = prepare(sweep)
    machine = machine_rank(args.machine_rank)
    n = args.workers
    print(f"[mhc sweep] study {sweep.spec.name!r}: storage {sweep.storage_label}, MLflow {tracker.uri} "
          f"(experiment {sweep.spec.mlflow['experiment']!r}, parent run {tracker.parent_id}), {n} worker(s)", flush=True)
    code = 0
    if n == 1:
        threads = args.threads or None
        code = run_worker(sweep, 0, machine, threads)
    else:
        threads = args.threads or max(1, (os.cpu_count() or 1) // n)
        log_dir = Path(args.log_dir or Path("sweep_logs") / sweep.spec.name)
        log_dir.mkdir(parents=True, exist_ok=True)
        gpus = [g for g in (args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "")).split(",") if g.strip()]
        procs = []
        for i in range(n):
            env = dict(os.environ, MHC_SWEEP_STORAGE=sweep.storage_url)
            if len(gpus) > 1:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]  # one GPU per worker, round robin
            log = open(log_dir / f"worker-{machine}-{i}.log", "a")
            procs.append((subprocess.Popen(_worker_cmd(sweep, args, i, machine, threads), stdout=log,
                                           stderr=subprocess.STDOUT, env=env), log))
        print(f"[mhc sweep] worker logs: {log_dir}/", flush=True)
        code = _supervise(sweep, study, procs)
    c = counts(study)
    complete = c["complete"] + c["pruned"] >= sweep.spec.n_trials
    try:
        tracker.reconcile(study)
        summary = tracker.finalize(study, sweep.spec, complete)
    except Exception as err:
        print(f"[mhc sweep] could not write the summary to MLflow ({err}); re-run the same command to retry",
              file=sys.stderr)
        summary = {"counts": c}
    _print_summary(sweep, tracker, summary, complete)
    return code


def _supervise(sweep: Sweep, study, procs) -> int:
    """Wait for the workers, print progress, forward Ctrl-C / SIGTERM, clean up after dead workers."""
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    last = None
    try:
        while any(p.poll() is None for p, _ in procs):
            if stop["sig"] is not None:
                for p, _ in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 60
                while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
                    time.sleep(0.5)
                for p, _ in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                break
            c = counts(study)
            line = f"complete {c['complete']}, pruned {c['pruned']}, failed {c['failed']}, running {c['running']}"
            if line != last:
                print(f"[mhc sweep] {line} (budget {sweep.spec.n_trials})", flush=True)
                last = line
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for _, log in procs:
            log.close()
    # Trials left RUNNING by a worker of ours that died: fail and re-queue them now rather than after the heartbeat.
    import psutil

    ours = set()
    for p, _ in procs:
        try:
            ours.add(f"{socket.gethostname()}:{p.pid}:{psutil.Process(p.pid).create_time():.0f}")
        except psutil.NoSuchProcess:
            ours.update(t.user_attrs.get("worker") for t in study.get_trials(deepcopy=False)
                        if str(t.user_attrs.get("worker", "")).startswith(f"{socket.gethostname()}:{p.pid}:"))
    fail_dead_local_trials(study, sweep.spec.storage.get("max_retry"), only=ours)
    codes = [p.returncode for p, _ in procs]
    if stop["sig"] is not None:
        return 130
    return next((c for c in codes if c), 0)


def _print_summary(sweep: Sweep, tracker, summary: dict, complete: bool) -> None:
    c = summary.get("counts", {})
    print(f"[mhc sweep] study {sweep.spec.name!r} {'complete' if complete else 'not complete (re-run to continue)'}: "
          + ", ".join(f"{k} {v}" for k, v in c.items()))
    if "best" in summary:
        b = summary["best"]
        print(f"[mhc sweep] best trial {b['trial']}: {sweep.spec.objectives[0].label} = {b['value']:.4f}, "
              f"run {b['run_id']}, params {b['params']}")
    if "pareto_front" in summary:
        print(f"[mhc sweep] Pareto front: trials {[t['trial'] for t in summary['pareto_front']]}")
    print(f"[mhc sweep] MLflow parent run {tracker.parent_id} at {tracker.uri}")
    if sweep.tracking_uri.startswith("sqlite:"):
        print(f"[mhc sweep] view:  mlflow ui --backend-store-uri {sweep.tracking_uri}")
    if not is_journal(sweep.storage_url):
        print(f"[mhc sweep] dashboard:  optuna-dashboard {sweep.storage_label}")


def status(sweep: Sweep) -> int:
    import optuna

    try:
        study = optuna.load_study(study_name=sweep.spec.name, storage=sweep.storage())
    except KeyError:
        print(f"no study {sweep.spec.name!r} in {sweep.storage_label}")
        return 1
    c = counts(study)
    print(f"study {sweep.spec.name!r} in {sweep.storage_label}: " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "errors")
          + f" (budget {sweep.spec.n_trials})")
    for t in study.get_trials(deepcopy=False):
        vals = t.values if t.values is not None else "-"
        print(f"  trial {t.number:4d} {t.state.name:8s} {vals} {t.params} run={t.user_attrs.get('mlflow_run_id', '-')}")
    return 0


# ---- command line -----------------------------------------------------------------------------------
def _parse_set(items: Optional[list[str]]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)  # numbers and booleans as YAML reads them
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mhc sweep", description="Optuna sweeps of `mhc fit`, tracked in MLflow.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,status,replay}")  # `worker` is internal

    def common(sp, worker: bool = False):
        sp.add_argument("spec", help="sweep file, e.g. sweeps/constraint_intensity.yaml")
        sp.add_argument("--storage", help="Optuna storage: sqlite:///x.db, postgresql://u:p@host/db, journal:path "
                                          "(default: $OPTUNA_STORAGE, else sweeps.db beside the MLflow store)")
        sp.add_argument("--tracking-uri", help="MLflow: sqlite:///abs/mlflow.db or http://host:5000 "
                                               "(default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra fixed `mhc fit` value, repeatable")
        sp.add_argument("--study-name", help="override the sweep file's name")
        sp.add_argument("--n-trials", type=int, help="override budget.n_trials")
        sp.add_argument("--spool-dir", default="mlflow_spool", help="where MLflow writes wait while the server is down")

    run = sub.add_parser("run", help="run (or resume, or join) a sweep")
    common(run)
    run.add_argument("--workers", type=int, default=1, help="parallel worker processes on this machine")
    run.add_argument("--machine-rank", type=int, help="distinct per machine, for sampler seeds (default: from hostname)")
    run.add_argument("--threads", type=int, help="torch threads per worker (default: cores / workers)")
    run.add_argument("--gpus", help="comma-separated GPU ids to spread workers over (default: $CUDA_VISIBLE_DEVICES)")
    run.add_argument("--log-dir", help="worker logs (default: sweep_logs/<study>)")
    run.add_argument("--dry-run", action="store_true", help="print the `mhc fit` command of one sampled trial and exit")

    st = sub.add_parser("status", help="trial counts and states of a study")
    common(st)

    w = sub.add_parser("worker")  # started by `run --workers N`
    common(w)
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--machine-rank", type=int, required=True)
    w.add_argument("--threads", type=int)

    rp = sub.add_parser("replay", help="send MLflow writes kept while the server was down")
    rp.add_argument("spool", help="spool directory (default name: mlflow_spool)")
    rp.add_argument("--tracking-uri", required=True)
    return p


def _sweep_from_args(args) -> Sweep:
    spec = load_spec(args.spec, _parse_set(args.set))
    if args.study_name:
        if spec.mlflow["experiment"] == spec.name:  # the experiment follows the study unless set explicitly
            spec.mlflow["experiment"] = args.study_name
        spec.name = args.study_name
    if args.n_trials is not None:
        spec.n_trials = args.n_trials
    uri = args.tracking_uri or spec.mlflow["tracking_uri"] or default_tracking_uri()
    storage = (args.storage or (os.environ.get("MHC_SWEEP_STORAGE") if args.command == "worker" else None)
               or spec.storage["url"] or os.environ.get("OPTUNA_STORAGE") or default_storage(uri))
    return Sweep(spec, storage, uri, str(Path(args.spool_dir).resolve()))


def dry_run(sweep: Sweep) -> int:
    import optuna

    from .objective import fit_command
    from .spec import check_callbacks, sample, trial_args

    for w in check_callbacks(sweep.spec):
        print(f"# {w}")
    study = optuna.create_study(sampler=make_sampler(sweep.spec, sweep.spec.sampler.get("seed")),
                                directions=[o.direction for o in sweep.spec.objectives])
    trial = study.ask()
    print(fit_command(trial_args(sweep.spec, sample(trial, sweep.spec))))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("run", "status", "worker", "replay", "-h", "--help"):
        argv = ["run", *argv]  # `mhc sweep SPEC` == `mhc sweep run SPEC`
    args = build_parser().parse_args(argv)
    import optuna

    from .tracking import TrackingUnreachable, replay_spool

    # heartbeats, fail_stale_trials and the retry callback are marked experimental; we rely on them knowingly
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    try:
        if args.command == "replay":
            left = replay_spool(args.spool, args.tracking_uri)
            for run_id, n in left.items():
                print(f"run {run_id}: {'all writes sent' if n == 0 else f'{n} writes still waiting'}")
            return 1 if any(left.values()) else 0
        sweep = _sweep_from_args(args)
        if args.command == "status":
            return status(sweep)
        if args.command == "worker":
            return run_worker(sweep, args.index, args.machine_rank, args.threads)
        if args.dry_run:
            return dry_run(sweep)
        if args.workers < 1:
            raise SpecError(f"--workers must be >= 1, got {args.workers}")
        return launch(sweep, args)
    except (SpecError, TrackingUnreachable) as err:
        print(f"mhc sweep: error: {err}", file=sys.stderr)
        return 2
