"""Confidence intervals of group differences (reports/stats.py) on synthetic runs with known effects."""

import math
import random

import pytest

from mhc_lightning.reports.stats import difference, divergence_p, format_difference, one_seed, paired, welch


def _runs(effect: float, seed_sd: float, noise_sd: float, seeds: int, rng: random.Random):
    """(group, baseline) as (seed, value) lists: a seed effect shared by both arms (initialisation and data order),
    independent noise per run, and a true difference `effect`."""
    shared = {str(s): rng.gauss(0.0, seed_sd) for s in range(seeds)}
    base = [(s, 2.0 + u + rng.gauss(0.0, noise_sd)) for s, u in shared.items()]
    group = [(s, 2.0 + effect + u + rng.gauss(0.0, noise_sd)) for s, u in shared.items()]
    return group, base


def test_paired_interval_covers_the_true_effect_at_its_level():
    rng = random.Random(0)
    trials, covered = 400, 0
    for _ in range(trials):
        d = difference(*_runs(-0.03, 0.05, 0.01, 8, rng))
        assert d.paired and d.n == (8,)
        covered += d.low <= -0.03 <= d.high
    # 95 % nominal: the binomial sd over 400 trials is about 1.1 %
    assert 0.91 <= covered / trials <= 0.99


def test_pairing_separates_what_a_shared_seed_spread_hides():
    """A small effect under a large seed-to-seed spread: the paired interval excludes 0, Welch's does not."""
    group, base = _runs(-0.02, 0.05, 0.002, 8, random.Random(3))
    d = difference(group, base)
    assert d.paired and d.distinguishable and d.high < 0 and d.p < 0.01
    w = welch([v for _, v in group], [v for _, v in base])
    assert not w.paired and not w.distinguishable
    assert format_difference(d)["verdict"] == "lower"
    assert format_difference(w)["verdict"] == "cannot tell apart"


def test_no_effect_is_reported_as_indistinguishable_most_of_the_time():
    rng = random.Random(1)
    told_apart = sum(difference(*_runs(0.0, 0.05, 0.01, 5, rng)).distinguishable for _ in range(300))
    assert told_apart / 300 < 0.10  # 5 % expected


def test_unpaired_when_seeds_do_not_pair():
    group = [("1", 2.0), ("2", 2.1), ("3", 2.2)]
    # baseline ran other seeds: nothing pairs, Welch on all six runs
    d = difference(group, [("7", 2.3), ("8", 2.4), ("9", 2.5)])
    assert not d.paired and d.n == (3, 3) and d.mean == pytest.approx(-0.3)
    # runs without a seed: Welch
    assert not difference([(None, 1.0), (None, 1.2)], [(None, 2.0), (None, 2.1)]).paired


def test_paired_uses_the_common_seeds_only_and_matches_a_hand_computed_t_interval():
    a = {"1": 2.00, "2": 2.10, "3": 2.05, "4": 9.99}
    b = {"1": 2.03, "2": 2.12, "3": 2.09, "5": 0.00}
    d = paired(a, b)
    diffs = [-0.03, -0.02, -0.04]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    assert d.n == (3,) and d.mean == pytest.approx(mean)
    assert (d.low, d.high) == (pytest.approx(mean - half), pytest.approx(mean + half))


def test_too_few_runs_give_no_interval():
    assert difference([("1", 2.0)], [("1", 2.1)]) is None
    assert welch([2.0], [2.1, 2.2]) is None
    assert format_difference(None)["test"] == "too few runs"


def test_identical_differences_give_a_point_interval():
    d = paired({"1": 1.5, "2": 2.5}, {"1": 1.0, "2": 2.0})
    assert (d.mean, d.low, d.high) == (0.5, 0.5, 0.5) and d.distinguishable


def test_replicates_are_averaged_within_their_seed_and_one_seed_gives_no_verdict():
    """Four replicates of one seed against four of another are two samples, not eight: no verdict (Welch on the runs
    would call the 0.1 gap 'lower' at p < 0.001)."""
    group = [("1", 2.0 + e) for e in (0.0, 0.001, -0.001, 0.0005)]
    base = [("1", 2.1 + e) for e in (0.0, 0.001, -0.001, 0.0005)]
    assert welch([v for _, v in group], [v for _, v in base]).distinguishable  # what pooling runs would claim
    assert one_seed(group) and difference(group, base) is None
    cells = format_difference(None, why_none="one seed (4 replicates): replicate SD 0.0009")
    assert cells["verdict"] == "no verdict" and cells["test"].startswith("one seed")
    # a repeated seed is averaged first, then paired over the three seeds
    d = difference([("1", 2.0), ("1", 2.2), ("2", 2.1), ("3", 2.2)], [("1", 2.3), ("2", 2.4), ("3", 2.5)])
    assert d.paired and d.n == (3,) and d.averaged and "replicates averaged" in d.test
    assert d.mean == pytest.approx(((2.1 - 2.3) + (2.1 - 2.4) + (2.2 - 2.5)) / 3)


def test_divergence_rates_are_compared_exactly():
    from scipy.stats import fisher_exact

    assert (
        divergence_p(4, 1, 0, 5)
        == pytest.approx(fisher_exact([[4, 1], [0, 5]]).pvalue)
        == pytest.approx(0.047619, abs=1e-6)
    )
    assert divergence_p(0, 5, 0, 5) == 1.0
