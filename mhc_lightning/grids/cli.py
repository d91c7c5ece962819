"""`mhc grid`: a grid of `mhc fit` runs (variants x axes) as parallel child processes, each tracked in MLflow.

A grid file names base configs, named variants (sets of overrides) and axes (lists of values); every combination is
one `mhc fit` process, so a grid run is exactly what the CLI would run.
    mhc grid conf/experiments/stability_grid.yaml --parallel 8 [--dry-run] [--set KEY=VALUE ...]
Runs get the tags variant / <axis> / grid so that `mhc compare --group-by` can group them (mean +- std over seeds).
`repeats: k` runs every point k times (names end in -r1 .. -rk, tag `replicate`): the same code, config and seed
again, to measure the run-to-run spread that a seed spread is compared against.

Not an Optuna sweep with a grid sampler: a grid has no objective to report, its runs are plain `mhc fit` runs named
and tagged for the grouped report (docs/results.md reads those tags), and a study storage would add nothing to that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import yaml

from ..errors import UserError
from ..names import file_name, path_name_problem
from .check import GridError

DEFAULT_ROOT_KEY = "trainer.default_root_dir"
AXIS_SHORT = {"model.arch.n_layers": "L", "seed_everything": "s", "trainer.deterministic": "det"}


GRID_KEYS = ("experiment", "configs", "variants", "axes", "repeats")


def load_grid(path: Path) -> dict:
    if not Path(path).is_file():
        raise GridError(f"grid file {str(path)!r} not found")
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise GridError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    for key in ("experiment", "configs", "variants"):
        if not isinstance(spec, dict) or key not in spec:
            raise GridError(f"{path}: missing required key {key!r} (needs experiment, configs, variants, axes)")
    unknown = sorted(set(spec) - set(GRID_KEYS))
    if unknown:  # a misspelt `axes` would silently run the variants alone
        raise GridError(f"{path}: unknown key(s) {unknown}; allowed keys: {list(GRID_KEYS)}")
    if not isinstance(spec["experiment"], str) or not spec["experiment"].strip():
        raise GridError(f"{path}: 'experiment' must be an MLflow experiment name, got {spec['experiment']!r}")
    if not isinstance(spec["configs"], list) or not all(isinstance(c, str) for c in spec["configs"]):
        raise GridError(f"{path}: 'configs' must be a list of config files (-c), got {spec['configs']!r}")
    if not isinstance(spec["variants"], dict) or not spec["variants"]:
        raise GridError(f"{path}: 'variants' must be a non-empty mapping of name -> overrides")
    for variant, overrides in spec["variants"].items():  # the first part of every run name, and of its log's name
        problem = path_name_problem(variant)
        if problem:
            raise GridError(f"{path}: variants: {problem}")
        if overrides is not None and not isinstance(overrides, dict):
            raise GridError(
                f"{path}: variants.{variant}: must be a mapping of `mhc fit` keys to values (or empty), "
                f"got {overrides!r}"
            )
    axes = spec.setdefault("axes", {}) or {}
    spec["axes"] = axes
    if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
        raise GridError(
            f"{path}: 'axes' must be a mapping of `mhc fit` keys to non-empty lists of values, got {axes!r}"
        )
    repeats = spec.setdefault("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise GridError(f"{path}: 'repeats' must be an integer >= 1 (runs per grid point), got {repeats!r}")
    return spec


def _flag(key: str, value) -> str:
    return f"--{key}={'null' if value is None else json.dumps(value) if not isinstance(value, str) else value}"


def expand(spec: dict, root: Path, extra: list[str]) -> list[tuple[str, dict, list[str]]]:
    """Every (run name, tags, argv) of the grid."""
    axes = spec["axes"]
    runs = []
    # The first axis varies fastest and variants fastest of all, so a grid cut short (a time limit)
    # still holds every variant for the seeds it reached.
    keys = list(axes)[::-1]
    for values in itertools.product(*(axes[k] for k in keys)):
        point = dict(sorted(zip(keys, values), key=lambda kv: list(axes).index(kv[0])))
        for repeat in range(1, spec.get("repeats", 1) + 1):
            for variant, overrides in spec["variants"].items():
                name = "-".join([variant] + [f"{AXIS_SHORT.get(k, k.split('.')[-1])}{v}" for k, v in point.items()])
                tags = {"grid": spec["experiment"], "variant": variant, **{k: str(v) for k, v in point.items()}}
                if spec.get("repeats", 1) > 1:
                    name, tags["replicate"] = f"{name}-r{repeat}", str(repeat)
                argv = ["fit"] + [a for c in spec["configs"] for a in ("-c", str(root / c))]
                argv += [_flag(k, v) for k, v in {**(overrides or {}), **point}.items()]
                argv += [
                    f"--trainer.logger.init_args.experiment_name={spec['experiment']}",
                    f"--trainer.logger.init_args.run_name={name}",
                ] + extra
                runs.append((name, tags, argv))
    return runs


def report_command(spec: dict) -> list[str]:
    """The `mhc report` that compares the grid's variants at each point of its axes, pooled over seeds and repeats."""
    keys = ["variant", *(k for k in spec["axes"] if k not in ("seed_everything", "data.seed"))]
    variants = list(spec["variants"])
    baseline = ["--baseline", "residual" if "residual" in variants else variants[0]] if len(variants) > 1 else []
    return ["report", "--experiment", spec["experiment"], "--group-by", ",".join(keys), *baseline]


