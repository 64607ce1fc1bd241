"""``simulate(config)``: validate, resolve privacy, build data, run rounds, write results.

Everything that can be checked is checked in :func:`prepare` before any training:
config values, dataset files, model/data compatibility, and the privacy budget (σ is
calibrated from ε, or ε computed from σ, by dp-accounting with the sampling actually
used). A caller that prepared the run already (``dpfl run``, which validates before
Ray starts) passes its :class:`Prepared` (``prepared=``), and that plan is the one
executed. The ε recorded for each round is the accountant's cumulative ε after that
round; the final ε is the accountant's value for the rounds actually run.

The round loop here computes each round's row; its side effects (checkpoint, metrics,
Parquet row, the caller's ``on_round``, progress) are callbacks, run in the fixed
order of :mod:`engine.simulation.callbacks`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from algorithms.recipes import resolved_hyperparameters
from engine.config import RunConfig
from engine.data import FederatedDataset
from engine.privacy.accounting import MAX_DELTA_TIMES_N
from engine.results import RoundWriter, write_json
from engine.runtime.executors import Executor
from engine.simulation.callbacks import (
    Callback,
    Progress,
    RoundEnd,
    RoundState,
    RunAccess,
    load_callbacks,
    round_callbacks,
)
from engine.simulation.preparation import Prepared, make_executor, prepare, privacy_options
from engine.telemetry import timeline
from engine.telemetry.metrics import RunMetrics, run_label


@dataclass
class SimulationResult:
    """One run's outcome: its config, privacy summary, rows and final weights."""

    config: RunConfig
    privacy: dict[str, Any]
    rounds: pd.DataFrame
    weights: np.ndarray
    out_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_accuracy(self) -> float:
        acc = self.rounds["test_accuracy"].dropna()
        return float(acc.iloc[-1]) if len(acc) else math.nan

    @property
    def final_epsilon(self) -> float:
        return float(self.rounds["epsilon"].iloc[-1])


def once(fn: Callable[[], dict]) -> Callable[[], dict]:
    """``fn`` called at most once (a round's checkpoint, shared by its callbacks)."""
    memo: list[dict] = []

    def call() -> dict:
        if not memo:
            memo.append(fn())
        return memo[0]

    return call


