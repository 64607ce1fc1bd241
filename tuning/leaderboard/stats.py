"""The leaderboard's statistics: intervals over seeds and the decision rule.

Each selected configuration is re-run on n fresh seeds (the same seeds for every
method, :mod:`tuning.leaderboard.draws`). A method's row shows the mean and sample
standard deviation of its final test accuracy over the seeds and the 95 % Student-t
interval of the mean, mean ± t(0.975, n − 1)·sd/√n. Against the baseline method, the
paired differences d_j = acc(method, seed j) − acc(baseline, seed j) over the seeds
both ran give the mean difference and its 95 % t-interval, and the verdict, by the rule
written in ``docs/leaderboard.md`` before any run:

* **better** iff the interval's lower bound is > 0;
* **worse** iff its upper bound is < 0;
* **inconclusive** otherwise (also with fewer than two paired seeds).

Quantiles come from scipy (``scipy.stats.t``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LEVEL = 0.95
BETTER, WORSE, INCONCLUSIVE = "better", "worse", "inconclusive"


@dataclass(frozen=True)
class Interval:
    """Mean, sample sd, the two-sided ``LEVEL`` t-interval of the mean, and n."""

    mean: float
    sd: float
    lo: float
    hi: float
    n: int


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The mean of ``values`` with its Student-t interval (NaN bounds for n < 2)."""
    from scipy import stats

    xs = [float(v) for v in values if not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, math.nan, 0)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, math.nan, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, sd, mean - half, mean + half, n)


def paired_difference(
    method: Mapping[int, float], baseline: Mapping[int, float], level: float = LEVEL
) -> Interval:
    """The t-interval of the mean of ``method[j] - baseline[j]`` over the seeds j both
    have (each mapping: seed index → final accuracy)."""
    common = sorted(set(method) & set(baseline))
    return t_interval([method[j] - baseline[j] for j in common], level)


def verdict(difference: Interval) -> str:
    """The decision rule (module docstring)."""
    if difference.n < 2 or math.isnan(difference.lo):
        return INCONCLUSIVE
    if difference.lo > 0:
        return BETTER
    if difference.hi < 0:
        return WORSE
    return INCONCLUSIVE
