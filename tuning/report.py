"""``dpfl report DIR``: which method wins at each ε, with which hyperparameters.

Pandas helpers (:func:`load_rounds`, :func:`load_trials`, :func:`best_trials`) plus
a Markdown summary and two PNG figures (accuracy vs ε, accuracy vs round).

The privacy cost of tuning: every trial's ε covers that trial only. Releasing the
best of several trials run on the same data costs more. :func:`tuning_epsilon`
accounts the Papernot & Steinke (ICLR 2022) mechanism — run a random number of
trials (Poisson with the experiment's mean number of samples), release the best —
with dp-accounting's ``RepeatAndSelectDpEvent`` (RDP).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from engine.privacy.accounting import SamplingSpec, round_event


def load_rounds(directory: str | Path) -> pd.DataFrame:
    """Every (trial, round) row; partition columns as plain str / float."""
    df = pd.read_parquet(Path(directory) / "rounds")
    df["algorithm"] = df["algorithm"].astype(str)
    df["epsilon_budget"] = df["epsilon_budget"].astype(str).astype(float)
    return df.sort_values(["algorithm", "epsilon_budget", "trial_id", "round"], ignore_index=True)


def load_trials(directory: str | Path) -> pd.DataFrame:
    return pd.read_parquet(Path(directory) / "trials.parquet")


def best_trials(trials: pd.DataFrame, metric: str = "test_accuracy") -> pd.DataFrame:
    """The best trial (by final ``metric``) of each (algorithm, ε), best ε-row first."""
    col = f"final_{metric}"
    ok = trials[trials["status"] == "TERMINATED"].dropna(subset=[col])
    idx = ok.groupby(["algorithm", "epsilon_budget"])[col].idxmax()
    best = ok.loc[idx].sort_values(["epsilon_budget", col], ascending=[True, False])
    return best.reset_index(drop=True)


def tuning_epsilon(
    noise_multiplier: float,
    spec: SamplingSpec,
    rounds: int,
    delta: float,
    mean_trials: float,
) -> float:
    """ε of releasing the best of Poisson(mean_trials) runs (Papernot & Steinke 2022)."""
    import dp_accounting
    from dp_accounting import dp_event, rdp

    if noise_multiplier <= 0:
        return math.inf
    one_run = dp_accounting.SelfComposedDpEvent(round_event(noise_multiplier, spec), rounds)
    event = dp_event.RepeatAndSelectDpEvent(one_run, float(mean_trials), np.inf)
    relation = (
        dp_accounting.NeighboringRelation.REPLACE_ONE
        if spec.mode == "fixed"
        else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    acc = rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def _spec_from_rows(rows: pd.DataFrame) -> SamplingSpec:
    r = rows.iloc[0]
    rate = float(r["sampling_rate"])
    if r["sampling"] == "fixed_without_replacement":
        m = int(round(float(r["cohort_size"])))
        return SamplingSpec("fixed", int(round(m / rate)), cohort_size=m)
    n = max(1, int(round(float(r["cohort_size"]) / rate)))
    return SamplingSpec("poisson", n, rate=rate)


def summary_table(directory: str | Path, metric: str = "test_accuracy") -> pd.DataFrame:
    """Best configuration per (algorithm, ε) with the ε of releasing it after tuning."""
    trials = load_trials(directory)
    rounds = load_rounds(directory)
    best = best_trials(trials, metric)
    counts = trials.groupby(["algorithm", "epsilon_budget"]).size()
    out = []
    for _, row in best.iterrows():
        mine = rounds[rounds["trial_id"] == row["trial_id"]]
        spec = _spec_from_rows(mine)
        n_rounds = int(mine["round"].max())
        delta = float(mine["delta"].iloc[0])
        z = float(mine["noise_multiplier"].iloc[0])
        record = row.to_dict()
        record["epsilon_with_tuning"] = tuning_epsilon(
            z, spec, n_rounds, delta, counts[(row["algorithm"], row["epsilon_budget"])]
        )
        out.append(record)
    return pd.DataFrame(out)


def _markdown(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for _, r in frame.iterrows():
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(directory: str | Path, metric: str = "test_accuracy") -> str:
    """Write ``report.md``, ``accuracy_vs_epsilon.png``, ``accuracy_vs_round.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    table = summary_table(directory, metric)
    rounds = load_rounds(directory)
    hp_cols = [
        c
        for c in table.columns
        if c
        not in {
            "trial_id",
            "algorithm",
            "epsilon_budget",
            "status",
            "rounds_done",
            "noise_multiplier",
            "epsilon",
            "wall_time_s_nonprivate",
            "epsilon_excludes_tuning",
            f"final_{metric}",
            f"best_{metric}",
            "epsilon_with_tuning",
        }
        and table[c].notna().any()
    ]
    shown = table[
        [
            "algorithm",
            "epsilon_budget",
            f"final_{metric}",
            "noise_multiplier",
            "epsilon",
            "epsilon_with_tuning",
            *hp_cols,
            "trial_id",
        ]
    ]

    fig, ax = plt.subplots(figsize=(6, 4))
    for alg, g in table.groupby("algorithm"):
        g = g.sort_values("epsilon_budget")
        ax.plot(g["epsilon_budget"], g[f"final_{metric}"], marker="o", label=alg)
    ax.set_xlabel("privacy budget ε (per trial)")
    ax.set_ylabel(f"best {metric}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "accuracy_vs_epsilon.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for _, row in table.iterrows():
        mine = rounds[rounds["trial_id"] == row["trial_id"]].dropna(subset=[metric])
        ax.plot(
            mine["round"],
            mine[metric],
            marker=".",
            label=f"{row['algorithm']} ε={row['epsilon_budget']:g}",
        )
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "accuracy_vs_round.png", dpi=120)
    plt.close(fig)

    text = (
        f"# dpfl tune report: {directory}\n\n"
        f"Best trial per (algorithm, ε) by final {metric}"
        + (
            " (computed from clients' data: this selection is NOT covered by ε). "
            if metric.endswith("_nonprivate")
            else " (public: measured on the public evaluation set). "
        )
        + "`epsilon` is the trial's own "
        "ε, which excludes hyperparameter selection; `epsilon_with_tuning` is the ε of "
        "releasing the best of a Poisson-distributed number of trials with the "
        "experiment's mean (Papernot & Steinke 2022, RDP).\n\n"
        + _markdown(shown)
        + "\n\nFigures: accuracy_vs_epsilon.png, accuracy_vs_round.png\n"
    )
    (directory / "report.md").write_text(text)
    return text
