"""Run a grid of `mhc fit` runs (variants x axes) as parallel processes, each tracked in MLflow.

A grid file names base configs, named variants (sets of overrides) and axes (lists of values);
every combination is one `mhc fit` process, so a grid run is exactly what the CLI would run.
    mhc grid conf/experiments/stability_grid.yaml --parallel 8 [--dry-run] [--set KEY=VALUE ...]
Runs get the tags variant / <axis> / grid so that `mhc compare` can group them (mean +- std over seeds).
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

AXIS_SHORT = {"model.arch.n_layers": "L", "seed_everything": "s"}


def load_grid(path: Path) -> dict:
    spec = yaml.safe_load(path.read_text())
    for key in ("experiment", "configs", "variants"):
        if key not in spec:
            raise ValueError(f"{path}: missing required key {key!r} (needs experiment, configs, variants, axes)")
    if not isinstance(spec["variants"], dict) or not spec["variants"]:
        raise ValueError(f"{path}: 'variants' must be a non-empty mapping of name -> overrides")
    spec.setdefault("axes", {})
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
        for variant, overrides in spec["variants"].items():
            name = "-".join([variant] + [f"{AXIS_SHORT.get(k, k.split('.')[-1])}{v}" for k, v in point.items()])
            tags = {"grid": spec["experiment"], "variant": variant, **{k: str(v) for k, v in point.items()}}
            argv = ["fit"] + [a for c in spec["configs"] for a in ("-c", str(root / c))]
            argv += [_flag(k, v) for k, v in {**(overrides or {}), **point}.items()]
            argv += [f"--trainer.logger.init_args.experiment_name={spec['experiment']}",
                     f"--trainer.logger.init_args.run_name={name}"] + extra
            runs.append((name, tags, argv))
    return runs


def prepare_store(experiment: str):
    """Create the tracking store and experiment once: parallel first runs would race on both."""
    import mlflow

    client = mlflow.MlflowClient(os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    exp = client.get_experiment_by_name(experiment)
    return client, exp.experiment_id if exp else client.create_experiment(experiment)


def tag_runs(client, experiment_id: str, name: str, tags: dict) -> None:
    """Tag a finished run by name. Tags go on afterwards: passed through the CLI, jsonargparse turns
    numeric strings into ints, which the MLflow REST client rejects."""
    for run in client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{name}'"):
        for k, v in tags.items():
            client.set_tag(run.info.run_id, k, str(v))


def _visible_gpus() -> int:
    """CUDA devices the children may use (0 without CUDA); counted without initialising CUDA in this process."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mhc grid", description=__doc__.split("\n")[0])
    p.add_argument("grid", type=Path)
    p.add_argument("--parallel", type=int, default=1, help="processes at once (they share the device)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--logs", type=Path, default=Path("grid_logs"), help="one log file per run")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--skip-finished", action="store_true",
                   help="skip runs whose name already has a FINISHED run in the experiment (continue a grid in parts)")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    spec = load_grid(args.grid)
    root = Path(__file__).resolve().parents[1]
    runs = expand(spec, root if (root / spec["configs"][0]).exists() else Path.cwd(), [f"--{s}" for s in args.set])
    if args.dry_run:
        for name, _, a in runs:
            print(name, " ".join(a))
        return 0
    client, exp_id = prepare_store(spec["experiment"])
    if args.skip_finished:
        done = {r.info.run_name for r in client.search_runs([exp_id], filter_string="attributes.status = 'FINISHED'")}
        runs = [r for r in runs if r[0] not in done]
        print(f"{len(done)} runs already finished; {len(runs)} to go")
    args.logs.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "mhc_lightning.cli"]
    pending, active, failed = list(runs), [], []
    gpus, started = _visible_gpus(), 0
    t0 = time.time()
    while pending or active:
        while pending and len(active) < args.parallel:
            name, tags, a = pending.pop(0)
            log = open(args.logs / f"{name}.log", "w")
            env = dict(os.environ)
            if gpus > 1:  # spread the runs over the visible GPUs, round robin
                env["CUDA_VISIBLE_DEVICES"] = str(started % gpus)
            started += 1
            active.append((name, tags, subprocess.Popen(exe + a, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        time.sleep(0.5)
        for item in list(active):
            name, tags, proc, log = item
            if proc.poll() is not None:
                active.remove(item)
                log.close()
                tag_runs(client, exp_id, name, tags)
                status = "ok" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
                if proc.returncode:
                    failed.append(name)
                print(f"[{time.time() - t0:7.1f}s] {name}: {status}", flush=True)
    print(f"{len(runs) - len(failed)}/{len(runs)} runs finished; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
