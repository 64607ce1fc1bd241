"""The process runner (``tune.runner: processes``): a sweep's trials in parallel, in a
pool of local processes started once per sweep, without Ray Tune and without Ray.

Each process runs trials one after another, each the same
:func:`tuning.trial.trial_body` a Tune trial runs, with the in-process executor
(``ray.executor=local``: a trial's client workers are objects in its process, whose
models equal the Ray executor's bit for bit). So a sweep of small trials on one
machine pays its fixed costs once per process, not once per trial: the processes are
forked from ``dpfl tune``'s own process, which has imported torch and dpfl, or from a
fork server that has (:mod:`tuning.pool_server`), and each process keeps the
experiment's data set
(:func:`tuning.trial.experiment_dataset`), σ's calibration and the lazily imported
modules from one trial to the next. Trials of all cells are queued at once, the
longest first (:mod:`tuning.run_order`: when rounds are searched, no long trial starts
last while the other processes idle); a cell's rows are compacted as soon as its last
trial ends.

Trial ids, rows, checkpoints, statuses and resume are the driver runner's
(:mod:`tuning.driver`): trial k of a cell is the same trial under both, with the same
rows. A failed trial is run once more (Tune's ``FailureConfig(max_failures=1)``); a
full disk or a read-only or forbidden folder stops the sweep, as in the driver runner.
A process that dies (killed, out of memory) fails its trial, which is retried in a
new pool.

How many processes: :func:`default_processes`, one per ``max(1, ray.num_cpus_per_worker)``
CPUs of this machine (a trial trains on that many threads), at most one per trial.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuning import run_order
from tuning.driver import (
    STOPPING_ERRNOS,
    cell_trial_ids,
    report_failure,
    start_cell,
    trial_finished,
)
from tuning.plan import experiment_name
from tuning.pool_server import pin_threads, pool_context
from tuning.rounds import compact_cell, rounds_dir


@dataclass(frozen=True)
class Cell:
    """One (algorithm, ε) cell of the sweep and what its trials are built from."""

    algorithm: str
    epsilon: float
    n_trials: int
    base: dict[str, Any]  # the experiment's resolved config (``RunConfig.to_dict``)
    columns: dict[str, str]
    space: dict[str, Any] | None
    # A total budget (:mod:`tuning.budget`): (grid-key values, σ) of each configuration;
    # the trial runs at the σ solved for its draw, not at ``epsilon`` (the total).
    noise: list[tuple[dict[str, Any], float]] | None = None


@dataclass(frozen=True)
class TrialTask:
    """What a pool process needs to run trial ``index`` of ``cell``."""

    out: str
    cell: Cell
    index: int
    trial_id: str


def machine_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_processes(
    num_cpus_per_worker: float, n_trials: int | None = None, cpus: int | None = None
) -> int:
    """Processes for ``n_trials`` trials (or runs, the leaderboard's): one per
    ``max(1, num_cpus_per_worker)`` CPUs (a trial trains on
    ``max(1, int(num_cpus_per_worker))`` threads), at least one, at most ``n_trials``
    (no cap when None)."""
    cpus = machine_cpus() if cpus is None else cpus
    per_trial = max(1.0, float(num_cpus_per_worker))
    fit = math.floor(cpus / per_trial)
    return max(1, fit if n_trials is None else min(int(n_trials), fit))


_BODIES: dict[tuple[str, str, float], Any] = {}  # per pool process: one body per cell


def trial_cost(task: TrialTask) -> float:
    """A trial's work, roughly (:func:`tuning.run_order.work`): its drawn rounds and
    local passes, else the experiment's. The draw is the one the trial will make
    (:func:`tuning.trial.sampled_params`, a function of the seed, cell and index)."""
    from tuning.trial import sampled_params

    cell, base = task.cell, task.cell.base
    hps: dict[str, Any] = {}
    if cell.space is not None:
        seed = int(base["seed"])
        hps = sampled_params(cell.space, seed, cell.algorithm, cell.epsilon, task.index)
    local = base["local"]
    return run_order.work(
        hps.get("rounds", base["rounds"]),
        hps.get("local.epochs", local["epochs"]),
        hps.get("local.steps", local["steps"]),
    )


def run_trial(task: TrialTask) -> tuple[str, str, OSError | None]:
    """In a pool process: run (or continue) one trial. Returns ``(status, why,
    stopping error)``: ``TERMINATED``; ``ERROR`` with the error's one-line text; or
    ``STOP`` with the OSError that stops the sweep (its errno, text and file)."""
    from tuning.trial import trial_body

    cell = task.cell
    key = (task.out, cell.algorithm, cell.epsilon)
    if key not in _BODIES:
        _BODIES[key] = trial_body(
            cell.base,
            cell.algorithm,
            cell.epsilon,
            task.out,
            cell.columns,
            cell.space,
            cell.noise,
        )
    name = experiment_name(cell.algorithm, cell.epsilon)
    try:
        _BODIES[key]({"sample": task.index}, task.trial_id, f"{name}-{task.trial_id}", _no_report)
    except Exception as err:  # noqa: BLE001 - reported like a Tune trial error
        why = f"{type(err).__name__}: {err}"
        if isinstance(err, OSError) and err.errno in STOPPING_ERRNOS:
            return "STOP", why, OSError(err.errno, err.strerror, err.filename)
        return "ERROR", why, None
    return "TERMINATED", "", None


def _no_report(metrics: dict[str, Any]) -> None:
    """The process runner has no scheduler to report to."""


def _warm() -> int:
    """A no-op task: makes the pool fork its processes now."""
    return os.getpid()


def new_pool(
    processes: int, threads: int = 1, start_method: str | None = None
) -> ProcessPoolExecutor:
    """``processes`` trial processes of ``threads`` torch threads each, forked from this
    process or from a fork server (:func:`tuning.pool_server.pool_context`), started
    now."""
    pool = ProcessPoolExecutor(
        max_workers=processes,
        mp_context=pool_context(threads, start_method),
        initializer=pin_threads,
        initargs=(threads,),
    )
    for _ in range(processes):
        pool.submit(_warm)
    return pool


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """End the pool's processes now (the sweep stops: an interrupt, a full disk); what
    their trials wrote stays, and ``--resume`` continues from their checkpoints."""
    for process in list(getattr(pool, "_processes", {}).values()):
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def run_cells_in_processes(
    out: Path,
    cells: list[Cell],
    rounds: int,
    resume: bool,
    processes: int,
    start_method: str | None = None,
    errors: dict[str, str] | None = None,
) -> dict[str, str]:
    """Every trial of ``cells`` in a pool of ``processes`` processes; the statuses by
    trial id (``TERMINATED``, or ``ERROR`` after one retry). Each cell's rows are
    compacted once its trials have ended; prints one line per cell. ``errors``, if
    given, receives each failed trial's last error (``Type: message``)."""
    todo: list[TrialTask] = []
    left: dict[int, int] = {}  # cell position -> trials not yet ended
    statuses: dict[str, str] = {}
    for c, cell in enumerate(cells):
        ids = cell_trial_ids(cell.algorithm, cell.epsilon, cell.n_trials)
        start_cell(out, cell.algorithm, cell.epsilon, ids, resume)
        folder = rounds_dir(out, cell.algorithm, cell.epsilon)
        for k, trial_id in enumerate(ids):
            if trial_finished(folder, trial_id, rounds):
                statuses[trial_id] = "TERMINATED"
            else:
                todo.append(TrialTask(str(out), cell, k, trial_id))
        left[c] = sum(1 for t in todo if t.cell is cell)
    t0 = time.perf_counter()
    position = {id(cell): c for c, cell in enumerate(cells)}

    def cell_ended(c: int) -> None:
        cell = cells[c]
        compact_cell(out, cell.algorithm, cell.epsilon)
        print(
            f"{experiment_name(cell.algorithm, cell.epsilon)}: {cell.n_trials} trials in "
            f"{time.perf_counter() - t0:.1f} s ({processes} processes)",
            flush=True,
        )

    for c, n in left.items():
        if n == 0:
            cell_ended(c)
    attempts: dict[str, int] = {}
    while todo:
        threads = max(1, int(cells[0].base["ray"]["num_cpus_per_worker"])) if cells else 1
        pool = new_pool(max(1, min(processes, len(todo))), threads, start_method)
        running: dict[Future, TrialTask] = {
            pool.submit(run_trial, t): t for t in run_order.longest_first(todo, trial_cost)
        }
        todo = []
        try:
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    task = running.pop(future)
                    try:
                        status, why, stop = future.result()
                    except BrokenProcessPool as err:  # a process died: retry in a new pool
                        status, why, stop = "ERROR", f"its process died ({err})", None
                    except Exception as err:  # noqa: BLE001 - e.g. a result that cannot travel
                        status, why, stop = "ERROR", f"{type(err).__name__}: {err}", None
                    if stop is not None:
                        raise stop
                    name = experiment_name(task.cell.algorithm, task.cell.epsilon)
                    attempt = attempts.get(task.trial_id, 0)
                    if status == "ERROR":
                        report_failure(name, task.trial_id, attempt, why)
                        if errors is not None:
                            errors[task.trial_id] = why
                        attempts[task.trial_id] = attempt + 1
                        if attempt == 0:  # once more, as Tune's max_failures=1
                            if isinstance(future.exception(), BrokenProcessPool):
                                todo.append(task)
                            else:
                                running[pool.submit(run_trial, task)] = task
                            continue
                    statuses[task.trial_id] = status
                    c = position[id(task.cell)]
                    left[c] -= 1
                    if left[c] == 0:
                        cell_ended(c)
        except BaseException:
            stop_pool(pool)
            raise
        pool.shutdown(wait=True)
        if todo:
            print(f"restarting the trial processes for {len(todo)} trial(s)", file=sys.stderr)
    return statuses
