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
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from .errors import UserError
from .names import file_name, path_name_problem

AXIS_SHORT = {"model.arch.n_layers": "L", "seed_everything": "s", "trainer.deterministic": "det"}


class GridError(UserError):
    """A grid file that cannot run; the message names the file and the key."""


def load_grid(path: Path) -> dict:
    if not Path(path).is_file():
        raise GridError(f"grid file {str(path)!r} not found")
    spec = yaml.safe_load(Path(path).read_text())
    for key in ("experiment", "configs", "variants"):
        if not isinstance(spec, dict) or key not in spec:
            raise GridError(f"{path}: missing required key {key!r} (needs experiment, configs, variants, axes)")
    if not isinstance(spec["variants"], dict) or not spec["variants"]:
        raise GridError(f"{path}: 'variants' must be a non-empty mapping of name -> overrides")
    for variant in spec["variants"]:  # the first part of every run name, and so of its log file's name
        problem = path_name_problem(variant)
        if problem:
            raise GridError(f"{path}: variants: {problem}")
    spec.setdefault("axes", {})
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
                argv += [f"--trainer.logger.init_args.experiment_name={spec['experiment']}",
                         f"--trainer.logger.init_args.run_name={name}"] + extra
                runs.append((name, tags, argv))
    return runs


def log_path(logs: Path, run_name: str) -> Path:
    """A run's log file, always inside `logs`: axis values (a corpus path) may put a '/' in the run name."""
    return logs / f"{file_name(run_name)}.log"


def prepare_store(uri: str, experiment: str):
    """Create the tracking store and the experiment once, before the runs: parallel first runs would race on both."""
    from mlflow import MlflowClient

    from .loggers.store import check_tracking, ensure_experiment

    check_tracking(uri)
    client = MlflowClient(uri)
    return client, ensure_experiment(client, experiment)


def tag_runs(client, experiment_id: str, name: str, tags: dict) -> None:
    """Tag a finished run by name. Tags go on afterwards: passed through the CLI, jsonargparse turns
    numeric strings into ints, which the MLflow REST client rejects."""
    from .loggers.filters import equals

    for run in client.search_runs([experiment_id], filter_string=equals("attributes.run_name", name)):
        if run.info.run_name != name:
            continue
        for k, v in tags.items():
            client.set_tag(run.info.run_id, k, str(v))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mhc grid", description=__doc__.split("\n")[0])
    p.add_argument("grid", type=Path)
    p.add_argument("--parallel", type=int, default=1, help="processes at once (they share the device)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--logs", type=Path, default=Path("grid_logs"), help="one log file per run")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--skip-finished", action="store_true",
                   help="skip runs whose name already has a FINISHED run in the experiment (continue a grid in parts)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from .child_processes import describe_exit, mhc_command, run_parallel
    from .loggers.credentials import clean_tracking_env
    from .loggers.store import default_tracking_uri

    clean_tracking_env()  # the runs inherit it: a password goes to MLflow's credential variables, not into configs
    p = build_parser()
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    try:
        spec = load_grid(args.grid)
    except GridError as err:
        print(f"mhc grid: error: {err}", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    runs = expand(spec, root if (root / spec["configs"][0]).exists() else Path.cwd(), [f"--{s}" for s in args.set])
    if args.dry_run:
        for name, _, a in runs:
            print(name, " ".join(a))
        return 0
    client, exp_id = prepare_store(default_tracking_uri(), spec["experiment"])
    if args.skip_finished:
        done = {r.info.run_name for r in client.search_runs([exp_id], filter_string="attributes.status = 'FINISHED'")}
        runs = [r for r in runs if r[0] not in done]
        print(f"{len(done)} runs already finished; {len(runs)} to go")
    tags = {name: t for name, t, _ in runs}
    failed: list[str] = []
    t0 = time.time()

    def on_done(name: str, code: int) -> None:
        tag_runs(client, exp_id, name, tags[name])
        if code:
            failed.append(name)
        print(f"[{time.time() - t0:7.1f}s] {name}: {'ok' if code == 0 else f'FAILED ({describe_exit(code)})'}",
              flush=True)

    jobs = [(name, mhc_command() + a, log_path(args.logs, name)) for name, _, a in runs]
    try:
        run_parallel(jobs, args.parallel, on_done, spread_gpus=True)  # several GPUs: round robin
    except KeyboardInterrupt as err:
        print(f"mhc grid: interrupted ({err}); `--skip-finished` continues the grid", file=sys.stderr)
        return 130
    print(f"{len(runs) - len(failed)}/{len(runs)} runs finished; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
