"""``dpfl tune --total-epsilon``: each cell's total budget solved before any trial runs.

A cell (algorithm, E) of a total-budget sweep runs its trials with the noise
multipliers :mod:`tuning.budget` solves so that publishing the selected trial costs at
most E including the search. Its configurations are the grid of the search space's
privacy keys (``rounds``, ``algo.bands``: choices only); under composition the trials'
draws are known in advance (:func:`tuning.trial.sampled_params`: seeded, never
results), so the composition is of the very events that will run.

The solutions are kept in ``tune/budgets.json`` (one record per cell:
:meth:`tuning.budget.BudgetSolution.record`); a resumed sweep takes its σ's from there
(the σ its finished trials ran with), never from a new solve.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.base.atomic import atomic_write
from engine.config import ConfigError, RunConfig
from tuning import budget as budgets
from tuning import selection
from tuning.budget_search import solve_budget
from tuning.plan import experiment_name

BUDGETS_FILE = "budgets.json"


def grid_of(space: dict[str, Any]) -> dict[str, list[Any]]:
    """The privacy keys ``space`` varies, with their values; ConfigError for a privacy
    key that is not a choice among :data:`tuning.budget.GRID_KEYS` (its configurations
    could not be enumerated)."""
    grid: dict[str, list[Any]] = {}
    for key, spec in space.items():
        privacy = any(
            key == p or (p.endswith(".") and key.startswith(p)) for p in selection.PRIVACY_KEYS
        )
        if not privacy:
            continue
        if key not in budgets.GRID_KEYS or spec.get("type") != "choice":
            raise ConfigError(
                f"tune.space.{key}: under --total-epsilon a key that changes a trial's "
                f"privacy event must be one of {', '.join(budgets.GRID_KEYS)} and a choice "
                "(a finite grid, every configuration accounted)"
            )
        grid[key] = list(spec["values"])
    return grid


def noise_of(record: dict[str, Any]) -> list[tuple[dict[str, Any], float]]:
    """(grid-key values, σ) of each configuration of a cell's record: what
    :func:`tuning.trial.trial_body` runs a trial with."""
    return [(dict(c["keys"]), float(c["noise_multiplier"])) for c in record["configurations"]]


def read_budgets(out: Path) -> dict[str, Any]:
    path = out / "tune" / BUDGETS_FILE
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--resume: {path} is damaged ({type(e).__name__})") from None


def write_budgets(out: Path, records: dict[str, Any]) -> None:
    path = out / "tune" / BUDGETS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(records, indent=1, sort_keys=True))


def plan_budgets(
    out: Path,
    config: RunConfig,
    algorithms: list[str],
    totals: list[float],
    spaces: dict[str, dict[str, Any]],
    mode: str,
    num_samples: int,
    shape: float,
    resume: bool,
    echo=print,
) -> dict[str, dict[str, Any]]:
    """Each cell's budget record (name → record), solved here or, on resume, read back
    from ``tune/budgets.json``. Writes nothing; ConfigError (one line) when a budget
    cannot be met."""
    from tuning.trial import sampled_params

    saved = read_budgets(out) if resume else {}
    records: dict[str, dict[str, Any]] = {}
    memo: dict[budgets.Budget, budgets.BudgetSolution] = {}
    for a in algorithms:
        grid = grid_of(spaces[a])
        configs = tuple(budgets.configurations(config, a, grid))
        for e in totals:
            name = experiment_name(a, e)
            draws: tuple[int, ...] = ()
            if mode == selection.COMPOSE:
                draws = tuple(
                    budgets.index_of(configs, sampled_params(spaces[a], config.seed, a, e, k))
                    for k in range(num_samples)
                )
            try:
                budget = budgets.Budget(e, mode, float(num_samples), shape, configs, draws)
            except budgets.BudgetError as err:
                raise ConfigError(str(err)) from None
            if name in saved:
                records[name] = _check_saved(out, name, saved[name], budget)
                continue
            if budget not in memo:
                echo(f"{name}: solving the per-trial budget for a total of {e:g} ...")
                try:
                    memo[budget] = solve_budget(budget)
                except budgets.BudgetError as err:
                    raise ConfigError(f"{a}: {err}") from None
            solution = memo[budget]
            records[name] = solution.record()
            echo(
                f"{name}: per-trial epsilon {solution.per_trial_epsilon:.6g}, total "
                f"{solution.total_epsilon:.6g} ({solution.rule})"
            )
    return records


def _check_saved(out: Path, name: str, record: dict[str, Any], budget: budgets.Budget) -> dict:
    """A saved record must describe the same budget (configurations, draws, rule)."""
    same = (
        float(record.get("total_epsilon_budget", -1)) == budget.total
        and record.get("tuning_privacy") == budget.mode
        and [dict(c["keys"]) for c in record.get("configurations", [])]
        == [dict(c.keys) for c in budget.configurations]
        and list(record.get("draws", [])) == list(budget.draws)
    )
    if not same:
        raise ConfigError(
            f"--resume --out {out}: {out / 'tune' / BUDGETS_FILE} holds another budget for "
            f"{name}; resume with the flags the sweep started with (nothing was changed)"
        )
    return record
