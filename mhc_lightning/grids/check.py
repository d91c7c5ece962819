"""`mhc grid`'s checks before it starts anything, `--dry-run` included: every `--set` is KEY=VALUE on a key that no axis
or variant sets (the runs would train the --set value under tags and names that say the grid's), and every run's `mhc
fit` arguments pass `mhc fit`'s parser and the model's cross-field rules (fit/args_check.py, the mechanism `mhc sweep`
checks its trials with). Without them a misspelt `--set` started every process, each one exiting 2 with the reason
only in grid_logs/. A `sinkhorn_*` key that the grid sets for a mode without Sinkhorn gets a warning: those runs
repeat each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from ..errors import UserError

RUN_NAME_FLAG = "--trainer.logger.init_args.run_name="
MODE_KEY = "model.arch.hyper.residual_mode"
SINKHORN_PREFIX = "model.arch.hyper.sinkhorn_"


class GridError(UserError):
    """A grid file or command line that cannot run; the message names the file and the key."""


def check_sets(sets: list[str], spec: dict, grid: Path) -> None:
    bad = [s for s in sets if "=" not in s or not s.partition("=")[0].strip()]
    if bad:
        raise GridError(f"--set expects KEY=VALUE (an `mhc fit` key without the leading --), got {bad}")
    for item in sets:
        key = item.partition("=")[0].strip().removeprefix("--")
        if key in spec["axes"]:
            raise GridError(
                f"--set {item}: {key} is an axis of {grid} ({spec['axes'][key]}); the runs would train the --set "
                "value under names and tags that say the axis value: change the axis in the grid file"
            )
        setters = [name for name, overrides in spec["variants"].items() if key in (overrides or {})]
        if setters:
            raise GridError(
                f"--set {item}: variant(s) {setters} of {grid} set {key}; the runs would train the --set value "
                "under a variant that names another: change the variants in the grid file"
            )


def config_value(files: list[str], key: str) -> Optional[object]:
    """`key` as the last of these config files that sets it says (None: none does)."""
    value = None
    for path in files:
        try:
            cfg = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue  # the fit parser's check names it
        for part in key.split("."):
            cfg = cfg.get(part) if isinstance(cfg, dict) else None
        value = cfg if cfg is not None else value
    return value


def argv_value(argv: list[str], key: str) -> Optional[object]:
    """`key` as a run's `mhc fit` arguments set it: its last --key=value flag, else its config files (base.yaml
    first)."""
    from ..fit.configs import default_config_files

    flags = [a.partition("=")[2] for a in argv if a.startswith(f"--{key}=")]
    if flags:
        return flags[-1]
    return config_value(default_config_files() + [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-c"], key)


def sinkhorn_no_ops(runs: list[tuple[str, dict, list[str]]]) -> Optional[str]:
    """A warning when the grid (its variants, axes or --set) sets sinkhorn_* keys for runs of a mode without Sinkhorn
    (mhc_lite, kromhc), which ignores them: those runs differ only in their names."""
    from ..model.modes import warning_modes

    no_sinkhorn = warning_modes(SINKHORN_PREFIX.rpartition(".")[2])
    hit: dict[str, set[str]] = {}
    for _, tags, argv in runs:
        keys = {a[2:].partition("=")[0] for a in argv if a.startswith(f"--{SINKHORN_PREFIX}")}
        if not keys:
            continue
        if argv_value(argv, MODE_KEY) in no_sinkhorn:
            hit.setdefault(tags.get("variant", "?"), set()).update(keys)
    if not hit:
        return None
    keys = sorted(set().union(*hit.values()))
    return (
        f"warning: {', '.join(keys)} is a no-op for {' / '.join(no_sinkhorn)} (no Sinkhorn): the runs of variant(s) "
        f"{sorted(hit)} differ only in their names"
    )


def check_names(grid: Path, runs: list[tuple[str, dict, list[str]]]) -> None:
    """Every run name must fit an MLflow run name and, as <name>.log, a file name (variants and axis values make it)."""
    from ..names import file_name, path_name_problem, run_name_problem

    for name, _, _ in runs:
        problem = run_name_problem(name) or path_name_problem(file_name(name), ".log")
        if problem:
            raise GridError(
                f"{grid}: run name {problem} (the variant's name and the axis values make it); shorten the variant "
                "names or the axis values"
            )


def check_runs(grid: Path, runs: list[tuple[str, dict, list[str]]]) -> None:
    """Raise GridError naming the first rejected run, how many more there are, and the parser's reason."""
    from ..fit.args_check import fit_args_problems

    distinct: dict[tuple[str, ...], list[str]] = {}  # repeats differ by their run name only: parse once
    for name, _, argv in runs:
        distinct.setdefault(tuple(a for a in argv[1:] if not a.startswith(RUN_NAME_FLAG)), []).append(name)
    problems = fit_args_problems(list(distinct), cross_field=True)
    bad = [(names[0], problem, len(names)) for names, problem in zip(distinct.values(), problems) if problem]
    if bad:
        name, problem, _ = bad[0]
        more = sum(n for _, _, n in bad) - 1
        raise GridError(
            f"{grid}: `mhc fit` rejects the arguments of run {name}"
            + (f" and {more} more" if more else "")
            + f" (from the grid's configs, variants, axes or --set): {problem}; nothing was started"
        )
