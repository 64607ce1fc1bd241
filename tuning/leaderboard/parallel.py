"""Where a leaderboard's runs execute: one after another in this process, or several at
once in a pool of processes (``dpfl leaderboard --processes N``; by default one per
CPU when a run trains in its own process on one thread, ``ray.executor=local``).

A cell's trials are independent: their draws, seeds and σ are fixed before any of them
runs (:mod:`tuning.leaderboard.draws`), so they may run in any order and at once, and
likewise the selected configuration's seed runs. Each run writes only its own folder
(:mod:`tuning.leaderboard.runs`) and the cell reads their rows back once they have all
finished; so a run's rows are the same bit for bit in a pool as in this process
(tested), and a leaderboard stopped while several runs were under way continues each
of them from its own checkpoint.

The pool is started once per leaderboard, forked from this process after it has built
the leaderboard's data set (the processes share its pages) where forking is safe, else
from a fork server (:mod:`engine.runtime.forking`); each process keeps the data sets it
built from one run to the next (:func:`data_of`). Nothing here reads a result to
decide what runs: the selection happens in :mod:`tuning.leaderboard.cells` after every
trial has ended, as before. A pool takes the longest runs first (:func:`longest_first`),
which changes only when each run ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from engine.config import RunConfig
from tuning import run_order
from tuning.leaderboard.runs import PlannedRun, ValidationEval, execute

#: per process: the data sets built so far (the experiment seed's clients and validation
#: set), by resolved ``dataset`` section
_DATA: dict[str, tuple[Any, ValidationEval]] = {}


def data_of(run_config: RunConfig, data_seed: int) -> tuple[Any, ValidationEval]:
    """The one data set (the experiment seed's clients and validation set), built once
    per resolved ``dataset`` section and process: a personalised recipe's resolves a
    held-out split of each client's data (the same clients and partition; the split is
    drawn after it)."""
    from engine.data import build_dataset
    from engine.privacy import rng as rngs

    key = json.dumps([data_seed, run_config.dataset.__dict__], sort_keys=True, default=str)
    if key not in _DATA:
        ds = build_dataset(run_config.dataset, rngs.numpy_rng(data_seed, rngs.DATA))
        _DATA[key] = (ds, ValidationEval(run_config, ds))
    return _DATA[key]


def default_processes(config: RunConfig) -> int:
    """One process per CPU share of a run when each run trains in its own process
    (``ray.executor=local``); else 1 (a run of the Ray or process executor starts
    workers of its own)."""
    from tuning import trial_pool

    if config.ray.executor != "local":
        return 1
    return trial_pool.default_processes(config.ray.num_cpus_per_worker)


def run_cost(run: PlannedRun) -> float:
    """A run's work, roughly: its rounds times its local passes (or steps) a round."""
    local = run.config.local
    return run_order.work(run.config.rounds, local.epochs, local.steps)


def longest_first(runs: list[PlannedRun]) -> list[PlannedRun]:
    """``runs`` in the order a pool should take them: the costliest first
    (:func:`tuning.run_order.longest_first`)."""
    return run_order.longest_first(runs, run_cost)


def _execute(out: str, run: PlannedRun, data_seed: int) -> str:
    """In a pool process: run (or continue) ``run`` to its last round."""
    dataset, evaluator = data_of(run.config, data_seed)
    execute(Path(out), run, dataset, evaluator)
    return run.run_id


class RunPool:
    """Runs a leaderboard's runs, ``processes`` at a time (module docstring)."""

    def __init__(self, out: Path, data_seed: int, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"--processes={processes}: must be >= 1")
        self.out, self.data_seed, self.processes = Path(out), int(data_seed), int(processes)
        self._pool: Any = None
        # One leaderboard's data sets at a time: none built for an earlier one in this
        # process (its files or its reader may have changed since) is used again.
        _DATA.clear()

    def run(self, runs: list[PlannedRun], on_done: Callable[[PlannedRun], None]) -> None:
        """Run every run of ``runs`` to its last round; ``on_done(run)`` in this process
        as each ends. The first error stops the others (their checkpoints stay) and is
        raised here."""
        if self.processes == 1 or len(runs) <= 1:
            for run in runs:
                execute(self.out, run, *data_of(run.config, self.data_seed))
                on_done(run)
            return
        pool = self._start(runs[0])
        pending: dict[Future, PlannedRun] = {
            pool.submit(_execute, str(self.out), run, self.data_seed): run
            for run in longest_first(runs)
        }
        try:
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()
                    on_done(pending.pop(future))
        except BaseException:
            self.close(now=True)
            raise

    def _start(self, first: PlannedRun) -> Any:
        from tuning.trial_pool import new_pool

        if self._pool is None:
            data_of(first.config, self.data_seed)  # built before the fork: shared pages
            threads = max(1, int(first.config.ray.num_cpus_per_worker))
            self._pool = new_pool(self.processes, threads)
        return self._pool

    def close(self, now: bool = False) -> None:
        """End the pool's processes (``now``: without waiting for their runs)."""
        from tuning.trial_pool import stop_pool

        if self._pool is not None:
            if now:
                stop_pool(self._pool)
            else:
                self._pool.shutdown(wait=True)
            self._pool = None
