"""The trials table, ``DIR/trials.parquet``: one row per trial of a ``dpfl tune``
experiment, folded from the rows each trial wrote (:mod:`tuning.rounds`), with the
tuning rule and which trials may be released (:mod:`tuning.selection`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from engine.base.atomic import atomic_write
from tuning import selection


def trials_table(out: Path, statuses: dict[str, str], metric: str) -> pd.DataFrame:
    """One row per trial, from the rounds each trial wrote (and Tune's status)."""
    from tuning.report import load_rounds
    from tuning.rounds import hyperparameter_columns

    if not (out / "rounds").is_dir():  # every cell drew K = 0
        return pd.DataFrame(columns=["trial_id", "algorithm", "epsilon_budget", "status"])
    import pyarrow.parquet as pq

    # Only the columns the table shows (half the reading time of a sweep's small
    # files), as far as the files have them: they share one schema (tuning.trial).
    first = next((out / "rounds").rglob("*.parquet"), None)
    present = set(pq.read_schema(first).names) if first is not None else set()
    hyper = hyperparameter_columns()
    fixed = ["noise_multiplier", "epsilon", "wall_time_s_nonprivate", "trial_seed", metric]
    wanted = [c for c in dict.fromkeys([*fixed, *hyper]) if c in present]
    rounds = load_rounds(out, columns=wanted)
    hp_cols = [
        c
        for c in hyper
        if c in rounds and c not in ("personal_accuracy_nonprivate", "mia_auc_nonprivate")
    ]
    # One pass over all trials (a Python loop over per-trial frames took 0.7 ms each).
    rounds = rounds.sort_values(["trial_id", "round"], kind="stable")
    lasts = rounds.groupby("trial_id", sort=True).tail(1)
    if metric in rounds:
        evaluated = rounds.dropna(subset=[metric]).groupby("trial_id")[metric]
        final, best = evaluated.last().to_dict(), evaluated.max().to_dict()
    else:
        final, best = {}, {}
    has_seed = "trial_seed" in rounds
    # Values as the frame holds them (pd.NA stays pd.NA; to_dict would make it None).
    hp_values = {c: list(lasts[c]) for c in hp_cols}
    rows = []
    for i, last in enumerate(lasts.to_dict("records")):
        trial_id = last["trial_id"]
        row = {
            "trial_id": trial_id,
            "algorithm": last["algorithm"],
            "epsilon_budget": float(last["epsilon_budget"]),
            "status": statuses.get(trial_id, "UNKNOWN"),
            "rounds_done": int(last["round"]),
            "noise_multiplier": float(last["noise_multiplier"]),
            "epsilon": float(last["epsilon"]),
            f"final_{metric}": float(final.get(trial_id, math.nan)),
            f"best_{metric}": float(best.get(trial_id, math.nan)),
            "wall_time_s_nonprivate": float(last["wall_time_s_nonprivate"]),
            "trial_seed": int(last["trial_seed"]) if has_seed else -1,
        }
        for c in hp_cols:
            row[c] = hp_values[c][i]
        rows.append(row)
    return pd.DataFrame(rows)


def mark_released(
    trials: pd.DataFrame, metric: str, mode: str, num_samples: int, shape: float
) -> pd.DataFrame:
    """Record the tuning rule and which trials are released: all under composition
    (all are accounted), only the best finished trial per (algorithm, ε) by final
    ``metric`` under Papernot-Steinke (the only one that may be published)."""
    trials = trials.copy()
    trials["tuning_privacy"] = mode
    trials["tuning_mean_trials"] = float(num_samples)
    trials["tuning_shape"] = float(shape) if mode == selection.TNB else math.inf
    if not selection.is_papernot_steinke(mode) or trials.empty:
        trials["released"] = True
        return trials
    trials["released"] = False
    col = f"final_{metric}"
    ok = trials[trials["status"] == "TERMINATED"].dropna(subset=[col])
    if not ok.empty:
        best = ok.groupby(["algorithm", "epsilon_budget"])[col].idxmax()
        trials.loc[best.to_numpy(), "released"] = True
    return trials


def write_trials(out: Path, trials: pd.DataFrame) -> None:
    """Write ``out/trials.parquet`` atomically (:func:`engine.base.atomic.atomic_write`)."""
    with atomic_write(out / "trials.parquet") as tmp:
        trials.to_parquet(tmp, index=False)
