"""A cell of the leaderboard: one method at one total ε — its private search, the
selection on the public validation set, and the seed runs of the selected configuration.

* **Trials.** Trial k of the cell runs the hyperparameters of
  :func:`tuning.leaderboard.draws.trial_params` with run seed ``trial_seed(k)`` and the
  noise multiplier :mod:`tuning.budget` solved for its configuration (its rounds, and
  for dp_bandmf its bands), so that publishing the selected trial costs at most the
  cell's total ε including the search.
* **Selection.** The trial with the highest final ``val_accuracy`` (the public
  validation set, held out of every client; ties: the lowest k). The test set is never
  read by the selection: :func:`select` sees only the validation column.
  A personalised method is selected on its own ``personal_accuracy_nonprivate``
  (clients' held-out data: not covered by ε; labelled so).
* **Seed runs.** The selected configuration again, at the same σ, with the run seeds
  ``eval_seed(j)``, j < n: an estimate of the configuration's expected test accuracy.
  A research measurement, not a release (their ε is each run's own; nothing selected
  from them is published under the budget).
* **The released trial's ε** is recomputed from the trials' rows after they ran
  (:func:`released_epsilon`: dp-accounting's composition of the events that ran, or the
  repeat-and-select bound over every configuration the search could draw) and must be
  within the total budget.

Each cell's record, ``OUT/cells/<cell>.json``, keeps the budget, the selection, the
released ε and, for every sitting that worked on it, its start and end, its wall time
and the code that ran (:func:`code_version`).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from engine.base.atomic import atomic_write
from engine.config import RunConfig, replace, with_algorithm
from tuning import selection
from tuning.leaderboard import draws
from tuning.leaderboard.runs import SEED, TRIAL, PlannedRun, check_run
from tuning.leaderboard.settings import PERSONAL_METRIC, SELECTION_METRIC

if TYPE_CHECKING:
    from tuning.leaderboard.parallel import RunPool

RANKED, REFERENCE, PERSONAL = "ranked", "reference", "personal"


@dataclass(frozen=True)
class Cell:
    """One method at one total budget (``inf``: a non-private reference)."""

    method: str
    total: float
    kind: str

    @property
    def name(self) -> str:
        return (
            f"{self.method}-nonprivate"
            if math.isinf(self.total)
            else f"{self.method}-eps{self.total:g}"
        )

    @property
    def metric(self) -> str:
        return PERSONAL_METRIC if self.kind == PERSONAL else SELECTION_METRIC


def record_path(out: Path, cell: Cell) -> Path:
    return Path(out) / "cells" / f"{cell.name}.json"


def read_record(out: Path, cell: Cell) -> dict[str, Any]:
    path = record_path(out, cell)
    return json.loads(path.read_text()) if path.is_file() else {}


def write_record(out: Path, cell: Cell, record: dict[str, Any]) -> None:
    path = record_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True, default=float))


def trial_params(
    config: RunConfig, cell: Cell, k: int, shared: dict[str, Any], own: dict[str, Any]
) -> dict[str, Any]:
    private = not math.isinf(cell.total)
    return draws.trial_params(config.seed, cell.method, k, shared, own, private)


def run_config(
    config: RunConfig, cell: Cell, params: dict[str, Any], seed: int, sigma: float | None
) -> RunConfig:
    """The complete config of a run: the method, its hyperparameters, its seed and, for a
    private method, its solved σ (``privacy.noise_multiplier``)."""
    c = with_algorithm(config, cell.method, **params)
    changes: dict[str, Any] = {"seed": seed, "out": None}
    if sigma is not None:
        changes.update({"privacy.epsilon": None, "privacy.noise_multiplier": float(sigma)})
    return replace(c, **changes)


def planned_trials(
    config: RunConfig, cell: Cell, n: int, shared: dict, own: dict, budget: dict | None
) -> list[PlannedRun]:
    """Trials 0..n-1 of the cell; ``budget``: the cell's solved budget record (None for a
    non-private reference)."""
    from tuning.budget_plan import noise_of

    noise = noise_of(budget) if budget is not None else None
    runs = []
    for k in range(n):
        params = trial_params(config, cell, k, shared, own)
        sigma = None
        if noise is not None:
            sigma = next(
                z for keys, z in noise if all(params.get(a, v) == v for a, v in keys.items())
            )
        c = run_config(config, cell, params, draws.trial_seed(config.seed, k), sigma)
        runs.append(
            PlannedRun(f"{cell.name}-trial{k}", cell.method, cell.total, TRIAL, k, params, c)
        )
    return runs


def final_value(rows: pd.DataFrame, column: str) -> float:
    """The last evaluated value of ``column`` (NaN if never evaluated)."""
    if column not in rows:
        return math.nan
    vals = rows.sort_values("round")[column].dropna()
    return float(vals.iloc[-1]) if len(vals) else math.nan


def select(scores: dict[int, float]) -> int | None:
    """The trial with the highest selection score (ties: the lowest index); ``scores``
    holds only the selection metric of each trial — the test set is not an argument."""
    valid = {k: v for k, v in scores.items() if not math.isnan(v)}
    if not valid:
        return None
    best = max(valid.values())
    return min(k for k, v in valid.items() if v == best)


def planned_seeds(
    config: RunConfig, cell: Cell, chosen: PlannedRun, seeds: int
) -> list[PlannedRun]:
    """The selected configuration's seed runs: the same hyperparameters and σ."""
    sigma = chosen.config.privacy.noise_multiplier if chosen.config.is_private else None
    return [
        PlannedRun(
            f"{cell.name}-seed{j}",
            cell.method,
            cell.total,
            SEED,
            j,
            chosen.params,
            run_config(config, cell, chosen.params, draws.eval_seed(config.seed, j), sigma),
        )
        for j in range(seeds)
    ]


