"""Differences between groups of runs with their uncertainty: a 95 % confidence interval, n and p.

The unit is the seed: runs that repeat a seed (replicates: same code, config and seed) are not independent samples, so
they are averaged within their seed first, and a group of one seed gives no verdict, whatever its number of runs
(its replicate spread is shown instead). A difference is paired by seed when both groups ran the same seeds: a seed
then fixes the initialisation and, unless data.seed is pinned, the data order of both runs, and pairing removes that
shared part of the spread. Otherwise the groups are compared unpaired with Welch's t (unequal variances) over their
seeds. Both are t intervals on the mean difference; with n < 2 (pairs, or seeds in a group) no interval exists and
none is printed. Runs that record no seed count as one sample each.

Divergence rates (runs diverged of runs that finished or diverged) are compared with Fisher's exact test, two-sided:
exact at the few runs per group a grid has, where a chi-squared approximation is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from scipy import stats

LEVEL = 0.95


@dataclass(frozen=True)
class Difference:
    """mean = group − baseline; (low, high) its LEVEL confidence interval; n: pairs (paired) or (group, baseline)
    runs (Welch)."""

    mean: float
    low: float
    high: float
    p: float
    paired: bool
    n: tuple[int, ...]
    averaged: bool = False  # replicates of a seed were averaged first

    @property
    def distinguishable(self) -> bool:
        """The interval excludes zero: at this level and n the two groups can be told apart."""
        return not (self.low <= 0.0 <= self.high) and not math.isnan(self.low)

    @property
    def test(self) -> str:
        text = f"paired by seed, n={self.n[0]}" if self.paired else f"Welch, n={self.n[0]} vs {self.n[1]}"
        return text + (" seeds, replicates averaged" if self.averaged else "")


def _clean(values) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def paired(group: dict[str, float], baseline: dict[str, float]) -> Optional[Difference]:
    """The difference over the seeds both dicts (seed -> value) hold; None with fewer than two common seeds."""
    seeds = sorted(s for s in set(group) & set(baseline) if not math.isnan(group[s]) and not math.isnan(baseline[s]))
    if len(seeds) < 2:
        return None
    a, b = [group[s] for s in seeds], [baseline[s] for s in seeds]
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    if all(v == d[0] for v in d):  # no spread: the interval is the point (t is undefined)
        return Difference(mean, mean, mean, 0.0 if mean else 1.0, True, (len(d),))
    res = stats.ttest_rel(a, b)
    ci = res.confidence_interval(LEVEL)
    return Difference(mean, float(ci.low), float(ci.high), float(res.pvalue), True, (len(d),))


def welch(group: list[float], baseline: list[float]) -> Optional[Difference]:
    """Unpaired difference of means (Welch); None unless each side has two or more values."""
    a, b = _clean(group), _clean(baseline)
    if len(a) < 2 or len(b) < 2:
        return None
    mean = sum(a) / len(a) - sum(b) / len(b)
    if len(set(a)) == 1 and len(set(b)) == 1:
        return Difference(mean, mean, mean, 0.0 if mean else 1.0, False, (len(a), len(b)))
    res = stats.ttest_ind(a, b, equal_var=False)
    ci = res.confidence_interval(LEVEL)
    return Difference(mean, float(ci.low), float(ci.high), float(res.pvalue), False, (len(a), len(b)))


def seed_means(runs: list[tuple[Optional[str], float]]) -> Optional[dict[str, float]]:
    """seed -> the mean of its runs' values (NaN values left out); None when some run has no seed."""
    if any(s is None for s, _ in runs):
        return None
    by_seed: dict[str, list[float]] = {}
    for s, v in runs:
        if not math.isnan(v):
            by_seed.setdefault(s, []).append(v)
    return {s: sum(vs) / len(vs) for s, vs in by_seed.items()}


def one_seed(runs: list[tuple[Optional[str], float]]) -> bool:
    """Every run (with a value) repeats one seed: replicates only, no sample of seeds to judge a difference on."""
    means = seed_means(runs)
    return means is not None and len(means) == 1


def difference(
    group: list[tuple[Optional[str], float]], baseline: list[tuple[Optional[str], float]]
) -> Optional[Difference]:
    """(seed, value) pairs of two groups, replicates averaged within their seed: paired by seed where at least two
    seeds are shared, Welch over seeds otherwise; None when a group has a single seed or too few values."""
    a, b = seed_means(group), seed_means(baseline)
    if a is None or b is None:  # no seeds to go by: each run one sample
        return welch([v for _, v in group], [v for _, v in baseline])
    if len(a) < 2 or len(b) < 2:
        return None
    d = paired(a, b) or welch(list(a.values()), list(b.values()))
    averaged = len(a) < sum(not math.isnan(v) for _, v in group) or len(b) < sum(not math.isnan(v) for _, v in baseline)
    return replace(d, averaged=True) if d is not None and averaged else d


def divergence_p(diverged: int, trained: int, base_diverged: int, base_trained: int) -> float:
    """Two-sided Fisher exact p for diverged / (diverged + trained) in a group against its baseline."""
    table = [[diverged, trained], [base_diverged, base_trained]]
    return float(stats.fisher_exact(table).pvalue)


def format_difference(d: Optional[Difference], digits: int = 4, why_none: str = "too few runs") -> dict[str, str]:
    """Table cells for one difference; `why_none`: what the test cell says when there is none."""
    if d is None:
        return {"difference": "–", f"{LEVEL:.0%} CI": "–", "p": "–", "test": why_none, "verdict": "no verdict"}
    f = f"{{:+.{digits}f}}"
    verdict = ("lower" if d.mean < 0 else "higher") if d.distinguishable else "cannot tell apart"
    return {
        "difference": f.format(d.mean),
        f"{LEVEL:.0%} CI": f"[{f.format(d.low)}, {f.format(d.high)}]",
        "p": f"{d.p:.3g}",
        "test": d.test,
        "verdict": verdict,
    }
