"""``dpfl leaderboard``: plan every cell and its budget, then run the cells in order.

Everything that can be refused is refused before a file is written or a run starts:
the settings (:mod:`tuning.leaderboard.settings`), the config (a public validation set,
a seeded simulation), the data files, each cell's total budget (solved here, or read
back on ``--resume``), and on ``--resume`` every file the leaderboard continues from.
A fresh leaderboard needs a new folder: results are never overwritten. After every cell
the outputs are rewritten from the runs' files (:mod:`tuning.leaderboard.output`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.base.atomic import atomic_write
from engine.config import ConfigError, RunConfig, dotted_leaves
from tuning import budget as budgets
from tuning import selection
from tuning.budget_search import solve_budget
from tuning.leaderboard import draws
from tuning.leaderboard.cells import PERSONAL, RANKED, REFERENCE, Cell, read_record, run_cell
from tuning.leaderboard.settings import SHARED_KEYS, LeaderboardSettings

if TYPE_CHECKING:
    from tuning.leaderboard.parallel import RunPool

RECORD_FILE = "leaderboard.json"
BUDGETS_FILE = "budgets.json"
#: Config keys a resumed leaderboard may change: where its results and Ray are.
MAY_DIFFER = ("out", "ray.address")
#: Settings a resumed leaderboard may extend (never shrink): the cells it holds. A cell's
#: draws, seeds and budget depend on its own method and the shared settings only
#: (:mod:`tuning.leaderboard.draws`), so a method added later is ranked exactly as if it
#: had been listed from the start, against the same baseline runs.
MAY_GROW = ("leaderboard.methods", "leaderboard.personal", "leaderboard.references")


def cells_of(s: LeaderboardSettings) -> list[Cell]:
    """The cells in the order they run: per total ε the baseline, the other ranked
    methods, the personalised ones; then the non-private references."""
    ordered = [s.baseline, *(m for m in s.methods if m != s.baseline)]
    cells = [Cell(m, e, RANKED) for e in s.total_epsilons for m in ordered]
    cells += [Cell(m, e, PERSONAL) for e in s.total_epsilons for m in s.personal]
    return cells + [Cell(m, math.inf, REFERENCE) for m in s.references]


def check_config(config: RunConfig) -> None:
    """What the protocol needs of the config."""
    if config.dataset.validation_size <= 0:
        raise ConfigError(
            "dataset.validation_size: the leaderboard selects trials on a public validation "
            "set held out of every client; set it > 0 (e.g. 10000)"
        )
    if config.privacy.secure_noise:
        raise ConfigError(
            "privacy.secure_noise=true: the leaderboard is a seeded simulation (its files hold "
            "every trial); its epsilons describe a deployment with fresh secret randomness"
        )


def check_resume(out: Path, settings: LeaderboardSettings, config: RunConfig) -> bool:
    """A resumed leaderboard continues the settings and config it started with; it may
    add methods (:data:`MAY_GROW`). Returns whether it adds any."""
    path = out / RECORD_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {out}: no {RECORD_FILE} there (not a dpfl leaderboard)")
    try:
        saved = json.loads(path.read_text())
        before = {
            **dotted_leaves(saved["config"]),
            **dotted_leaves(saved["settings"], "leaderboard."),
        }
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {out}: {path} is damaged ({type(e).__name__})") from None
    now = {**dotted_leaves(config.to_dict()), **dotted_leaves(settings.record(), "leaderboard.")}
    now = json.loads(json.dumps(now, default=str))
    grows = False
    added = {m for k in MAY_GROW for m in now.get(k) or []} - {
        m for k in MAY_GROW for m in before.get(k) or []
    }
    for key in sorted(set(before) | set(now)):
        if key in MAY_DIFFER or before.get(key) == now.get(key):
            continue
        if (
            key not in before
            and key.startswith("leaderboard.space.")
            and (key.split(".")[2] in added)
        ):  # an added method's own range
            continue
        if key in MAY_GROW:
            had, has = list(before.get(key) or []), list(now.get(key) or [])
            missing = [m for m in had if m not in has]
            if not missing:
                grows = True
                continue
            raise ConfigError(
                f"--resume {out}: {key}={has!r} leaves out {', '.join(missing)}, which the "
                f"leaderboard holds ({path}); a resumed leaderboard may add methods, not drop "
                "them"
            )
        raise ConfigError(
            f"--resume {out}: {key}={now.get(key)!r} but the leaderboard started with "
            f"{before.get(key)!r} ({path}); resume with the same settings or none"
        )
    return grows


def read_started(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config tree, settings) a leaderboard started with (``--resume DIR`` alone)."""
    path = out / RECORD_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {out}: no {RECORD_FILE} there (not a dpfl leaderboard)")
    try:
        saved = json.loads(path.read_text())
        return dict(saved["config"]), dict(saved["settings"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {out}: {path} is damaged ({type(e).__name__})") from None


def plan_budgets(
    out: Path, s: LeaderboardSettings, config: RunConfig, resume: bool, echo=print
) -> tuple[dict[str, dict], dict[float, int]]:
    """Each private cell's solved budget record (cell name → record) and the number of
    trials at each total ε; read back from ``budgets.json`` on resume."""
    saved: dict[str, Any] = {}
    if resume and (out / BUDGETS_FILE).is_file():
        saved = json.loads((out / BUDGETS_FILE).read_text())
    shared = s.shared()
    counts = {
        e: draws.number_of_trials(config.seed, e, s.tuning_privacy, s.trials, s.tnb_shape)
        for e in s.total_epsilons
    }
    memo: dict[budgets.Budget, budgets.BudgetSolution] = {}
    records: dict[str, dict] = {}
    for cell in cells_of(s):
        if cell.kind == REFERENCE:
            continue
        if cell.name in saved:
            records[cell.name] = saved[cell.name]
            continue
        own = draws.own_space(cell.method, s.space.get(cell.method) or {}, SHARED_KEYS)
        grid = {"rounds": list(s.rounds)}
        if "algo.bands" in own and own["algo.bands"].get("type") == "choice":
            grid["algo.bands"] = list(own["algo.bands"]["values"])
        configs = tuple(budgets.configurations(config, cell.method, grid))
        draw_of = []
        n = counts[cell.total] if selection.is_papernot_steinke(s.tuning_privacy) else s.trials
        for k in range(n):
            params = draws.trial_params(config.seed, cell.method, k, shared, own, True)
            draw_of.append(budgets.index_of(configs, params))
        compose = s.tuning_privacy == selection.COMPOSE
        try:
            budget = budgets.Budget(
                cell.total,
                s.tuning_privacy,
                float(s.trials),
                s.tnb_shape,
                configs,
                tuple(draw_of) if compose else (),
            )
            if budget not in memo:
                echo(
                    f"{cell.name}: solving the per-trial budget ({len(configs)} configurations) ..."
                )
                memo[budget] = solve_budget(budget)
        except budgets.BudgetError as err:
            raise ConfigError(f"{cell.method}: {err}") from None
        records[cell.name] = memo[budget].record()
    return records, counts


def write_json_file(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True, default=float))


def run_leaderboard(
    settings: LeaderboardSettings,
    config: RunConfig,
    out: Path,
    resume: bool,
    echo=print,
    processes: int | None = None,
) -> dict[str, dict]:
    """Plan, then run every cell (finished ones are read back); returns the cells'
    records and writes the outputs after each cell. ``processes``: runs at once
    (:mod:`tuning.leaderboard.parallel`; None: its default for the config)."""
    from engine.data import check_dataset_files
    from tuning.leaderboard.parallel import RunPool, default_processes

    if processes is None:
        processes = default_processes(config)
    elif processes < 1:
        raise ConfigError(f"--processes={processes}: must be >= 1")
    elif processes > 1 and config.ray.executor != "local":
        raise ConfigError(
            f"--processes={processes} with ray.executor={config.ray.executor}: runs in a "
            "pool of processes train in their own process (ray.executor=local); use "
            "--processes 1"
        )
    check_config(config)
    try:
        check_dataset_files(config.dataset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grows = check_resume(out, settings, config) if resume else False
    if not resume and out.exists() and any(out.iterdir()):
        raise ConfigError(
            f"--out {out}: exists and is not empty; results are never overwritten: choose a "
            f"new folder, or continue it with dpfl leaderboard --resume {out}"
        )
    records, counts = plan_budgets(out, settings, config, resume, echo)
    for cell in cells_of(settings):  # every method's own space resolves before any run
        draws.own_space(cell.method, settings.space.get(cell.method) or {}, SHARED_KEYS)
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_json_file(
            out / RECORD_FILE, {"settings": settings.record(), "config": config.to_dict()}
        )
    elif grows:  # the added cells are the leaderboard's now: a plain --resume keeps them
        started, _ = read_started(out)
        write_json_file(out / RECORD_FILE, {"settings": settings.record(), "config": started})
    write_json_file(out / BUDGETS_FILE, records)
    runner = RunPool(out, config.seed, processes)
    try:
        return _run_cells(settings, config, out, records, counts, runner, echo)
    finally:
        runner.close()


def _run_cells(
    settings: LeaderboardSettings,
    config: RunConfig,
    out: Path,
    records: dict[str, dict],
    counts: dict[float, int],
    runner: RunPool,
    echo,
) -> dict[str, dict]:
    from tuning.leaderboard.output import write_outputs

    shared = settings.shared()
    tuning = (settings.tuning_privacy, float(settings.trials), settings.tnb_shape)
    cells = cells_of(settings)
    done: dict[str, dict] = {}
    for i, cell in enumerate(cells, 1):
        record = read_record(out, cell)
        if record.get("status") in ("done", "no trial"):
            done[cell.name] = record
            continue
        n = counts.get(cell.total, settings.trials)
        echo(f"[{i}/{len(cells)}] {cell.name}: {n} trials, {settings.seeds} seed runs")
        t0 = time.perf_counter()
        own = draws.own_space(cell.method, settings.space.get(cell.method) or {}, SHARED_KEYS)
        done[cell.name] = run_cell(
            out,
            config,
            cell,
            n,
            settings.seeds,
            shared,
            own,
            records.get(cell.name),
            tuning,
            runner,
            echo,
        )
        write_outputs(out, settings, config, cells)
        echo(f"[{i}/{len(cells)}] {cell.name}: done in {time.perf_counter() - t0:.0f} s")
    write_outputs(out, settings, config, cells)
    return done
