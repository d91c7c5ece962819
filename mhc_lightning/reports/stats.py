"""Differences between groups of runs with their uncertainty: a 95 % confidence interval, n and p.

A difference is paired by seed when both groups ran the same seeds (one run per seed each): a seed then fixes the
initialisation and, unless data.seed is pinned, the data order of both runs, and pairing removes that shared part of
the spread. Otherwise the groups are compared unpaired with Welch's t (unequal variances). Both are t intervals on
the mean difference; with n < 2 (pairs, or runs in a group) no interval exists and none is printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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

    @property
    def distinguishable(self) -> bool:
        """The interval excludes zero: at this level and n the two groups can be told apart."""
        return not (self.low <= 0.0 <= self.high) and not math.isnan(self.low)

    @property
    def test(self) -> str:
        return f"paired by seed, n={self.n[0]}" if self.paired else f"Welch, n={self.n[0]} vs {self.n[1]}"


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


def difference(
    group: list[tuple[Optional[str], float]], baseline: list[tuple[Optional[str], float]]
) -> Optional[Difference]:
    """(seed, value) pairs of two groups: paired by seed where every run has a seed, seeds are unique within each
    group and at least two are shared; Welch otherwise."""

    def by_seed(runs):
        seeds = [s for s, _ in runs]
        if any(s is None for s in seeds) or len(set(seeds)) != len(seeds):
            return None
        return dict(runs)

    a, b = by_seed(group), by_seed(baseline)
    if a is not None and b is not None:
        d = paired(a, b)
        if d is not None:
            return d
    return welch([v for _, v in group], [v for _, v in baseline])


def format_difference(d: Optional[Difference], digits: int = 4) -> dict[str, str]:
    """Table cells for one difference."""
    if d is None:
        return {"difference": "–", f"{LEVEL:.0%} CI": "–", "p": "–", "test": "too few runs", "verdict": "–"}
    f = f"{{:+.{digits}f}}"
    verdict = ("lower" if d.mean < 0 else "higher") if d.distinguishable else "cannot tell apart"
    return {
        "difference": f.format(d.mean),
        f"{LEVEL:.0%} CI": f"[{f.format(d.low)}, {f.format(d.high)}]",
        "p": f"{d.p:.3g}",
        "test": d.test,
        "verdict": verdict,
    }
