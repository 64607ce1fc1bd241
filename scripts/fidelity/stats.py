"""The real scale's statistics: paired per-seed differences, their 95 % Student-t
interval (scipy), and the decision rule written before any real-scale run
(``text/real_rule.md``)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from engine.config.presets import Preset
from scripts.fidelity.verdicts import metric_of


def t_quantile(level: float, df: int) -> float:
    """The two-sided quantile: t with P(|T| <= t) = ``level``."""
    from scipy import stats

    if not 0 < level < 1:
        raise ValueError(f"level={level}: expected in (0, 1)")
    if df < 1:
        raise ValueError(f"df={df}: expected >= 1")
    return float(stats.t.ppf(0.5 + level / 2, df))


def t_interval(values: Any, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t ``level`` interval of the mean of ``values``
    (sample sd, n - 1 degrees of freedom); the interval is (nan, nan) for n < 2."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def decide(lo: float, hi: float) -> str:
    """The real scale's rule at one ε: the interval of the mean paired difference
    (claimed-better minus baseline) above 0, below 0, or neither."""
    if lo > 0:
        return "reproduced"
    if hi < 0:
        return "reversed"
    return "inconclusive"


def combine(verdicts: list[str]) -> str:
    """A claim over several ε: reproduced (reversed) only when every ε is."""
    if verdicts and all(v == "reproduced" for v in verdicts):
        return "reproduced"
    if verdicts and all(v == "reversed" for v in verdicts):
        return "reversed"
    return "inconclusive"


def reverses(cpu: str, real: str) -> bool:
    """Whether the real scale's verdict reverses the CPU scale's: reproduced there and
    reversed here, or not reproduced there and reproduced here."""
    cpu = cpu.strip().lower()
    if cpu.startswith("reproduced"):
        return real == "reversed"
    if cpu.startswith("not reproduced"):
        return real == "reproduced"
    return False


def paired(preset: Preset, rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Per ε column of a better/than claim: the paired per-seed differences (A − B at
    the same seed and ε), their mean, 95 % t interval and verdict."""
    rule = preset.meta.get("verdict") or {}
    a, b = rule["better"], rule["than"]
    rows = rows.assign(epsilon_target=rows["epsilon_target"].fillna(-1.0))
    out = []
    for e, g in rows.groupby("epsilon_target", sort=True):
        ga = g[g.algorithm == a].set_index("seed")[metric_of(preset, a)]
        gb = g[g.algorithm == b].set_index("seed")[metric_of(preset, b)]
        seeds = sorted(set(ga.index) & set(gb.index))
        diffs = [float(ga[s] - gb[s]) for s in seeds]
        mean, lo, hi = t_interval(diffs)
        verdict_e = decide(lo, hi) if len(diffs) >= 2 else "inconclusive"
        out.append(
            {
                "epsilon_target": e,
                "seeds": seeds,
                "diffs": diffs,
                "mean": mean,
                "lo": lo,
                "hi": hi,
                "verdict": verdict_e,
            }
        )
    return out
