"""What became of each run, for the grouped report: in a stability study a run that diverges is a result, not missing
data, so it is counted beside the runs that finished, and a run that failed for another reason is counted apart.

- finished: FINISHED with a finite final val/loss and val/bpb;
- diverged: tagged `mhc.diverged=true` (a fit that met a non-finite loss ends FAILED with it, the step in
  `mhc.diverged_step`), or FINISHED with a non-finite final val/loss or val/bpb;
- failed: FAILED otherwise (a crash, a lost node: says nothing about the model);
- unfinished: RUNNING, SCHEDULED or KILLED (interrupted; `--ckpt_path last` continues it).

Means and intervals are over finished runs; divergence rates are compared with Fisher's exact test (stats.py).
"""

from __future__ import annotations

import math
from collections import Counter

from .runs import FINAL_LOSSES, RunData

DIVERGED_TAG = "mhc.diverged"
DIVERGED_STEP_TAG = "mhc.diverged_step"
OUTCOMES = ("finished", "diverged", "failed", "unfinished")
COUNTED = ("finished", "diverged")  # runs that say something about the model


def outcome(d: RunData) -> str:
    if d.tags.get(DIVERGED_TAG, "").lower() == "true":
        return "diverged"
    if d.status == "FINISHED":
        finals = [d.metrics[k] for k in FINAL_LOSSES if k in d.metrics]
        return "diverged" if any(not math.isfinite(v) for v in finals) else "finished"
    return "failed" if d.status == "FAILED" else "unfinished"


def counts(runs: list[RunData]) -> dict[str, int]:
    c = Counter(outcome(d) for d in runs)
    return {k: c.get(k, 0) for k in OUTCOMES}


def only(groups: dict[tuple, list[RunData]], kinds: tuple[str, ...]) -> dict[tuple, list[RunData]]:
    """The groups with only the runs of these outcomes; groups left empty are dropped."""
    kept = {gk: [d for d in runs if outcome(d) in kinds] for gk, runs in groups.items()}
    return {gk: runs for gk, runs in kept.items() if runs}


def dropped(runs: list[RunData], metric_of) -> str:
    """Why runs of a group are not in a comparison of `metric_of(run)` values: e.g. '1 diverged, 2 failed'."""
    c = counts(runs)
    missing = sum(1 for d in runs if outcome(d) == "finished" and math.isnan(metric_of(d)))
    parts = [f"{c[k]} {k}" for k in ("diverged", "failed", "unfinished") if c[k]]
    parts += [f"{missing} without the metric"] if missing else []
    return ", ".join(parts)


def lines(data: list[RunData], groups: dict[tuple, list[RunData]]) -> list[str]:
    """What became of the runs, in one line, then one line per group with diverged runs (their names, and the step
    where a run recorded it), then how many runs no group holds."""
    c = counts(data)
    head = f"{len(data)} runs: " + ", ".join(f"{c[k]} {k}" for k in OUTCOMES if c[k] or k != "unfinished") + "."
    out = [head]
    for gk, runs in groups.items():
        runs = sorted(runs, key=lambda d: d.name)
        named = [d.name + (f" (step {d.tags[DIVERGED_STEP_TAG]})" if DIVERGED_STEP_TAG in d.tags else "") for d in runs]
        named = [n for n, d in zip(named, runs) if outcome(d) == "diverged"]
        if named:
            out.append(f"diverged in {' '.join(map(str, gk))}: {', '.join(named)}")
    left = len(data) - sum(len(runs) for runs in groups.values())
    if left:
        out.append(f"{left} failed or unfinished runs record none of the grouping keys: left out")
    return out
