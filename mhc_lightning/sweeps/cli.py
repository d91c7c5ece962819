"""`mhc sweep`: the command line (argparse lives here only).

    mhc sweep run sweeps/smoke.yaml [--workers N] [--storage URL] [--tracking-uri URI] [--set key=value ...]
    mhc sweep status sweeps/smoke.yaml [--storage URL]
    mhc sweep replay mlflow_spool --tracking-uri URI

`mhc sweep SPEC ...` is short for `mhc sweep run SPEC ...`; `worker` is internal (the launcher starts workers).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from .settings import TRACKING_ENV
from .spec import SpecError, check_study_name, load_spec


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

    def common(sp):
        sp.add_argument("spec", help="sweep file, e.g. sweeps/constraint_intensity.yaml")
        sp.add_argument(
            "--storage",
            help="Optuna storage: sqlite:///x.db, postgresql://u:p@host/db, journal:path "
            "(default: $OPTUNA_STORAGE, else sweeps.db beside the MLflow store)",
        )
        sp.add_argument(
            "--tracking-uri",
            help="MLflow: sqlite:///abs/mlflow.db or http://host:5000 "
            "(default: $MLFLOW_TRACKING_URI, else ./mlflow.db)",
        )
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra fixed `mhc fit` value, repeatable")
        sp.add_argument("--study-name", help="override the sweep file's name")
        sp.add_argument("--n-trials", type=int, help="override budget.n_trials")
        sp.add_argument("--spool-dir", default="mlflow_spool", help="where MLflow writes wait while the server is down")

    run = sub.add_parser("run", help="run (or resume, or join) a sweep")
    common(run)
    run.add_argument("--workers", type=int, default=1, help="parallel worker processes on this machine")
    run.add_argument("--machine-rank", type=int, help="a label for this machine's workers (logs, tags); default 0")
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
    w.add_argument("--since", type=float, help="start of the launch (epoch s): budget.max_failed counts from here")

    rp = sub.add_parser("replay", help="send MLflow writes kept while the server was down")
    rp.add_argument("spool", help="spool directory (default name: mlflow_spool)")
    rp.add_argument("--tracking-uri", required=True)
    return p


def _sweep_from_args(args):
    from ..loggers.credentials import take_credentials
    from ..loggers.store import default_tracking_uri
    from .factories import resolve_storage_url
    from .settings import Sweep

    spec = load_spec(args.spec, _parse_set(args.set))
    if args.study_name:
        check_study_name("--study-name", args.study_name)
        if spec.mlflow["experiment"] == spec.name:  # the experiment follows the study unless set explicitly
            spec.mlflow["experiment"] = args.study_name
        spec.name = args.study_name
    if args.n_trials is not None:
        spec.n_trials = args.n_trials
    # a worker gets the launcher's URI through the environment: it may hold a database password (not for `ps`)
    inherited = os.environ.get(TRACKING_ENV) if args.command == "worker" else None
    uri = take_credentials(args.tracking_uri or inherited or spec.mlflow["tracking_uri"] or default_tracking_uri())
    explicit = args.storage or (os.environ.get("MHC_SWEEP_STORAGE") if args.command == "worker" else None)
    return Sweep(spec, resolve_storage_url(explicit, spec, uri), uri, str(Path(args.spool_dir).resolve()))


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("run", "status", "worker", "replay", "-h", "--help"):
        argv = ["run", *argv]  # `mhc sweep SPEC` == `mhc sweep run SPEC`
    args = build_parser().parse_args(argv)
    import optuna

    from ..errors import UserError
    from ..loggers.credentials import clean_tracking_env, take_credentials
    from ..loggers.spool import replay_spool
    from .supervisor import dry_run, launch, status
    from .worker import run_worker

    # heartbeats, fail_stale_trials and the retry callback are marked experimental; we rely on them knowingly
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    clean_tracking_env()  # a password in MLFLOW_TRACKING_URI goes to MLflow's credential variables (credentials.py)
    try:
        if args.command == "replay":
            left = replay_spool(args.spool, take_credentials(args.tracking_uri))
            for run_id, n in left.items():
                print(f"run {run_id}: {'all writes sent' if n == 0 else f'{n} writes still waiting'}")
            return 1 if any(left.values()) else 0
        sweep = _sweep_from_args(args)
        if args.command == "status":
            return status(sweep)
        if args.command == "worker":
            from ..fit.child_processes import die_with_parent

            die_with_parent()
            return run_worker(sweep, args.index, args.machine_rank, args.threads, args.since)
        if args.dry_run:
            return dry_run(sweep)
        if args.workers < 1:
            raise SpecError(f"--workers must be >= 1, got {args.workers}")
        return launch(sweep, args)
    except UserError as err:
        print(f"mhc sweep: error: {err}", file=sys.stderr)
        return 2