def log_path(logs: Path, run_name: str) -> Path:
    """A run's log file, always inside `logs`: axis values (a corpus path) may put a '/' in the run name."""
    return logs / f"{file_name(run_name)}.log"


def prepare_store(uri: str, experiment: str):
    """Create the tracking store and the experiment once, before the runs: parallel first runs would race on both."""
    from mlflow import MlflowClient

    from ..loggers.store import check_tracking, ensure_experiment

    check_tracking(uri, option=None)  # the runs take MLFLOW_TRACKING_URI
    client = MlflowClient(uri)
    return client, ensure_experiment(client, experiment)


HELP_FILE = """\
grid file (YAML; docs/grids.md has the details):
  experiment: stability                 MLflow experiment of every run (and its `grid` tag)
  configs: [conf/experiments/stability.yaml]   -c files of every run: repo root, else the current folder
  variants:                             name -> `mhc fit` overrides; one run per variant at each point
    residual: {model.arch.hyper.residual_mode: residual}
    hc_noclip: {model.arch.hyper.residual_mode: hc, trainer.gradient_clip_val: null}
  axes:                                 `mhc fit` key -> values; every combination is one point
    model.arch.n_layers: [6, 12, 24]
    seed_everything: [1, 2, 3]
  repeats: 1                            runs per point (k > 1: names end in -r1 .. -rk, tag replicate)

run names: <variant>-<axis><value>..., e.g. hc_noclip-L24-s3 (model.arch.n_layers -> L, seed_everything -> s,
trainer.deterministic -> det, other keys by their last part); tags grid, variant, one per axis key, replicate.
Before anything starts, every run's `mhc fit` arguments (configs, variant, axes, --set) are checked with `mhc fit`'s
parser and the model's rules: a mistake is one line and exit 2. --dry-run does that check, prints each run's name and
`mhc fit` command, and starts nothing. Runs go to $MLFLOW_TRACKING_URI (default ./mlflow.db)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mhc grid",
        description=__doc__.split("\n")[0],
        epilog=HELP_FILE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("grid", type=Path, help="grid file, e.g. conf/experiments/stability_grid.yaml (format below)")
    p.add_argument("--parallel", type=int, default=1, help="processes at once (they share the device)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override for every run, on a key no axis or variant sets (refused otherwise)",
    )
    p.add_argument("--logs", type=Path, default=Path("grid_logs"), help="one log file per run")
    p.add_argument(
        "--finish-within",
        type=float,
        metavar="SECONDS",
        help="start a run only while runs of its variant (their median time in the store's finished runs) would end "
        "within SECONDS of the grid's start, so that a grid run in parts under a time limit leaves no run half done",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check every run's arguments, print each run's name and `mhc fit` command, start nothing",
    )
    p.add_argument(
        "--skip-finished",
        action="store_true",
        help="skip runs whose name already has a FINISHED (or diverged) run in the experiment, and resume a KILLED or "
        "FAILED one from its last checkpoint (continue a grid in parts, or after an interruption)",
    )
    c = p.add_argument_group(
        "cluster (--launcher slurm: one SLURM job per run, a job array through submitit; "
        "a requeued job resumes its run from its own checkpoints)"
    )
    c.add_argument(
        "--launcher",
        choices=["local", "slurm", "submitit-local"],
        default="local",
        help="local: parallel processes here (default); slurm: SLURM jobs; submitit-local: the slurm "
        "path's jobs run here by submitit's LocalExecutor",
    )
    c.add_argument(
        "--runs-dir",
        type=Path,
        default=Path("runs") / "grid",
        help="jobs: each run's trainer.default_root_dir is <runs-dir>/<run name> (storage every node sees)",
    )
    c.add_argument("--timeout-min", type=int, default=24 * 60, help="jobs: time limit of each job, minutes")
    c.add_argument("--partition", help="jobs: SLURM partition")
    c.add_argument(
        "--gpus-per-node",
        type=int,
        help="jobs: GPUs per job; with N > 1 each run's fit uses all N (trainer.devices=N, one SLURM task whose fit "
        "starts its own DDP processes)",
    )
    c.add_argument("--cpus-per-task", type=int, help="jobs: CPUs per job")
    c.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="jobs: any other submitit slurm_* parameter, e.g. --slurm account=proj --slurm qos=high",
    )
    c.add_argument("--no-wait", action="store_true", help="jobs: submit and return (default: wait and report each)")
    return p


def job_parameters(args, spec: dict) -> dict:
    """submitit parameters of a grid's jobs (AutoExecutor's generic names, slurm_* for the rest)."""
    params = {
        "name": f"mhc-grid-{spec['experiment']}",
        "timeout_min": args.timeout_min,
        "slurm_array_parallelism": args.parallel,
    }
    if args.gpus_per_node is not None:
        params["tasks_per_node"] = 1  # the fit starts a process per GPU itself (jobs.py)
    for key, value in (
        ("slurm_partition", args.partition),
        ("gpus_per_node", args.gpus_per_node),
        ("cpus_per_task", args.cpus_per_task),
    ):
        if value is not None:
            params[key] = value
    for item in args.slurm:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise GridError(f"--slurm {item!r}: expected KEY=VALUE, e.g. --slurm account=proj")
        params[key if key.startswith("slurm_") else f"slurm_{key}"] = yaml.safe_load(value)
    return params


def still_to_run(client, exp_id: str, runs: list, jobs_root: Optional[Path]) -> tuple[list, set[str]]:
    """--skip-finished: the runs without a FINISHED (or diverged: it would diverge again) MLflow run of their name,
    and the names among them whose KILLED or FAILED run left a last checkpoint, which resume it (`--ckpt_path last`)
    instead of starting again from step 0. jobs_root: the cluster launchers' --runs-dir (each run's own
    default_root_dir), None for the local one (the run's trainer.default_root_dir)."""
    from ..loggers.tags import STAGE_TAG
    from .check import argv_value

    done, diverged, interrupted = set(), set(), defaultdict(list)
    found = client.search_runs([exp_id], max_results=50_000)
    tag_untagged(client, found, {name: tags for name, tags, _ in runs})
    for r in found:
        name = r.info.run_name
        if r.data.tags.get(STAGE_TAG, "fit") != "fit":
            continue
        if r.data.tags.get("mhc.diverged") == "true":
            diverged.add(name)
        elif r.info.status == "FINISHED":
            done.add(name)
        elif r.info.status in ("KILLED", "FAILED"):
            interrupted[name].append(r.info)
    done |= diverged
    todo, resumed = [], set()
    for name, tags, argv in runs:
        if name in done:
            continue
        root = jobs_root / file_name(name) if jobs_root else Path(str(argv_value(argv, DEFAULT_ROOT_KEY) or "."))
        if any(any((root / i.experiment_id / i.run_id / "checkpoints").glob("last*.ckpt")) for i in interrupted[name]):
            resumed.add(name)
        todo.append((name, tags, argv))
    print(
        f"{len(done)} runs already finished ({len(diverged & done)} of them diverged); {len(todo)} to go, "
        f"{len(resumed)} of them resuming an interrupted run from its last checkpoint",
        flush=True,
    )
    return todo, resumed


def typical_durations(client, exp_id: str) -> dict[str, float]:
    """Seconds a run of each variant takes, from the experiment's finished training runs: the median of those that
    took at most twice the quickest (a run stopped and resumed later spans the time between its parts)."""
    from ..loggers.tags import STAGE_TAG

    took = defaultdict(list)
    for r in client.search_runs([exp_id], "attributes.status = 'FINISHED'", max_results=50_000):
        variant = r.data.tags.get("variant")
        if variant and r.info.end_time and r.data.tags.get(STAGE_TAG, "fit") == "fit":
            took[variant].append((r.info.end_time - r.info.start_time) / 1000)
    return {v: statistics.median(t for t in ts if t <= 2 * min(ts)) for v, ts in took.items()}


def fits_in(deadline: float, tags: dict[str, dict], durations: dict[str, float], margin: float = 1.1):
    """may_start for run_parallel: a run starts only while a run of its variant would still end by `deadline`
    (time.monotonic(), with `margin`); a variant that has no finished run yet always starts."""

    def may_start(name: str) -> bool:
        took = durations.get(tags[name].get("variant"))
        return took is None or time.monotonic() + margin * took <= deadline

    return may_start


def tag_untagged(client, found: list, tags: dict[str, dict]) -> None:
    """Give the grid's tags to its runs in `found` that lack them: a local run is tagged by the grid when it ends, so
    one that ended as the grid was stopped, or whose grid was killed, would be left out of every grouped report."""
    for r in found:
        want = tags.get(r.info.run_name)
        if want and any(r.data.tags.get(k) != str(v) for k, v in want.items()):
            for k, v in want.items():
                client.set_tag(r.info.run_id, k, str(v))


def submit_jobs(args, spec: dict, runs: list, uri: str, exp_id: str, on_done, resumed: set[str]) -> None:
    """--launcher slurm / submitit-local: one job per run (jobs.py)."""
    from .jobs import GridPoint, executor_for, submit

    executor = executor_for(args.launcher, args.logs.resolve() / "submitit", job_parameters(args, spec))
    points = [
        GridPoint(
            name,
            argv,
            tags,
            str(args.runs_dir.resolve() / file_name(name)),
            str(log_path(args.logs.resolve(), name)),
            uri,
            exp_id,
            resume=name in resumed,
            gpus=args.gpus_per_node,
        )
        for name, tags, argv in runs
    ]
    submit(points, executor, wait=not args.no_wait, on_done=on_done)


def _print_waiting(runs: list, uri: str) -> None:
    """A line when the runs' MLflow writes wait in their spool (the store did not take them): those runs show RUNNING
    in MLflow until `mhc sweep replay` sends them."""
    from ..loggers.spool import waiting_note, waiting_writes
    from .check import argv_value

    spools = {str(argv_value(argv, "trainer.logger.init_args.spool_dir") or "mlflow_spool") for _, _, argv in runs}
    for spool in sorted(spools):
        waiting = waiting_writes(spool)
        if waiting:
            print(waiting_note(sum(waiting.values()), len(waiting), spool, uri), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    from ..fit.child_processes import describe_exit, mhc_command, run_parallel
    from ..loggers.credentials import clean_tracking_env
    from ..loggers.store import absolute_store_uri, default_tracking_uri
    from .check import check_names, check_runs, check_sets, sinkhorn_no_ops
    from .jobs import tag_runs

    started = time.monotonic()  # --finish-within counts from here, as its help says
    clean_tracking_env()  # the runs inherit it: a password goes to MLflow's credential variables, not into configs
    p = build_parser()
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.finish_within is not None and (args.finish_within <= 0 or args.launcher != "local"):
        p.error(f"--finish-within must be > 0 seconds, with --launcher local; got {args.finish_within:g} with "
                f"--launcher {args.launcher}")  # fmt: skip
    try:
        spec = load_grid(args.grid)
        check_sets(args.set, spec, args.grid)
        # the checkout, else the current folder, else the configs an installed package carries (conf/ inside it)
        roots = (Path(__file__).resolve().parents[2], Path.cwd(), Path(__file__).resolve().parents[1])
        base = next((r for r in roots if all((r / c).exists() for c in spec["configs"])), Path.cwd())
        runs = expand(spec, base, [f"--{s}" for s in args.set])
        check_names(args.grid, runs)
        check_runs(args.grid, runs)
    except GridError as err:
        print(f"mhc grid: error: {err}", file=sys.stderr)
        return 2
    no_ops = sinkhorn_no_ops(runs)
    if no_ops:
        print(f"mhc grid: {no_ops}", file=sys.stderr)
    if args.dry_run:
        for name, _, a in runs:
            print(f"{shlex.join(mhc_command() + a)}   # {name}")  # pasteable as it is
        return 0
    uri = absolute_store_uri(default_tracking_uri())
    client, exp_id = prepare_store(uri, spec["experiment"])
    resumed: set[str] = set()
    if args.skip_finished:
        jobs_root = None if args.launcher == "local" else args.runs_dir.resolve()
        runs, resumed = still_to_run(client, exp_id, runs, jobs_root)
        if args.launcher == "local":
            runs = [(name, t, [*a, "--ckpt_path", "last"] if name in resumed else a) for name, t, a in runs]
    tags = {name: t for name, t, _ in runs}
    failed: list[str] = []
    t0 = time.time()

    def on_done(name: str, code: int) -> None:
        if args.launcher == "local":  # a job tags its own run
            tag_runs(client, exp_id, name, tags[name])
        if code:
            failed.append(name)
        print(
            f"[{time.time() - t0:7.1f}s] {name}: {'ok' if code == 0 else f'FAILED ({describe_exit(code)})'}", flush=True
        )

    jobs = [(name, mhc_command() + a, log_path(args.logs, name)) for name, _, a in runs]
    left: list[str] = []
    try:
        if args.launcher != "local":
            submit_jobs(args, spec, runs, uri, exp_id, on_done, resumed)
            if args.no_wait:
                return 0
        else:
            may_start = None
            if args.finish_within is not None:
                deadline = started + args.finish_within
                may_start = fits_in(deadline, tags, typical_durations(client, exp_id))
            left = run_parallel(jobs, args.parallel, on_done, spread_gpus=True, may_start=may_start)
    except KeyboardInterrupt as err:
        if args.launcher == "local":  # the runs stopped, and any that ended as the grid was stopped
            tag_untagged(client, client.search_runs([exp_id], max_results=50_000), tags)
        print(f"mhc grid: interrupted ({err}); `--skip-finished` continues the grid", file=sys.stderr)
        return 130
    except UserError as err:
        print(f"mhc grid: error: {err}", file=sys.stderr)
        return 2
    if left:
        print(
            f"{len(left)} runs not started: runs like them take longer than was left of --finish-within "
            f"{args.finish_within:g} s; `--skip-finished` continues the grid",
            flush=True,
        )
        runs = [r for r in runs if r[0] not in left]
    print(f"{len(runs) - len(failed)}/{len(runs)} runs finished; failed: {failed or 'none'}")
    if len(failed) < len(runs):
        print(f"next: {shlex.join(mhc_command() + report_command(spec))}")
    _print_waiting(runs, uri)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
