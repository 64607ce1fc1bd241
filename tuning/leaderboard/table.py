"""``leaderboard.md``: the setting, the threat model (once), the decision rule, and one
table per total ε, the personalised methods' table and the non-private references."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from engine.config import RunConfig
from tuning.budget import k_distribution
from tuning.leaderboard.settings import LeaderboardSettings

THREAT_MODEL = (
    "Threat model: a seeded simulation. Cohorts, noise, initial models and minibatches come "
    "from seeded streams, so every number here can be reproduced; every ε is dp-accounting's "
    "for the σ, sampling and rounds that ran and describes a deployment of the same "
    "mechanism with fresh secret randomness (`privacy.secure_noise`), in which only the "
    "selected trial is published (and, under Papernot-Steinke, the number of trials stays "
    "secret). This folder holds every trial, so it is a research record, not a release."
)
RULE = (
    "Decision rule (fixed in docs/leaderboard.md before any run): d_j = acc(method, seed j) "
    "- acc(baseline, seed j) over the seeds both ran; **better** iff the 95 % t-interval of "
    "the mean of d has lower bound > 0, **worse** iff its upper bound < 0, else "
    "**inconclusive**."
)


def setting_line(config: RunConfig) -> str:
    d = config.dataset
    part = f"Dirichlet({d.alpha:g})" if d.partition == "dirichlet" else d.partition.upper()
    rate = (
        config.sampling.rate if config.sampling.mode == "poisson" else config.sampling.cohort_size
    )
    return f"{d.name}, {d.num_clients} {part} clients, q = {rate:g}, {config.model.name}"


def _cell(x: float, fmt: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _selected(row: pd.Series) -> str:
    parts = []
    for col in sorted(c for c in row.index if c.startswith("hp_")):
        v = row[col]
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        name = col[3:].replace("local_", "").replace("privacy_", "").replace("algo_", "")
        parts.append(f"{name} {v:.3g}" if isinstance(v, float) else f"{name} {v}")
    return ", ".join(parts) or "—"


def _ranked(table: pd.DataFrame, baseline: str) -> list[str]:
    head = (
        "| method | released ε (search incl.) | per-trial ε | σ | selected (trial k: "
        "hyperparameters) | val acc of the selected trial | test acc, mean ± sd (seeds) | "
        f"95 % interval | difference vs {baseline} [95 % interval] | verdict | wall time |"
    )
    lines = [head, "|" + " --- |" * 11]
    order = table.sort_values("mean", ascending=False, na_position="last")
    for _, r in order.iterrows():
        if r["status"] != "done":
            lines.append(f"| {r['method']} | {r['status']} |" + " |" * 9)
            continue
        diff = f"{r['diff_mean']:+.3f} [{r['diff_lo']:+.3f}, {r['diff_hi']:+.3f}]"
        if r["verdict"] == "baseline":
            diff = "(baseline)"
        lines.append(
            f"| {r['method']} | {_cell(r['released_epsilon'], '.4f')} | "
            f"{_cell(r['per_trial_epsilon'], '.4g')} | "
            f"{_cell(r['selected_noise_multiplier'], '.4g')} | "
            f"k={int(r['selected_index'])}: {_selected(r)} | {_cell(r['selected_score'])} | "
            f"{_cell(r['mean'])} ± {_cell(r['sd'])} ({int(r['seeds'])}) | "
            f"[{_cell(r['ci_lo'])}, {_cell(r['ci_hi'])}] | {diff} | **{r['verdict']}** | "
            f"{r['wall_time_s'] / 60:.1f} min |"
        )
    return lines


def _other(table: pd.DataFrame, what: str) -> list[str]:
    lines = [
        f"| method | total ε budget | released ε | selected | {what}, mean ± sd (seeds) | "
        "95 % interval | wall time |",
        "|" + " --- |" * 7,
    ]
    for _, r in table.iterrows():
        total = (
            "not private"
            if math.isinf(r["total_epsilon_budget"])
            else f"{r['total_epsilon_budget']:g}"
        )
        if r["status"] != "done":
            lines.append(f"| {r['method']} | {total} | {r['status']} |" + " |" * 4)
            continue
        lines.append(
            f"| {r['method']} | {total} | {_cell(r['released_epsilon'], '.4f')} | "
            f"k={int(r['selected_index'])}: {_selected(r)} | {_cell(r['mean'])} ± "
            f"{_cell(r['sd'])} ({int(r['seeds'])}) | [{_cell(r['ci_lo'])}, {_cell(r['ci_hi'])}] | "
            f"{r['wall_time_s'] / 60:.1f} min |"
        )
    return lines


def markdown(out: Path, s: LeaderboardSettings, config: RunConfig, table: pd.DataFrame) -> str:
    shared = s.shared()
    ranges = "; ".join(
        f"{k}: "
        + (
            f"{v['type']} [{v['low']:g}, {v['high']:g}]"
            if "low" in v
            else "{" + ", ".join(str(x) for x in v["values"]) + "}"
        )
        for k, v in sorted(shared.items())
    )
    lines = [
        f"# dpfl leaderboard: {out}",
        "",
        f"Setting: {setting_line(config)}; public validation set: "
        f"{config.dataset.validation_size} training examples held out of every client "
        "(selection); public test set: the source's (scores).",
        f"Search per cell: {k_distribution(s.tuning_privacy, s.trials, s.tnb_shape)}; shared "
        f"ranges, drawn identically for trial k of every method: {ranges}; each method's own "
        f"keys from its own stream (`leaderboard.json`). Selection: final `val_accuracy`. "
        f"Seed runs: {s.seeds} fresh seeds (the same for every method) at the selected σ.",
        "",
        THREAT_MODEL,
        "",
        RULE,
        "",
        "The seed runs are a research measurement of the selected configuration's expected "
        "test accuracy, not a release: the released ε column is the ε of publishing the "
        "selected trial, search included (dp-accounting's, for the trials that ran).",
    ]
    ranked = table[table["kind"] == "ranked"]
    for total, g in ranked.groupby("total_epsilon_budget", sort=True):
        lines += ["", f"## Total ε = {total:g}", "", *_ranked(g, s.baseline)]
    personal = table[table["kind"] == "personal"]
    if len(personal):
        lines += [
            "",
            "## Personalised methods (not ranked with the above)",
            "",
            "Selected and scored on `personal_accuracy_nonprivate`: each client's held-out "
            "data, so neither the selection nor the score is covered by ε (the released ε "
            "covers the training runs).",
            "",
            *_other(personal, "personal_accuracy_nonprivate"),
        ]
    refs = table[table["kind"] == "reference"]
    if len(refs):
        lines += ["", "## Non-private references", "", *_other(refs, "test acc")]
    code = ", ".join(dict.fromkeys(c for v in table.get("code", []) for c in v.split(", ") if c))
    lines += [
        "",
        f"Code that ran (commits of the sittings): {code or '—'}.",
        "",
        "Files: `leaderboard.parquet` (every round of every trial and seed run), "
        "`cells.parquet`, `leaderboard.png`, `cells/*.json`, `budgets.json`.",
    ]
    return "\n".join(lines) + "\n"
