"""Means and paired differences over evaluation episodes, with honest error bars.

Episodes that run side by side in one evaluation group share things (the data order of
their group's loader, its batches split between them), so they are not independent
draws. Every estimate here therefore takes a ``clusters`` label per episode and treats
each cluster as one unit: the standard error is the cluster-robust one (CR1: the spread
of cluster totals, scaled by ``G / (G - 1)``), and the 95% interval uses Student's t
with ``G - 1`` degrees of freedom, ``G`` being the number of clusters. With one episode
per cluster both reduce to the textbook standard error and t interval.

Pure functions over numpy arrays; ``tests/report/test_statistics.py`` checks them against
hand computations and checks the interval's coverage on simulated clustered data whose
mean is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t

#: Two-sided confidence of every interval this module gives.
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A mean over episodes with its cluster-robust standard error and 95% interval.

    ``se``, ``low`` and ``high`` are NaN with fewer than two clusters: one unit says
    nothing about spread. ``units`` is the number of clusters the error bar rests on.
    """

    mean: float
    se: float
    low: float
    high: float
    units: int

    @property
    def standard_errors_from_zero(self) -> float:
        """``mean / se``: how many standard errors the estimate lies from zero."""
        return self.mean / self.se if self.se > 0 else math.nan


def t_critical(units: int, confidence: float = CONFIDENCE) -> float:
    """Two-sided Student-t critical value for ``units`` clusters (``units - 1`` dof)."""
    if units < 2:
        return math.nan
    return float(student_t.ppf(0.5 + confidence / 2, units - 1))


def clustered_mean(values: Sequence[float] | np.ndarray, clusters: Sequence[int]) -> Estimate:
    """Mean of ``values [N]`` and its standard error with each cluster as one unit.

    ``clusters [N]`` labels the unit each value belongs to (an evaluation group). The
    variance is ``G / (G - 1) * sum_g (sum_{i in g} (x_i - mean))^2 / N^2``; for equal
    cluster sizes it equals the variance of the cluster means divided by ``G``.
    """
    x = np.asarray(values, dtype=np.float64)
    labels = np.asarray(clusters)
    if x.ndim != 1 or labels.shape != x.shape:
        raise ValueError(
            f"values and clusters must be 1-D and of one length, got shapes {x.shape} and "
            f"{labels.shape}"
        )
    if x.size == 0:
        raise ValueError("an estimate needs at least one value")
    mean = float(x.mean())
    groups = np.unique(labels)
    units = len(groups)
    if units < 2:
        return Estimate(mean, math.nan, math.nan, math.nan, units)
    totals = np.array([(x[labels == g] - mean).sum() for g in groups])
    se = math.sqrt(units / (units - 1) * float((totals**2).sum())) / x.size
    half = t_critical(units) * se
    return Estimate(mean, se, mean - half, mean + half, units)


def paired_difference(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, clusters: Sequence[int]
) -> Estimate:
    """Mean of ``a - b`` over paired episodes (same hosts, data and seeds), clustered."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"paired values must have one shape, got {x.shape} and {y.shape}")
    return clustered_mean(x - y, clusters)
