"""``dpfl compare``: several recipes at one privacy budget, one table, best first.

Every method runs with the same config (data, model, sampling, budget, seed); only
``algorithm`` changes. Private methods at one ε are comparable because each one's σ
is calibrated to that ε with its own sampling; non-private rows report ε = inf.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd

from algorithms import RECIPES
from engine.config import (
    CUSTOM,
    ConfigError,
    RunConfig,
    config_from_dict,
    dotted_leaves,
    merge_trees,
    replace,
    with_algorithm,
)

AUDIT_COLUMNS = ("audit_epsilon_estimate_nonprivate", "audit_epsilon_lower_nonprivate")


Variants = Mapping[str, Mapping[str, Any]]


class PlannedRun(NamedTuple):
    """One run of a comparison: its table row's ``label`` (a recipe name, or a preset
    variant's name) and the complete config it runs."""

    label: str
    config: RunConfig


def parse_algorithms(spec: str, variants: Variants | None = None) -> list[str]:
    """Row names from ``--algorithms``: recipe names (``custom``: the config's own
    ``recipe:`` section), or ``all`` (the built-in recipes); with a preset's
    ``variants`` (named config diffs), their names too."""
    if spec.strip() == "all":
        return list(RECIPES)
    known = [*RECIPES, CUSTOM, *(variants or {})]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"--algorithms={spec!r}: unknown {unknown}; known: {', '.join(known)}")
    return names


def recipe_of(label: str, variants: Variants | None = None) -> str:
    """The recipe a row runs: a variant's ``algorithm``, else the label itself."""
    return str((variants or {}).get(label, {}).get("algorithm", label))


def _row(config: RunConfig, label: str, variants: Variants | None, **changes: Any) -> PlannedRun:
    """``label``'s run: a variant's config diff merged over ``config``, then its recipe."""
    diff = dict((variants or {}).get(label, {}))
    algorithm = str(diff.pop("algorithm", label))
    if diff:
        config = config_from_dict(merge_trees(config.to_dict(), diff))
    return PlannedRun(label, with_algorithm(config, algorithm, **changes))


def plan(
    config: RunConfig,
    algorithms: list[str],
    out: Path,
    seeds: list[int] | None = None,
    epsilons: list[float] | None = None,
    variants: Variants | None = None,
) -> list[PlannedRun]:
    """One run per (seed, row). Without ``seeds``: runs under ``out/<row>/`` at
    ``config.seed``; with seeds: ``out/seed<k>/<row>/``. With ``epsilons`` (a paper
    table's columns): the same under ``out/eps<e>/`` for each target ε, σ calibrated
    to it (``privacy.noise_multiplier`` cleared). A row is a recipe name, or the name
    of one of ``variants`` (a config diff with its own ``algorithm``, e.g. FedSGD as
    ``fedavg`` with one full-batch step), applied on top of ``config``."""
    if epsilons:
        return [
            r
            for e in epsilons
            for r in plan(
                replace(config, **{"privacy.epsilon": e, "privacy.noise_multiplier": None}),
                algorithms,
                Path(out) / f"eps{e:g}",
                seeds,
                variants=variants,
            )
        ]
    if seeds:
        return [
            _row(config, a, variants, seed=s, out=str(Path(out) / f"seed{s}" / a))
            for s in seeds
            for a in algorithms
        ]
    return [_row(config, a, variants, out=str(Path(out) / a)) for a in algorithms]


def validate(runs: list[PlannedRun]) -> None:
    """Every check that needs no training (data files, model, budget), for every
    row, before any folder is created or any work starts. The seed changes no
    check, so each row is checked once."""
    from engine.simulation import prepare

    seen: set[str] = set()
    for label, c in runs:
        if label not in seen:
            seen.add(label)
            prepare(c)


#: Keys a resumed comparison may change: where the results and Ray are.
RESUME_MAY_DIFFER = ("out", "ray.address", "ray.executor")


