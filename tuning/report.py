"""``dpfl report DIR``: which method wins at each ε, with which hyperparameters.

Pandas helpers (:func:`load_rounds`, :func:`load_trials`, :func:`best_trials`) plus
a Markdown summary and two PNG figures (accuracy vs ε, accuracy vs round).

The privacy cost of tuning: every trial's ε covers that trial only. Releasing the
best of several trials run on the same data costs more. ``epsilon_with_tuning`` is
computed by the rule ``dpfl tune --tuning-privacy`` ran under (:mod:`tuning.selection`,
README "The privacy cost of tuning"): the composition of every trial of the
(algorithm, ε) cell, or Papernot & Steinke's repeat-and-select bound when dpfl drew the
number of trials itself and released only the best; ``tuning_accounting`` names it.
Under Papernot-Steinke the report and figures show only the released trial.

Figures are built by functions that return a ``matplotlib.figure.Figure``
(:func:`plot_accuracy_vs_epsilon`, :func:`plot_accuracy_vs_round`): titles carry the
setting (dataset, N, T, δ), rounds are integer ticks, bands show ±1 std over seeds
where a configuration ran with several seeds, and the ε axis is ``epsilon_with_tuning``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from engine.privacy.participation import Participation, by_name

if TYPE_CHECKING:  # matplotlib (0.45 s to import) only where a figure is drawn
    from matplotlib.figure import Figure


def load_rounds(directory: str | Path, columns: list[str] | None = None) -> pd.DataFrame:
    """Every (trial, round) row; partition columns as plain str / float. A round both in
    a trial's compacted file and in a leftover round file (a crash between the two
    steps of ``tuning.rounds.compact_trial``) appears once. ``columns``: only these
    (plus the keys ``algorithm``, ``epsilon_budget``, ``trial_id``, ``round``), which
    halves the time to read a sweep's small files."""
    keys = ["algorithm", "epsilon_budget", "trial_id", "round"]
    wanted = None if columns is None else list(dict.fromkeys([*keys, *columns]))
    df = pd.read_parquet(Path(directory) / "rounds", columns=wanted)
    df["algorithm"] = df["algorithm"].astype(str)
    df["epsilon_budget"] = df["epsilon_budget"].astype(str).astype(float)
    return df.drop_duplicates(keys, keep="last").sort_values(keys, ignore_index=True)


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
    spec: Participation,
    rounds: int,
    delta: float,
    mean_trials: float,
    shape: float = math.inf,
) -> float:
    """ε of releasing only the best of K runs, K ~ Poisson(mean_trials) (``shape=inf``)
    or truncated negative binomial(shape, mean_trials) (Papernot & Steinke 2022, RDP).

    Valid only when dpfl drew K itself and ran non-adaptive random search (``dpfl tune
    --tuning-privacy poisson|truncated_negative_binomial``); see
    :mod:`tuning.selection`. Refuses truncated Poisson sampling (PLD only)."""
    from tuning.selection import POISSON, TNB, TrialEvent, papernot_steinke_epsilon

    event = TrialEvent(noise_multiplier, spec, rounds, delta, "rdp")
    mode = POISSON if math.isinf(shape) else TNB
    return papernot_steinke_epsilon([event], delta, mean_trials, mode, shape)[0]


def _spec_from_rows(rows: pd.DataFrame) -> Participation:
    """The trial's participation from the columns its rows carry (``num_clients`` and
    ``max_cohort`` are written by :mod:`tuning.trial`): the class that records its
    ``sampling`` name rebuilds itself (``from_columns``)."""
    import algorithms.registry  # noqa: F401 - the methods' participations are defined

    r = rows.iloc[0]
    rate = float(r["sampling_rate"])
    if "num_clients" in r and not pd.isna(r["num_clients"]):
        n = int(r["num_clients"])
    else:  # rows written before num_clients was recorded: N = E[cohort] / q
        n = max(1, int(round(float(r["cohort_size"]) / rate)))
    planned = r["rounds_planned"] if "rounds_planned" in r else None
    horizon = int(rows["round"].max()) if planned is None or pd.isna(planned) else int(planned)
    return by_name(str(r["sampling"])).from_columns(r, n, horizon)