def default_out_dir(config: RunConfig) -> Path:
    """``results/<timestamp>-<algorithm>``: where a run writes when ``out`` is unset."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")  # microseconds: no collisions
    return Path("results") / f"{stamp}-{config.algorithm}"


def static_columns(prep: Prepared) -> dict[str, Any]:
    """The columns every row of the run carries: the run's identity, its privacy
    parameters and its resolved hyperparameters (adaptive clipping and the audit's
    come from :func:`engine.simulation.preparation.privacy_options`)."""
    config, plan = prep.config, prep.plan
    static = {
        "algorithm": config.algorithm,
        "dataset": config.dataset.name,
        "model": config.model.name,
        "eval_source": prep.dataset.meta.get("eval_source", "public"),
        "seed": config.seed,
        "randomness": plan.randomness,
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "clip_norm": plan.clip_norm,
        "sampling": plan.sampling.name,
        "sampling_rate": plan.sampling.effective_rate,
        "adjacency": plan.summary()["adjacency"],
        "accountant": plan.summary()["accountant"],
        "epsilon_budget": plan.target_epsilon if plan.target_epsilon is not None else math.nan,
        **plan.sampling.columns(),  # the participation's own public facts
        "local_steps": prep.steps if prep.steps is not None else math.nan,
        **resolved_hyperparameters(prep.pipeline),
    }
    if prep.adaptive is not None:  # each row carries the C_t its round used
        static.pop("clip_norm")
    return static


def _same_as_released(row: dict[str, Any], released: dict[str, Any]) -> None:
    """A round computed again (a resume from the previous checkpoint) must equal the
    row already released; anything else is a bug, raised before the row is written."""
    from engine.results.run_folder import AGREEING

    for col in AGREEING:
        a, b = row.get(col), released.get(col)
        same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
        if col in released and not same:
            raise RuntimeError(
                f"round {row['round']} computed again differs from its released row "
                f"({col}: {a!r} != {b!r})"
            )


def _prepared_for(config: RunConfig, prepared: Prepared) -> Prepared:
    """``prepared`` as the plan of ``config``, which may differ from the prepared
    config only in ``out`` (a default folder is named when it is claimed)."""
    mine, theirs = config.to_dict(), prepared.config.to_dict()
    mine.pop("out")
    theirs.pop("out")
    if mine != theirs:
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        raise ValueError(f"simulate(prepared=...): prepared for another config (differs in {diff})")
    return dataclasses.replace(prepared, config=config)


def simulate(
    config: RunConfig,
    *,
    progress: bool = False,
    write: bool = True,
    dataset: FederatedDataset | None = None,
    resume: dict | None = None,
    on_round: Callable[[dict, Executor], None] | None = None,
    on_checkpoint: Callable[[dict, dict], None] | None = None,
    run_name: str = "dpfl",
    trial: str = "",
    callbacks: list[Callback] | None = None,
    prepared: Prepared | None = None,
    verbose: bool = False,
) -> SimulationResult:
    """Run one simulation and return its rounds as a DataFrame.

    Called from Python (a script, a notebook) with the Ray executor, it is as quiet as
    ``dpfl run``: Ray's console output (its notices, the core worker's log lines) goes
    to ``ray.log`` in the results folder (dropped when nothing is written), unless
    ``verbose``. Under the CLI, which captures it already, and inside a Ray worker
    (a Tune trial), nothing changes.

    Args:
        config: The run configuration.
        progress: Show a progress bar (round, accuracy, ε spent).
        write: Write ``config.json``, ``rounds.parquet`` and, after every round and
            before its row, ``checkpoint.pkl`` (model, server and per-client state) under
            ``config.out`` (default ``results/<timestamp>-<algorithm>/``); a crashed
            run continues with ``dpfl run --resume DIR`` (:func:`load_run`).
        dataset: Use this dataset instead of building one from ``config.dataset``.
        resume: A checkpoint to continue from (the rounds it holds are not re-run;
            results are identical to an uninterrupted run). A checkpoint written by
            ``simulate`` also holds its round's row, released here if it was not yet.
        on_round: Called after every round with the row and the executor: the
            release of the round (after its checkpoint and its Parquet row; the
            callbacks' order is in :mod:`engine.simulation.callbacks`). Rounds are
            released in order; with the Ray executor's ``ray.overlap_evaluation`` an
            evaluated round's release runs while the next round trains
            (:meth:`engine.runtime.executors.Executor.run_rounds`).
        on_checkpoint: Called after every round, *before* the round is released, with
            the checkpoint (``Executor.checkpoint()`` plus ``"row"``) and the row; a
            caller that persists checkpoints itself (Tune) does it here, so that a
            released round is never recomputed on resume.
        run_name: Prefix of the Ray actor names (unique per concurrent run); also the
            ``run`` tag of the dashboard metrics (:mod:`engine.telemetry.metrics`).
        trial: The ``trial`` tag of the dashboard metrics (Tune's trial id).
        callbacks: Callbacks (:class:`engine.simulation.callbacks.Callback`) run after
            every round with its public :class:`engine.simulation.callbacks.RoundEnd`,
            after those the config's ``callbacks:`` import paths name; each may add
            public columns and stop the run (:mod:`engine.simulation.round_end`).
        prepared: ``prepare(config)``'s result, made (and so checked) beforehand:
            the run executes this plan (its dataset, σ, pipeline) and prepares
            nothing again. Its config must be ``config`` up to ``out``.
        verbose: Leave Ray's console output on the console.
    """
    from engine.runtime.ray_console import console_is_quiet, in_ray_worker, quiet_ray

    if verbose or config.ray.executor != "ray" or console_is_quiet() or in_ray_worker():
        return _simulate(config, progress, write, dataset, resume, on_round, on_checkpoint,
                         run_name, trial, callbacks, prepared)  # fmt: skip
    with quiet_ray(None, verbose=False, defer=True) as log:
        result = _simulate(config, progress, write, dataset, resume, on_round, on_checkpoint,
                           run_name, trial, callbacks, prepared)  # fmt: skip
        log.out = result.out_dir
    return result


def _simulate(
    config: RunConfig,
    progress: bool,
    write: bool,
    dataset: FederatedDataset | None,
    resume: dict | None,
    on_round: Callable[[dict, Executor], None] | None,
    on_checkpoint: Callable[[dict, dict], None] | None,
    run_name: str,
    trial: str,
    callbacks: list[Callback] | None,
    prepared: Prepared | None,
) -> SimulationResult:
    user = [*load_callbacks(config.callbacks), *(callbacks or [])]  # before any work
    prep = prepare(config, dataset) if prepared is None else _prepared_for(config, prepared)
    plan = prep.plan
    out_dir = Path(config.out) if config.out else default_out_dir(config)
    writer = RoundWriter(out_dir) if write else None
    if write:
        write_json(out_dir / "config.json", {"config": config.to_dict(), "privacy": plan.summary()})
    if plan.private and plan.delta * config.dataset.num_clients > MAX_DELTA_TIMES_N:
        warnings.warn(
            f"privacy.delta={plan.delta:.3g} with dataset.num_clients="
            f"{config.dataset.num_clients}: N·delta = {plan.delta * config.dataset.num_clients:.3g}"
            f" > {MAX_DELTA_TIMES_N}; the guarantee may fail for that many clients in "
            "expectation (the default delta keeps N·delta <= 0.01)",
            stacklevel=2,
        )
    caution = plan.sampling.caution(plan.planned_epsilon) if plan.private else None
    if caution:
        warnings.warn(caution, stacklevel=2)
    static = static_columns(prep)
    privacy_extra = privacy_options(prep)
    static.update(privacy_extra)
    rows: list[dict[str, Any]] = []
    ahead: dict[int, dict[str, Any]] = {}
    done = int(resume["server"]["rounds_done"]) if resume is not None else 0
    if resume is not None and writer is not None and writer.path.exists():
        # The checkpoint is written before its round's row, so every row on disk is at
        # or before the checkpoint: no released round is ever computed again.
        previous = pd.read_parquet(writer.path)
        rows = previous[previous["round"] <= done].to_dict("records")
        writer.rows = [dict(r) for r in rows]
        # From the previous checkpoint (the last one damaged), a released round is
        # computed again: a seeded run must give its released row back exactly.
        ahead = {int(r["round"]): r for r in previous[previous["round"] > done].to_dict("records")}
    # A crash between a checkpoint and its row leaves that row unreleased: release the
    # copy the checkpoint holds (the same values; the round is not recomputed).
    pending = (resume or {}).get("row")
    if pending is not None and int(pending["round"]) != done:
        pending = None
    state_dir = None
    if config.algo.client_state == "disk":
        state_dir = str((out_dir if write else Path(tempfile.mkdtemp())) / "client_state")
    if run_name == "dpfl" and write:  # dpfl run: actors and metrics name the folder
        run_name = run_label(out_dir)
    executor = make_executor(prep, run_name=run_name, state_dir=state_dir)
    start = done if resume is not None else 0
    # after the executor: Ray's start-up lines do not land on the bar's line
    bar = Progress(config.rounds, config.algorithm, start) if progress else None
    state = RoundState(executor, started=time.perf_counter())
    access = RunAccess({}, state)
    everyone = round_callbacks(
        metrics=RunMetrics(run_name, trial, config.algorithm),
        writer=writer,
        out_dir=out_dir if write else None,
        on_checkpoint=on_checkpoint,
        on_round=on_round,
        progress=bar,
        access=access,
        user=user,
    )
    stops: list[str] = []
    released: list[Callable[[], dict]] = []  # the last released round's checkpoint

    def hand_over(row: dict, round_state: RoundState, checkpoint: Callable[[], dict]) -> bool:
        """Run every callback on ``row``; True when one asked to stop the run."""
        access.row, access.state = row, round_state
        end = RoundEnd(
            row,
            lambda: checkpoint()["server"]["weights"],
            config.rounds,
            round_state.replayed,
            row.update,
            stops.append,
        )
        for callback in everyone:
            callback.on_round_end(end)
        released[:] = [checkpoint]
        return bool(stops)

    t0 = time.perf_counter()
    timeline.mark("rounds start")
    if resume is not None:
        executor.restore(resume)
    try:
        if pending is not None:
            replayed = dict(pending)
            replay = RoundState(executor, replayed=True)
            hand_over(replayed, replay, once(executor.checkpoint))
            if not any(int(r["round"]) == done for r in rows):
                rows.append(replayed)

        def release(row: dict, checkpoint: Callable[[], dict]) -> bool:
            """A finished round, in round order (``Executor.run_rounds``): with the Ray
            executor possibly while the next round trains. True: a callback stopped
            the run."""
            timeline.mark(f"round {row['round']}")
            row.update(static)
            row["wall_time_s_nonprivate"] = time.perf_counter() - t0
            if int(row["round"]) in ahead:
                _same_as_released(row, ahead[int(row["round"])])
            if not math.isnan(row["test_accuracy"]):
                state.last_accuracy = row["test_accuracy"]
            rows.append(row)
            state.checkpoint = once(checkpoint)
            stop = hand_over(row, state, state.checkpoint)
            state.started = time.perf_counter()
            return stop

        if not (pending is not None and stops):
            state.started = time.perf_counter()
            executor.run_rounds(start, config.rounds, release)
        # stopped: the last released round's model (the executor may hold a later one)
        weights = released[-1]()["server"]["weights"] if stops else executor.weights()
    finally:
        timeline.mark("closing")
        executor.close()
        timeline.mark("executor closed")
        for callback in everyone:
            callback.on_end()
    frame = pd.DataFrame(rows)
    summary = {**plan.summary(), **privacy_extra}
    summary["final_epsilon"] = (
        float(frame["epsilon"].iloc[-1]) if len(frame) else plan.planned_epsilon
    )
    if stops:  # a callback stopped the run: the rounds released are the run
        summary.update(stopped_after_round=int(frame["round"].iloc[-1]), stop_reason=stops[0])
    if write:
        write_json(out_dir / "config.json", {"config": config.to_dict(), "privacy": summary})
    timeline.mark("results written")
    return SimulationResult(config, summary, frame, weights, out_dir if write else None)
