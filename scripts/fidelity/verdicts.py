"""The CPU scale's verdicts: each preset's ``verdict:`` rule applied to the means over
seeds, and the numbers a row shows.

* ``{better: A, than: B}``: *reproduced* when A's mean final accuracy exceeds B's at
  every ε column, *not reproduced* otherwise; the row says when the difference is
  within one (pooled) sample standard deviation.
* ``{reference: acc, tolerance: t}``: *reproduced* when the mean is within t of the
  reference accuracy (an independent loop's number measured at the paper scale).
"""

from __future__ import annotations

import math

import pandas as pd

from engine.config.presets import Preset


def mean_std(values: pd.Series) -> str:
    sd = values.std(ddof=1) if len(values) > 1 else math.nan
    return f"{values.mean():.3f} ± {sd:.3f}" if not math.isnan(sd) else f"{values.mean():.3f}"


def metric_of(preset: Preset, algorithm: str) -> str:
    """The column a preset's verdict reads for ``algorithm``: ``final_accuracy`` unless
    the rule's ``metric:`` mapping names another (DP²-FedSAM's personal accuracy)."""
    rule = preset.meta.get("verdict") or {}
    return str((rule.get("metric") or {}).get(algorithm, "final_accuracy"))


def verdict(preset: Preset, rows: pd.DataFrame, scale: str = "cpu") -> str:
    rule = preset.meta.get("verdict") or {}
    if rule.get("scale", scale) != scale:
        return f"no reference at {scale} scale (the claim's number is for {rule['scale']} scale)"
    rows = rows.assign(epsilon_target=rows["epsilon_target"].fillna(-1.0))
    if "better" in rule:
        a, b = rule["better"], rule["than"]
        wins, close = [], []
        for _, g in rows.groupby("epsilon_target"):
            ga = g[g.algorithm == a][metric_of(preset, a)]
            gb = g[g.algorithm == b][metric_of(preset, b)]
            diff = ga.mean() - gb.mean()
            wins.append(diff > 0)
            pooled = math.sqrt((ga.var(ddof=1) + gb.var(ddof=1)) / 2) if len(ga) > 1 else 0.0
            close.append(abs(diff) <= pooled)
        text = "reproduced" if all(wins) else "not reproduced"
        if any(close):
            some = " at some ε" if len(close) > 1 else ""
            text += f" (difference within one std{some})"
        return text
    if "reference" in rule:
        mean = rows["final_accuracy"].mean()
        ok = abs(mean - float(rule["reference"])) <= float(rule.get("tolerance", 0.02))
        return "reproduced" if ok else "not reproduced"
    return "no verdict rule"


def numbers(rows: pd.DataFrame, preset: Preset | None = None) -> str:
    parts = []
    rows = rows.assign(epsilon_target=rows["epsilon_target"].fillna(-1.0))
    for (e, alg), g in rows.groupby(["epsilon_target", "algorithm"], sort=True):
        if not bool(g["private"].iloc[0]):
            eps = "not private"
        else:
            eps = f"ε={e:g}" if e > 0 else f"ε={g['epsilon'].max():.3g}"
        metric = metric_of(preset, alg) if preset is not None else "final_accuracy"
        what = "" if metric == "final_accuracy" else f" ({metric})"
        parts.append(f"{alg} {eps}{what}: {mean_std(g[metric])}")
    private = rows[rows["private"].astype(bool)]
    if private.empty:
        return "; ".join(parts)
    achieved = private.groupby("epsilon_target")["epsilon"].max()
    spent = ", ".join(f"{v:.4g}" for v in achieved)
    return "; ".join(parts) + f" (accountant ε: {spent})"


def cpu_verdicts(page: str) -> dict[str, str]:
    """Each preset's CPU-scale verdict as the page states it now."""
    found: dict[str, str] = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) >= 5 and cells[2] == "cpu" and cells[1].startswith("`"):
            found.setdefault(cells[1].strip("`").removesuffix(".yaml"), cells[-1])
    return found