def trial_event(rows: pd.DataFrame):
    """The :class:`tuning.selection.TrialEvent` of one trial, from its rows: its σ,
    sampling, δ, accountant and planned rounds (the rounds done if not recorded)."""
    from tuning.selection import TrialEvent

    first = rows.iloc[0]
    if "rounds_planned" in rows and not pd.isna(first["rounds_planned"]):
        n_rounds = int(first["rounds_planned"])
    else:
        n_rounds = int(rows["round"].max())
    return TrialEvent(
        float(first["noise_multiplier"]),
        _spec_from_rows(rows),
        n_rounds,
        float(first["delta"]),
        str(first["accountant"]),
    )


def _tuning_setting(trials: pd.DataFrame) -> tuple[str, float, float]:
    """(rule, mean number of trials, TNB shape) recorded by dpfl tune; experiments
    written before the rule was recorded are accounted by composition."""
    from tuning.selection import COMPOSE

    if "tuning_privacy" not in trials or trials.empty:
        return COMPOSE, math.nan, math.nan
    first = trials.iloc[0]
    return (
        str(first["tuning_privacy"]),
        float(first["tuning_mean_trials"]),
        float(first["tuning_shape"]),
    )


def released_trials(trials: pd.DataFrame, metric: str = "test_accuracy") -> pd.DataFrame:
    """The trial shown per (algorithm, ε): the one dpfl tune released under
    Papernot-Steinke (chosen at tune time, never re-chosen here), else the best by
    final ``metric`` (under composition every trial is accounted as released)."""
    mode, _, _ = _tuning_setting(trials)
    from tuning.selection import is_papernot_steinke

    if is_papernot_steinke(mode):
        chosen = trials[trials["released"].astype(bool)]
        return chosen.sort_values(["epsilon_budget", "algorithm"]).reset_index(drop=True)
    return best_trials(trials, metric)


def summary_table(directory: str | Path, metric: str = "test_accuracy") -> pd.DataFrame:
    """One released configuration per (algorithm, ε) with the ε that includes tuning
    (``epsilon_with_tuning``) and the rule behind it (``tuning_accounting``)."""
    from tuning.budget import recorded_events
    from tuning.budget_plan import read_budgets
    from tuning.plan import experiment_name
    from tuning.selection import composed_epsilon, is_papernot_steinke, papernot_steinke_epsilon

    trials = load_trials(directory)
    rounds = load_rounds(directory)
    mode, mean, shape = _tuning_setting(trials)
    shown = released_trials(trials, metric)
    budgets = read_budgets(Path(directory))  # total budgets (dpfl tune --total-epsilon)
    out = []
    for _, row in shown.iterrows():
        cell = trials[
            (trials["algorithm"] == row["algorithm"])
            & (trials["epsilon_budget"] == row["epsilon_budget"])
        ]
        events = [
            trial_event(rounds[rounds["trial_id"] == tid])
            for tid in cell["trial_id"]
            if (rounds["trial_id"] == tid).any()
        ]
        budget = budgets.get(experiment_name(row["algorithm"], float(row["epsilon_budget"])))
        if budget is not None and is_papernot_steinke(mode):
            # every configuration a trial could have drawn, not only those that ran
            events += recorded_events(budget)
        delta = max(e.delta for e in events)
        if is_papernot_steinke(mode):
            eps, rule = papernot_steinke_epsilon(events, delta, mean, mode, shape)
        else:
            eps, rule = composed_epsilon(events, delta)
        record = row.to_dict()
        record["epsilon_with_tuning"] = eps
        record["tuning_accounting"] = rule
        out.append(record)
    return pd.DataFrame(out)


