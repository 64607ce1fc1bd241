"""``dpfl report --watch DIR``: a live view of a running sweep, charts without Grafana.

Every ``interval`` seconds, from the Parquet files the trials write (one per trial and
round under ``DIR/rounds/``, folded into one per trial when it ends), this redraws

* ``DIR/live_accuracy_vs_epsilon.png``: each trial's last test accuracy against the ε it
  has spent so far (the accountant's ε of that trial alone, from its rows);
* ``DIR/live_accuracy_vs_round.png``: each trial's test accuracy per round;

and prints one progress line: trials done / running / pending, rows written. It stops
after ``iterations`` redraws, or once the sweep has written ``DIR/trials.parquet``
(after a last redraw).

Progress needs the plan ``dpfl tune`` writes when it starts (``DIR/tune/plan.json``:
the (algorithm, ε) cells, trials per cell, rounds). Under a Papernot-Steinke rule
(``--tuning-privacy poisson|truncated_negative_binomial``) the number of trials K of a
cell is private and lives only in ``DIR/unreleased/tuning_draws.json``: the pending
count is read from there, and this view, which shows every trial and not only the
released one, is the operator's and must not be published. Under composition every
trial is released and accounted, and nothing here is more than the rows hold.
``dpfl report DIR`` (after the sweep) gives the ε including tuning.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from engine.base.atomic import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Written by ``dpfl tune`` at its start (:func:`write_plan`).
PLAN_FILE = "plan.json"
LIVE_EPSILON_PNG = "live_accuracy_vs_epsilon.png"
LIVE_ROUND_PNG = "live_accuracy_vs_round.png"
COLUMNS = [
    "epsilon",
    "test_accuracy",
    "rounds_planned",
    "num_clients",
    "sampling_rate",
    "delta",
    "dataset",
]


def write_plan(
    out: Path, cells: list[str], num_samples: int, rounds: int, tuning_privacy: str
) -> None:
    """``OUT/tune/plan.json``: what the sweep will run, for :func:`progress`. Holds
    ``num_samples`` (the mean under Papernot-Steinke, public), never a drawn K."""
    path = Path(out) / "tune" / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text(
            json.dumps(
                {
                    "cells": cells,
                    "num_samples": num_samples,
                    "rounds": rounds,
                    "tuning_privacy": tuning_privacy,
                }
            )
        )


def planned_trials(directory: Path) -> int | None:
    """Trials the sweep will run in all (None when no plan is there)."""
    path = directory / "tune" / PLAN_FILE
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if plan.get("tuning_privacy", "compose") == "compose":
        return int(plan["num_samples"]) * len(plan["cells"])
    draws = directory / "unreleased" / "tuning_draws.json"
    if not draws.is_file():
        return None
    return sum(int(v) for v in json.loads(draws.read_text())["num_trials"].values())


def read_rows(directory: Path, attempts: int = 20) -> pd.DataFrame:
    """The rows written so far (empty frame when none). A trial folding its round files
    into one while they are listed makes the read fail; it is retried."""
    from tuning.report import load_rounds

    if not any((directory / "rounds").rglob("*.parquet")):
        return pd.DataFrame(columns=["algorithm", "epsilon_budget", "trial_id", "round", *COLUMNS])
    for _ in range(attempts):
        try:
            return load_rounds(directory, columns=COLUMNS)
        except (FileNotFoundError, OSError):
            time.sleep(0.2)
    return load_rounds(directory, columns=COLUMNS)


@dataclass(frozen=True)
class Progress:
    """Trials done (every planned round written, or the sweep ended), running (rows
    written, not all), pending (planned, no row yet; None without a plan)."""

    done: int
    running: int
    pending: int | None
    rows: int
    finished: bool

    def line(self) -> str:
        pending = "?" if self.pending is None else str(self.pending)
        end = "; sweep finished" if self.finished else ""
        return (
            f"trials: {self.done} done, {self.running} running, {pending} pending; "
            f"{self.rows} rows{end}"
        )


def progress(directory: Path, rows: pd.DataFrame) -> Progress:
    finished = (directory / "trials.parquet").is_file()
    done = running = 0
    for _, g in rows.groupby("trial_id"):
        planned = g["rounds_planned"].dropna()
        complete = not planned.empty and int(g["round"].max()) >= int(planned.max())
        if complete or finished:
            done += 1
        else:
            running += 1
    total = planned_trials(directory)
    pending = None if total is None else max(0, total - done - running)
    if finished:
        pending = 0
    return Progress(done, running, pending, len(rows), finished)


def _title(rows: pd.DataFrame, state: Progress) -> str:
    from tuning.report import setting_title

    return f"{setting_title(rows)}\nlive: {state.line()}"


def plot_live_epsilon(rows: pd.DataFrame, title: str) -> Figure:
    """Each trial's last test accuracy against the ε it has spent (its own, excluding
    tuning): one marker per trial, one colour per algorithm and budget."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    last = rows.dropna(subset=["test_accuracy"]).sort_values("round").groupby("trial_id").last()
    for (alg, budget), g in last.groupby(["algorithm", "epsilon_budget"]):
        ax.scatter(g["epsilon"], g["test_accuracy"], label=f"{alg} ε budget {budget:g}", s=25)
    ax.set_xlabel("ε spent so far (each trial alone; excludes tuning)")
    ax.set_ylabel("last test_accuracy")
    ax.set_title(title, fontsize=8)
    if not last.empty:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_live_rounds(rows: pd.DataFrame, title: str) -> Figure:
    """Test accuracy per round of every trial (one line each)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    evaluated = rows.dropna(subset=["test_accuracy"])
    colours: dict[tuple[str, float], Any] = {}
    for (alg, budget, _tid), g in evaluated.groupby(["algorithm", "epsilon_budget", "trial_id"]):
        key = (str(alg), float(budget))
        label = None if key in colours else f"{alg} ε budget {budget:g}"
        (line,) = ax.plot(
            g["round"], g["test_accuracy"], marker=".", color=colours.get(key), label=label
        )
        colours.setdefault(key, line.get_color())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test_accuracy")
    ax.set_title(title, fontsize=8)
    if colours:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def redraw(directory: str | Path) -> Progress:
    """Read the rows, redraw both live figures (when there are rows), return progress."""
    directory = Path(directory)
    rows = read_rows(directory)
    state = progress(directory, rows)
    if len(rows):
        title = _title(rows, state)
        plot_live_epsilon(rows, title).savefig(directory / LIVE_EPSILON_PNG, dpi=110)
        plot_live_rounds(rows, title).savefig(directory / LIVE_ROUND_PNG, dpi=110)
    return state


def watch(
    directory: str | Path,
    interval: float = 5.0,
    iterations: int | None = None,
    echo: Callable[[str], None] = print,
) -> Progress:
    """Redraw every ``interval`` s, at most ``iterations`` times (None: until the sweep
    writes ``trials.parquet``); one progress line per redraw. Returns the last state."""
    directory = Path(directory)
    n = 0
    while True:
        state = redraw(directory)
        n += 1
        stamp = time.strftime("%H:%M:%S")
        echo(f"[{stamp}] {state.line()}")
        if state.finished or (iterations is not None and n >= iterations):
            return state
        time.sleep(max(0.0, interval if math.isfinite(interval) else 5.0))
