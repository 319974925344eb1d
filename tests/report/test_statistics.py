"""Error bars over evaluation episodes: cluster-robust standard errors and t intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.report.statistics import clustered_mean, paired_difference, t_critical


def test_one_value_per_cluster_is_the_textbook_standard_error_and_t_interval() -> None:
    x = np.array([0.1, 0.4, 0.2, 0.7, 0.5])
    est = clustered_mean(x, range(5))
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert est.mean == pytest.approx(x.mean())
    assert est.se == pytest.approx(se)
    # t(0.975, 4) = 2.776445 (any table of Student's t).
    assert est.high - est.mean == pytest.approx(2.776445 * se, rel=1e-6)
    assert est.units == 5


def test_t_critical_values_match_the_tables() -> None:
    assert t_critical(2) == pytest.approx(12.7062, abs=1e-4)
    assert t_critical(8) == pytest.approx(2.3646, abs=1e-4)
    assert t_critical(10_000) == pytest.approx(1.9602, abs=1e-4)
    assert math.isnan(t_critical(1))


def test_a_cluster_counts_once_however_many_episodes_it_holds() -> None:
    # Two clusters whose members agree: the spread is that of two units, not four.
    est = clustered_mean([1.0, 1.0, 3.0, 3.0], [0, 0, 1, 1])
    assert est.mean == 2.0
    assert est.se == pytest.approx(1.0)  # cluster means 1 and 3: std 1.414 / sqrt(2)
    assert est.units == 2
    naive = clustered_mean([1.0, 1.0, 3.0, 3.0], [0, 1, 2, 3])
    assert naive.se < est.se


def test_one_cluster_gives_a_mean_without_an_error_bar() -> None:
    est = clustered_mean([0.5, 0.7], [3, 3])
    assert est.mean == pytest.approx(0.6)
    assert math.isnan(est.se) and math.isnan(est.low) and math.isnan(est.high)


def test_paired_difference_is_the_clustered_mean_of_the_differences() -> None:
    a, b, g = [0.9, 0.8, 0.95, 0.7], [0.85, 0.8, 0.9, 0.72], [0, 0, 1, 1]
    assert paired_difference(a, b, g) == clustered_mean(np.subtract(a, b), g)
    with pytest.raises(ValueError, match="one shape"):
        paired_difference([1.0], [1.0, 2.0], [0])


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=6),
    shift=st.floats(-5, 5),
    seed=st.integers(0, 2**16),
)
def test_equal_clusters_reduce_to_the_spread_of_cluster_means_and_shifts_move_only_the_mean(
    sizes: list[int], shift: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    m = sizes[0]
    x = rng.normal(size=m * len(sizes))
    labels = np.repeat(np.arange(len(sizes)), m)
    est = clustered_mean(x, labels)
    means = x.reshape(len(sizes), m).mean(axis=1)
    assert est.se == pytest.approx(means.std(ddof=1) / math.sqrt(len(sizes)), rel=1e-9)
    moved = clustered_mean(x + shift, labels)
    assert moved.mean == pytest.approx(est.mean + shift)
    assert moved.se == pytest.approx(est.se, rel=1e-9, abs=1e-12)


def test_the_interval_covers_a_known_mean_95_percent_of_the_time_on_clustered_data() -> None:
    """Simulated evaluations with a known answer: 8 groups of 4 episodes whose members
    share a group effect as large as their own noise. The clustered 95% interval covers
    the true mean about 95% of the time; treating episodes as independent would not."""
    rng = np.random.default_rng(0)
    true_mean, groups, per_group, trials = 0.3, 8, 4, 4000
    labels = np.repeat(np.arange(groups), per_group)
    covered = naive_covered = 0
    for _ in range(trials):
        effect = np.repeat(rng.normal(size=groups), per_group)
        x = true_mean + effect + rng.normal(size=groups * per_group)
        est = clustered_mean(x, labels)
        covered += est.low <= true_mean <= est.high
        naive = clustered_mean(x, np.arange(x.size))
        naive_covered += naive.low <= true_mean <= naive.high
    # Binomial sd of a 95% rate over 4000 trials is 0.0034: 0.94-0.96 is 3 sd.
    assert 0.94 <= covered / trials <= 0.96
    assert naive_covered / trials < 0.85