def _markdown(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for _, r in frame.iterrows():
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


NOT_HYPERPARAMETERS = {
    "trial_id",
    "algorithm",
    "epsilon_budget",
    "status",
    "rounds_done",
    "noise_multiplier",
    "epsilon",
    "wall_time_s_nonprivate",
    "epsilon_excludes_tuning",
    "epsilon_with_tuning",
    "tuning_accounting",
    "tuning_privacy",
    "tuning_mean_trials",
    "tuning_shape",
    "released",
    "trial_seed",
    "epsilon_total_budget",
    "epsilon_per_trial",
}


def hyperparameter_columns_of(table: pd.DataFrame, metric: str) -> list[str]:
    skip = NOT_HYPERPARAMETERS | {f"final_{metric}", f"best_{metric}"}
    return [
        c
        for c in table.columns
        if c not in skip and not c.startswith(("final_", "best_")) and table[c].notna().any()
    ]


def setting_title(rounds: pd.DataFrame) -> str:
    """The setting of an experiment, for figure titles: dataset, N, T, δ."""
    first = rounds.iloc[0]
    if "num_clients" in rounds and not pd.isna(first["num_clients"]):
        n = int(first["num_clients"])
    else:
        n = int(round(float(first["cohort_size"]) / float(first["sampling_rate"])))
    if "rounds_planned" in rounds and rounds["rounds_planned"].notna().any():
        t = int(rounds["rounds_planned"].max())
    else:
        t = int(rounds["round"].max())
    deltas = sorted(set(rounds["delta"].dropna().astype(float)))
    delta = ", ".join(f"{d:.2g}" for d in deltas) or "n/a"
    dataset = ", ".join(sorted(set(rounds["dataset"].astype(str)))) if "dataset" in rounds else "?"
    return f"{dataset}, N={n}, T={t}, δ={delta}"


def replicates(
    table_row: pd.Series, trials: pd.DataFrame, hp_cols: list[str], allowed: pd.Series
) -> list[str]:
    """Trial ids of the shown configuration's seeds: trials of the same (algorithm, ε)
    with the same hyperparameter values, among ``allowed`` (released) trials."""
    same = trials[
        (trials["algorithm"] == table_row["algorithm"])
        & (trials["epsilon_budget"] == table_row["epsilon_budget"])
        & allowed
    ]
    for c in hp_cols:
        if c in same:
            v = table_row.get(c)
            same = same[same[c].isna()] if pd.isna(v) else same[same[c] == v]
    ids = list(same["trial_id"])
    return ids if table_row["trial_id"] in ids else [table_row["trial_id"], *ids]


def plot_accuracy_vs_epsilon(
    table: pd.DataFrame, finals: dict[str, list[float]], metric: str, title: str
) -> Figure:
    """Final ``metric`` of each released configuration against ``epsilon_with_tuning``
    (error bars: ±1 std over the configuration's seeds, where there are several)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for alg, g in table.groupby("algorithm"):
        g = g.sort_values("epsilon_with_tuning")
        ys = [finals[t] for t in g["trial_id"]]
        mean = [sum(v) / len(v) for v in ys]
        std = [pd.Series(v).std(ddof=1) if len(v) > 1 else 0.0 for v in ys]
        ax.errorbar(
            g["epsilon_with_tuning"].to_numpy(),
            mean,
            yerr=std if any(len(v) > 1 for v in ys) else None,
            marker="o",
            capsize=3,
            label=str(alg),
        )
    ax.set_xlabel("ε including tuning (epsilon_with_tuning)")
    ax.set_ylabel(f"final {metric}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_accuracy_vs_round(
    table: pd.DataFrame, rounds: pd.DataFrame, seeds: dict[str, list[str]], metric: str, title: str
) -> Figure:
    """``metric`` per round of each released configuration: the mean over its seeds,
    with a ±1 std band where it ran with several seeds; integer round ticks."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for _, row in table.iterrows():
        mine = rounds[rounds["trial_id"].isin(seeds[row["trial_id"]])].dropna(subset=[metric])
        stats = mine.groupby("round")[metric].agg(["mean", "std", "count"])
        (line,) = ax.plot(
            stats.index.to_numpy(),
            stats["mean"].to_numpy(),
            marker=".",
            label=f"{row['algorithm']} ε={row['epsilon_budget']:g} "
            f"(with tuning {row['epsilon_with_tuning']:.3g})",
        )
        if (stats["count"] > 1).any():
            sd = stats["std"].fillna(0.0).to_numpy()
            ax.fill_between(
                stats.index.to_numpy(),
                stats["mean"].to_numpy() - sd,
                stats["mean"].to_numpy() + sd,
                alpha=0.2,
                color=line.get_color(),
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(directory: str | Path, metric: str = "test_accuracy") -> str:
    """Write ``report.md``, ``accuracy_vs_epsilon.png``, ``accuracy_vs_round.png``.

    Only released trials appear (under Papernot-Steinke, the selected trial of each
    (algorithm, ε); the folder's other rows are not part of the release)."""
    directory = Path(directory)
    table = summary_table(directory, metric)
    trials = load_trials(directory)
    rounds = load_rounds(directory)
    allowed = (
        trials["released"].astype(bool)
        if "released" in trials
        else pd.Series(True, index=trials.index)
    )
    released_ids = set(trials.loc[allowed, "trial_id"])
    rounds = rounds[rounds["trial_id"].isin(released_ids)]
    hp_cols = hyperparameter_columns_of(table, metric) if not table.empty else []
    shown = table[
        [
            "algorithm",
            "epsilon_budget",
            f"final_{metric}",
            "noise_multiplier",
            *(c for c in ("epsilon_total_budget", "epsilon_per_trial") if c in table),
            "epsilon",
            "epsilon_with_tuning",
            "tuning_accounting",
            *hp_cols,
            "trial_id",
        ]
    ]
    title = setting_title(rounds)
    seeds = {
        t: replicates(r, trials, hp_cols, allowed)
        for t, r in table.set_index("trial_id", drop=False).iterrows()
    }
    final_col = f"final_{metric}"
    by_id = trials.set_index("trial_id")[final_col]
    finals = {
        t: [float(by_id[i]) for i in ids if not pd.isna(by_id[i])] for t, ids in seeds.items()
    }
    fig = plot_accuracy_vs_epsilon(table, finals, metric, title)
    fig.savefig(directory / "accuracy_vs_epsilon.png", dpi=120)
    fig = plot_accuracy_vs_round(table, rounds, seeds, metric, title)
    fig.savefig(directory / "accuracy_vs_round.png", dpi=120)

    rules = sorted(set(table["tuning_accounting"])) if not table.empty else []
    totals = ""
    if "epsilon_total_budget" in table:
        totals = (
            "Budgets are totals (dpfl tune --total-epsilon): `epsilon_total_budget` is the "
            "budget of publishing the selected trial including the search, "
            "`epsilon_per_trial` the per-trial budget solved from it (each trial ran with the "
            "noise multiplier solved for its configuration; tune/budgets.json), and "
            "`epsilon_with_tuning` dp-accounting's total for the trials that ran"
            + (
                " and every configuration a trial could draw"
                if "Papernot" in "".join(rules)
                else ""
            )
            + " (<= the budget).\n\n"
        )
    text = (
        f"# dpfl tune report: {directory}\n\nSetting: {title}\n\n"
        f"One released trial per (algorithm, ε) (by final {metric} under composition; the "
        "trial dpfl tune selected under Papernot-Steinke). `epsilon` is the trial's own ε, "
        "which excludes hyperparameter selection; `epsilon_with_tuning` includes it, by the "
        "rule in `tuning_accounting` ("
        + "; ".join(rules)
        + "). "
        + (
            f"The selection metric {metric} is computed from clients' data: this selection "
            "is NOT covered by ε (--allow-nonprivate-metric).\n\n"
            if metric.endswith("_nonprivate")
            else f"The selection metric {metric} is public (the public evaluation set).\n\n"
        )
        + totals
        + _markdown(shown)
        + "\n\nFigures: accuracy_vs_epsilon.png (x: epsilon_with_tuning), "
        "accuracy_vs_round.png\n"
    )
    (directory / "report.md").write_text(text)
    return text
