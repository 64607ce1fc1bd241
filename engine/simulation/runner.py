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
from engine.simulation.callbacks import Progress, RoundState, round_callbacks
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
        **(
            {"rounds_per_epoch": plan.sampling.rounds_per_epoch}
            if plan.sampling.mode == "epochs"
            else {}
        ),
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
    prepared: Prepared | None = None,
) -> SimulationResult:
    """Run one simulation and return its rounds as a DataFrame.

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
        prepared: ``prepare(config)``'s result, made (and so checked) beforehand:
            the run executes this plan (its dataset, σ, pipeline) and prepares
            nothing again. Its config must be ``config`` up to ``out``.
    """
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
    if plan.private and plan.sampling.mode == "fixed":
        warnings.warn(
            "sampling.mode=fixed is accounted under replace-one adjacency with sensitivity 2C; "
            f"its epsilon ({plan.planned_epsilon:.3g}) is far looser than Poisson sampling's",
            stacklevel=2,
        )
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
    callbacks = round_callbacks(
        metrics=RunMetrics(run_name, trial, config.algorithm),
        writer=writer,
        out_dir=out_dir if write else None,
        on_checkpoint=on_checkpoint,
        on_round=on_round,
        progress=bar,
    )
    t0 = time.perf_counter()
    timeline.mark("rounds start")
    if resume is not None:
        executor.restore(resume)
    try:
        if pending is not None:
            if not any(int(r["round"]) == done for r in rows):
                rows.append(dict(pending))
            replay = RoundState(executor, replayed=True)
            for callback in callbacks:
                callback.on_round(dict(pending), replay)
        state = RoundState(executor, started=time.perf_counter())

        def release(row: dict, checkpoint: Callable[[], dict]) -> None:
            """A finished round, in round order (``Executor.run_rounds``): with the Ray
            executor possibly while the next round trains."""
            timeline.mark(f"round {row['round']}")
            row.update(static)
            row["wall_time_s_nonprivate"] = time.perf_counter() - t0
            if int(row["round"]) in ahead:
                _same_as_released(row, ahead[int(row["round"])])
            if not math.isnan(row["test_accuracy"]):
                state.last_accuracy = row["test_accuracy"]
            rows.append(row)
            state.checkpoint = checkpoint
            for callback in callbacks:
                callback.on_round(row, state)
            state.started = time.perf_counter()

        executor.run_rounds(start, config.rounds, release)
        weights = executor.weights()
    finally:
        timeline.mark("closing")
        executor.close()
        timeline.mark("executor closed")
        for callback in callbacks:
            callback.on_end()
    frame = pd.DataFrame(rows)
    summary = {**plan.summary(), **privacy_extra}
    summary["final_epsilon"] = (
        float(frame["epsilon"].iloc[-1]) if len(frame) else plan.planned_epsilon
    )
    if write:
        write_json(out_dir / "config.json", {"config": config.to_dict(), "privacy": summary})
    timeline.mark("results written")
    return SimulationResult(config, summary, frame, weights, out_dir if write else None)