def released_epsilon(
    trial_rows: list[pd.DataFrame], mode: str, mean: float, shape: float, budget: dict
) -> tuple[float, str]:
    """ε of publishing the selected trial, search included, recomputed by dp-accounting
    from the σ, sampling and rounds the trials ran with (and, under Papernot-Steinke,
    every configuration the search could draw)."""
    from tuning.budget import recorded_events
    from tuning.report import trial_event

    events = [trial_event(rows) for rows in trial_rows]
    delta = max([e.delta for e in events] + [float(budget["delta"])])
    if selection.is_papernot_steinke(mode):
        return selection.papernot_steinke_epsilon(
            events + recorded_events(budget), delta, mean, mode, shape
        )
    return selection.composed_epsilon(events, delta)


def run_cell(
    out: Path,
    config: RunConfig,
    cell: Cell,
    n_trials: int,
    seeds: int,
    shared: dict,
    own: dict,
    budget: dict | None,
    tuning: tuple[str, float, float],
    runner: RunPool,
    echo=print,
) -> dict[str, Any]:
    """Run (or continue) the cell; its record (also written). ``runner``: a
    :class:`tuning.leaderboard.parallel.RunPool`, which runs the cell's trials (then its
    seed runs) in this process or several at once."""
    t0 = time.perf_counter()
    record = read_record(out, cell)
    sittings = list(record.get("sittings", []))
    sittings.append({"started_utc": _now(), "wall_time_s": 0.0, "code": code_version()})

    def progress() -> None:  # the sitting's time so far, kept if the process dies
        sittings[-1].update({"finished_utc": _now(), "wall_time_s": time.perf_counter() - t0})
        record["sittings"] = sittings
        record["wall_time_s"] = sum(s["wall_time_s"] for s in sittings)
        write_record(out, cell, record)

    record.update({"method": cell.method, "total_epsilon_budget": cell.total, "kind": cell.kind})
    record.update({"selection_metric": cell.metric, "trials": n_trials, "seeds": seeds})
    if budget is not None:
        record["budget"] = budget
    trials = planned_trials(config, cell, n_trials, shared, own, budget)
    _run_all(
        out,
        trials,
        runner,
        lambda run: f"trial {run.index + 1}/{n_trials} (T={run.config.rounds})",
        cell,
        echo,
        progress,
    )
    rows = [_rows_of(out, run) for run in trials]
    scores = {run.index: final_value(r, cell.metric) for run, r in zip(trials, rows, strict=True)}
    chosen = select(scores)
    if chosen is None:
        record.update({"status": "no trial", "selected": None})
    else:
        pick = trials[chosen]
        record["selected"] = {
            "index": chosen,
            "params": pick.params,
            "noise_multiplier": pick.config.privacy.noise_multiplier
            if pick.config.is_private
            else 0.0,
            "rounds": pick.config.rounds,
            cell.metric: scores[chosen],
        }
        if budget is not None:
            mode, mean, shape = tuning
            eps, rule = released_epsilon(rows, mode, mean, shape, budget)
            if eps > cell.total * (1 + 1e-9):
                raise RuntimeError(f"{cell.name}: released epsilon {eps} above the budget")
            record.update({"released_epsilon": eps, "released_rule": rule})
        finals = []
        seed_runs = planned_seeds(config, cell, pick, seeds)
        _run_all(
            out,
            seed_runs,
            runner,
            lambda run: f"seed run {run.index + 1}/{seeds}",
            cell,
            echo,
            progress,
        )
        for run in seed_runs:
            r = _rows_of(out, run)
            finals.append(
                {
                    "seed_index": run.index,
                    "test_accuracy": final_value(r, "test_accuracy"),
                    PERSONAL_METRIC: final_value(r, PERSONAL_METRIC),
                    "epsilon": float(r["epsilon"].iloc[-1]),
                }
            )
        record["seed_runs"] = finals
        record["status"] = "done"
    progress()
    return record


def code_version() -> str:
    """The code that runs: the commit of dpfl's git checkout (12 hex digits, ``+dirty``
    when tracked files differ from it), else ``dpfl <version>`` of the installed
    package. A leaderboard's sittings may run at different commits; each records its own."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:  # dpfl's own checkout only, not a repository that holds an installed copy
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            raise OSError("not dpfl's checkout")
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"dpfl {version('dpfl')}"
        except PackageNotFoundError:
            return "dpfl (version unknown)"
    return head + ("+dirty" if dirty else "")


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _run_all(
    out: Path,
    runs: list[PlannedRun],
    runner: RunPool,
    label: Callable[[PlannedRun], str],
    cell: Cell,
    echo: Callable[[str], None],
    progress: Callable[[], None],
) -> None:
    """Run (or continue) every unfinished run of ``runs`` on ``runner``: a line as each
    starts and ends, the cell's record after each."""
    todo = [run for run in runs if check_run(out, run) != "done"]
    for run in todo:
        echo(f"  {cell.name}: {label(run)} ...")

    def done(run: PlannedRun) -> None:
        if len(todo) > 1 and runner.processes > 1:
            echo(f"  {cell.name}: {label(run)} done")
        progress()

    runner.run(todo, done)


def _rows_of(out: Path, run: PlannedRun) -> pd.DataFrame:
    """A finished run's rows."""
    from tuning.leaderboard.runs import read_rows

    rows = read_rows(out, run.run_id)
    if rows is None or check_run(out, run) != "done":
        raise RuntimeError(f"{run.run_id}: not finished ({out / 'runs' / run.run_id})")
    return rows