def check_resume(runs: list[PlannedRun], out: Path) -> dict[str, Any]:
    """``dpfl compare --resume``: every planned run's folder that exists, checked before
    anything is written (:func:`engine.results.run_folder.check_run_folder`: its config, its
    checkpoint, every released row) and compared with the run the flags plan now.
    Returns the checked folders by run folder; ConfigError (one line) otherwise."""
    from engine.results.run_folder import check_run_folder

    again = f"start the comparison again with dpfl compare --out {out} --overwrite"
    found: dict[str, Any] = {}
    for label, c in runs:
        folder = Path(str(c.out))
        if not folder.exists():
            continue
        checked = check_run_folder(folder, restart=again)
        before, now = dotted_leaves(checked.config.to_dict()), dotted_leaves(c.to_dict())
        for key in sorted(set(before) | set(now)):
            if key not in RESUME_MAY_DIFFER and before.get(key) != now.get(key):
                raise ConfigError(
                    f"--resume: the flags give {key}={now.get(key)!r} but "
                    f"{folder / 'config.json'} ran {label} with {before.get(key)!r}; resume "
                    "with the flags the comparison started with (nothing was changed)"
                )
        found[str(folder)] = checked
    if not found and not (Path(out) / "compare.parquet").exists():
        raise ConfigError(f"--out={str(out)!r}: no dpfl compare results there to --resume")
    return found


def _finished(c: RunConfig, checked: Any) -> Any:
    """A finished run's result as on disk (nothing is computed or rewritten)."""
    import json

    from engine.simulation import SimulationResult

    privacy = json.loads((Path(str(c.out)) / "config.json").read_text())["privacy"]
    weights = checked.state["server"]["weights"]
    return SimulationResult(c, privacy, checked.rows, weights, Path(str(c.out)))


