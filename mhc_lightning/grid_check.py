"""`mhc grid`'s checks before it starts anything, `--dry-run` included: every `--set` is KEY=VALUE, and every run's `mhc
fit` arguments pass `mhc fit`'s parser and the model's cross-field rules (fit_args_check.py, the mechanism `mhc sweep`
checks its trials with). Without them a misspelt `--set` started every process, each one exiting 2 with the reason
only in grid_logs/.
"""

from __future__ import annotations

from pathlib import Path

from .errors import UserError

RUN_NAME_FLAG = "--trainer.logger.init_args.run_name="


class GridError(UserError):
    """A grid file or command line that cannot run; the message names the file and the key."""


def check_sets(sets: list[str]) -> None:
    bad = [s for s in sets if "=" not in s or not s.partition("=")[0].strip()]
    if bad:
        raise GridError(f"--set expects KEY=VALUE (an `mhc fit` key without the leading --), got {bad}")


def check_runs(grid: Path, runs: list[tuple[str, dict, list[str]]]) -> None:
    """Raise GridError naming the first rejected run, how many more there are, and the parser's reason."""
    from .fit_args_check import fit_args_problems

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
