"""The leaderboard's outputs, rewritten from the runs' files after every cell.

* ``leaderboard.parquet``: one Parquet dataset of every round of every trial and seed
  run (``phase`` trial/seed, ``index``, ``method``, ``total_epsilon_budget``, the
  searched values as ``hp_*``); ``val_accuracy`` is measured on the public validation
  set, ``test_accuracy`` on the public test set (``validation_source``/``eval_source``
  name them), ``*_nonprivate`` columns on clients' data;
* ``cells.parquet``: one row per cell (:func:`cell_table`);
* ``leaderboard.md``: the tables (:mod:`tuning.leaderboard.table`);
* ``leaderboard.png``: accuracy against total ε, one line per method, 95 % interval
  bars, the non-private references as horizontal lines.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from engine.base.atomic import atomic_write
from engine.config import RunConfig
from tuning.leaderboard import stats
from tuning.leaderboard.cells import PERSONAL, REFERENCE, Cell, read_record
from tuning.leaderboard.runs import hp_column
from tuning.leaderboard.settings import PERSONAL_METRIC, LeaderboardSettings


def load_leaderboard(out: str | Path) -> pd.DataFrame:
    """Every row of every run written so far (finished or not), one frame."""
    frames = [pd.read_parquet(p) for p in sorted((Path(out) / "runs").glob("*/rows.parquet"))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def cell_table(out: Path, settings: LeaderboardSettings, cells: list[Cell]) -> pd.DataFrame:
    """One row per cell: budget, selection, seed-run statistics, paired difference
    against the baseline at the same total ε (ranked cells), verdict, wall time."""
    records = {c.name: read_record(out, c) for c in cells}
    rows = []
    for cell in cells:
        r = records[cell.name]
        metric = PERSONAL_METRIC if cell.kind == PERSONAL else "test_accuracy"
        seeds = {s["seed_index"]: s[metric] for s in r.get("seed_runs", [])}
        ci = stats.t_interval(list(seeds.values()))
        budget = r.get("budget") or {}
        sel = r.get("selected") or {}
        row: dict[str, Any] = {
            "method": cell.method,
            "kind": cell.kind,
            "total_epsilon_budget": cell.total,
            "status": r.get("status", "not run"),
            "trials": r.get("trials", math.nan),
            "per_trial_epsilon": budget.get("per_trial_epsilon", math.nan),
            "released_epsilon": r.get("released_epsilon", math.nan),
            "released_rule": r.get("released_rule", ""),
            "selected_index": sel.get("index", math.nan),
            "selected_rounds": sel.get("rounds", math.nan),
            "selected_noise_multiplier": sel.get("noise_multiplier", math.nan),
            "selected_score": sel.get(cell.metric, math.nan),
            "selection_metric": cell.metric,
            "score_metric": metric,
            "seeds": ci.n,
            "mean": ci.mean,
            "sd": ci.sd,
            "ci_lo": ci.lo,
            "ci_hi": ci.hi,
            "wall_time_s": r.get("wall_time_s", math.nan),
            # the code of each sitting, in order, repeats dropped (cells.code_version)
            "code": ", ".join(dict.fromkeys(x.get("code", "?") for x in r.get("sittings", []))),
        }
        for key, value in (sel.get("params") or {}).items():
            row[hp_column(key)] = value
        if cell.kind not in (PERSONAL, REFERENCE):
            base = records[Cell(settings.baseline, cell.total, cell.kind).name]
            base_seeds = {s["seed_index"]: s["test_accuracy"] for s in base.get("seed_runs", [])}
            diff = stats.paired_difference(seeds, base_seeds)
            row.update(
                {
                    "diff_mean": diff.mean,
                    "diff_lo": diff.lo,
                    "diff_hi": diff.hi,
                    "verdict": "baseline"
                    if cell.method == settings.baseline
                    else stats.verdict(diff),
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, title: str):
    """Accuracy against total ε (matplotlib Figure)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ranked = table[(table["kind"] == "ranked") & (table["status"] == "done")]
    for method, g in ranked.groupby("method", sort=False):
        g = g.sort_values("total_epsilon_budget")
        x = g["total_epsilon_budget"].to_numpy()
        y = g["mean"].to_numpy()
        err = [y - g["ci_lo"].to_numpy(), g["ci_hi"].to_numpy() - y]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=str(method))
    refs = table[(table["kind"] == "reference") & (table["status"] == "done")]
    for _, r in refs.iterrows():
        line = ax.axhline(r["mean"], linestyle="--", linewidth=1, color="grey")
        if not math.isnan(r["ci_lo"]):
            ax.axhspan(r["ci_lo"], r["ci_hi"], alpha=0.1, color=line.get_color())
        ax.annotate(
            f"{r['method']} (not private)",
            (0.01, r["mean"]),
            xycoords=("axes fraction", "data"),
            fontsize=7,
        )
    ax.set_xlabel("total ε of the released trial (search included)")
    ax.set_ylabel("final test accuracy (mean over seeds, 95 % interval)")
    ax.set_title(title, fontsize=9)
    if len(ranked):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_outputs(
    out: Path, settings: LeaderboardSettings, config: RunConfig, cells: list[Cell]
) -> None:
    """Rewrite every output from the runs' files and the cells' records."""
    from tuning.leaderboard.table import markdown, setting_line

    rows = load_leaderboard(out)
    if not rows.empty:
        with atomic_write(out / "leaderboard.parquet") as tmp:
            rows.to_parquet(tmp, index=False)
    table = cell_table(out, settings, cells)
    with atomic_write(out / "cells.parquet") as tmp:
        table.to_parquet(tmp, index=False)
    fig = plot(table, setting_line(config))
    with atomic_write(out / "leaderboard.png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    with atomic_write(out / "leaderboard.md") as tmp:
        tmp.write_text(markdown(out, settings, config, table))