def run(
    runs: list[PlannedRun],
    out: Path,
    progress: bool = True,
    done: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """Run every planned run; one row per run (its label as ``algorithm``, its recipe
    as ``recipe``, its seed) in ``out/compare.parquet``, rewritten after each run.
    ``done`` (:func:`check_resume`): runs whose folder exists; a finished one is read
    from disk, an interrupted one continues from its checkpoint."""
    from engine.simulation import simulate

    owns_ray = False
    first = runs[0].config
    if first.ray.executor == "ray":  # one Ray for all runs, not one start per method
        from engine.runtime.executors import ensure_ray

        owns_ray = ensure_ray(first.ray)
    rows = []
    try:
        for i, (label, c) in enumerate(runs, 1):
            if progress:
                print(f"[{i}/{len(runs)}] {label} seed={c.seed}", flush=True)
            t0 = time.perf_counter()
            checked = (done or {}).get(str(c.out))
            if checked is not None and checked.status == "complete":
                res = _finished(c, checked)
            else:  # fresh, or continued from its checkpoint ("start": from round 0)
                res = simulate(c, progress=progress, resume=checked.state if checked else None)
            acc = res.rounds["test_accuracy"].dropna()
            row = {
                "epsilon_target": c.privacy.epsilon if c.is_private else math.inf,
                "algorithm": label,
                "recipe": c.algorithm,
                "seed": c.seed,
                "private": c.is_private,
                "epsilon": res.final_epsilon,
                "noise_multiplier": res.privacy["noise_multiplier"],
                "final_accuracy": res.final_accuracy,
                "best_accuracy": float(acc.max()) if len(acc) else math.nan,
                "wall_time_s_nonprivate": time.perf_counter() - t0,
            }
            if checked is not None and "wall_time_s_nonprivate" in res.rounds:
                # a finished or continued run: its own clock (seconds since its round 1)
                row["wall_time_s_nonprivate"] = float(res.rounds["wall_time_s_nonprivate"].iloc[-1])
            if "personal_accuracy_nonprivate" in res.rounds:
                pa = res.rounds["personal_accuracy_nonprivate"].dropna()
                row["personal_accuracy_nonprivate"] = float(pa.iloc[-1]) if len(pa) else math.nan
            for col in AUDIT_COLUMNS:  # the canary audit's diagnostics, beside ε
                if col in res.rounds:
                    row[col] = float(res.rounds[col].iloc[-1])
            rows.append(row)
            pd.DataFrame(rows).to_parquet(out / "compare.parquet", index=False)
    finally:
        if owns_ray:
            from engine.runtime.ray_start import release_ray

            release_ray()  # now, or at the dpfl executable's exit
    return pd.DataFrame(rows)


def compare(
    config: RunConfig,
    algorithms: list[str],
    out: Path,
    progress: bool = True,
    seeds: list[int] | None = None,
    epsilons: list[float] | None = None,
) -> pd.DataFrame:
    """Run each algorithm (for each seed and ε); return :func:`summarize` of the runs."""
    runs = plan(config, algorithms, out, seeds, epsilons)
    validate(runs)
    Path(out).mkdir(parents=True, exist_ok=True)
    return summarize(run(runs, Path(out), progress))


METRICS = ("final_accuracy", "best_accuracy", "personal_accuracy_nonprivate")


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per algorithm, best mean final accuracy first: every column's mean over
    seeds, ``<metric>_std`` (sample standard deviation; NaN for one seed) for the
    accuracies, and ``seeds``, the number of runs."""
    keys = ["algorithm"]
    if "epsilon_target" in rows and rows["epsilon_target"].nunique() > 1:
        keys = ["epsilon_target", "algorithm"]  # a table over several budgets
    labels = ("algorithm", "recipe", "private", "seed")
    numeric = [c for c in rows.columns if c not in (*labels, *keys)]
    grouped = rows.groupby(keys, sort=False)
    table = grouped[numeric].mean()
    for m in METRICS:
        if m in rows:
            table[f"{m}_std"] = grouped[m].std(ddof=1)
    if "recipe" in rows:
        table["recipe"] = grouped["recipe"].first()
    table["private"] = grouped["private"].first()
    table["seeds"] = grouped.size()
    table = table.reset_index()
    if len(keys) > 1:
        return table.sort_values(
            ["epsilon_target", "final_accuracy"], ascending=[True, False], ignore_index=True
        )
    return table.sort_values("final_accuracy", ascending=False, ignore_index=True)


def format_table(summary: pd.DataFrame) -> str:
    """The printed table; accuracies as ``mean ± std`` when there are several seeds."""
    cols = [
        "epsilon_target",
        "algorithm",
        "private",
        "epsilon",
        "noise_multiplier",
        "final_accuracy",
        "best_accuracy",
        "personal_accuracy_nonprivate",
        *AUDIT_COLUMNS,
        "wall_time_s_nonprivate",
    ]
    cols = [c for c in cols if c in summary]
    if "epsilon_target" in summary and summary["epsilon_target"].nunique() <= 1:
        cols.remove("epsilon_target")  # one budget: the epsilon column says it
    shown = summary[cols].copy()
    several = "seeds" in summary and int(summary["seeds"].max()) > 1
    if several:
        for m in METRICS:
            if m in shown:
                shown[m] = [
                    f"{mu:.4g} ± {sd:.2g}" if not math.isnan(mu) else "nan"
                    for mu, sd in zip(summary[m], summary[f"{m}_std"], strict=True)
                ]
        shown["seeds"] = summary["seeds"]
    text = shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    if several:
        text += "\n(accuracies: mean ± sample std over seeds; other columns: mean)"
    return text


def format_paper_table(summary: pd.DataFrame, metric: str = "final_accuracy") -> str:
    """A paper table's shape: one row per algorithm, one column per target ε, cells
    ``mean ± std`` of ``metric`` over seeds, and the ε the accountant computed for
    each column underneath (per algorithm the mean over seeds, then the largest over
    the algorithms; the runs of one column share σ, sampling and rounds, so equal).
    Runs with ``eval.audit_canaries`` add a second table of the same shape whose cells
    are the canary audit's ``estimate / lower bound`` (means over seeds), to read
    against the accountant's ε of the column."""
    if "epsilon_target" not in summary:
        return format_table(summary)
    algos = list(dict.fromkeys(summary["algorithm"]))
    targets = sorted(set(summary["epsilon_target"]))

    def by_cell(text_of) -> pd.DataFrame:
        cell = {(r["algorithm"], r["epsilon_target"]): text_of(r) for _, r in summary.iterrows()}
        return pd.DataFrame(
            {f"eps={e:g}": [cell.get((a, e), "") for a in algos] for e in targets},
            index=pd.Index(algos, name="algorithm"),
        )

    has_std = f"{metric}_std" in summary
    frame = by_cell(
        lambda r: (
            f"{r[metric]:.4f} ± {r[metric + '_std']:.3f}"
            if has_std and not math.isnan(r[metric + "_std"])
            else f"{r[metric]:.4f}"
        )
    )
    achieved = summary.groupby("epsilon_target")["epsilon"].max()
    spent = ", ".join(f"eps={e:g}: {achieved[e]:.4g}" for e in targets if e in achieved)
    n = int(summary["seeds"].max()) if "seeds" in summary else 1
    text = (
        f"{metric} (mean ± sample std over {n} seed(s))\n"
        f"{frame.to_string()}\n"
        f"epsilon computed by the accountant (largest over the algorithms): {spent}"
    )
    estimate, lower = AUDIT_COLUMNS
    if estimate in summary and lower in summary and summary[estimate].notna().any():
        audit = by_cell(lambda r: f"{r[estimate]:.3g} / {r[lower]:.3g}")
        text += (
            "\ncanary audit, estimate / lower bound (means over seeds; diagnostics of this"
            " run, not guarantees)\n"
            f"{audit.to_string()}"
        )
    return text
