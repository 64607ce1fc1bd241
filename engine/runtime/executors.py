"""Executors: one round function, two worker pools (in process or Ray actors).

A round is written once, in :func:`play_round`: the server samples the cohort, the
cohort is split into ``num_workers`` shards (:func:`engine.federated.client.shard_cohort`, the
same split everywhere), each shard is trained into one partial sum, the server reduces
the partials in shard order, privatises and accounts, and on evaluation rounds the
test set (and, for personal heads, each client's held-out split) is evaluated in
slices spread over the workers. Where that runs is a *worker pool*
(:class:`WorkerPool`): :class:`engine.runtime.local_pool.InProcessPool` calls one
server and one client worker in this process;
:class:`engine.runtime.ray_pool.RayWorkerPool` holds the Ray actors and everything
specific to Ray — object references instead of values, actor start-up, and fault tolerance
(re-running a lost shard, restoring a round checkpoint). Hence for the same seed and
``num_workers`` the two give bit-identical models (tested). Client randomness is
keyed by (seed, round, client), so it does not depend on which worker trains a client.

Ray layout: one persistent :class:`ClientWorker` actor per worker, each declared with
``num_cpus`` / ``num_gpus`` (fractional GPUs allowed) and holding the dataset once —
``ray.put`` places it in the object store and numpy arrays are read zero-copy; on one
machine a generated population's arrays, already in shared memory, go by reference
(:mod:`engine.data.shared`) instead of being copied into the store — and
one :class:`Server` that owns the global model, the noise streams and the accountant:
an actor, or (``ray.server``, :func:`engine.runtime.driver_server.server_in_driver`)
the driver process behind an actor's interface
(:class:`engine.runtime.driver_server.DriverServer`). Per round the driver moves only object
references: the global weights go from the server to the workers and the partial
sums from the workers to the server, through the driver only where the server lives.

This module holds what both pools share: :class:`RoundPlan`, the :class:`WorkerPool`
interface, :func:`play_round` and :class:`Executor`; :func:`ensure_ray`, the one
place dpfl starts or attaches to Ray (also for ``dpfl compare`` and ``dpfl tune``), lives
in :mod:`engine.runtime.ray_start` (no torch import, so ``dpfl run`` can begin it
before importing the engine) and is re-exported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from engine.data.federated import FederatedDataset
from engine.federated.client import LocalSpec, client_costs, shard_cohort
from engine.federated.evaluation import combine_sums, eval_slices
from engine.federated.server import ServerSpec, is_eval_round
from engine.runtime import interrupt
from engine.runtime.ray_start import ensure_ray  # noqa: F401 - the callers import it from here
from engine.runtime.switches import QUIET_ENV  # noqa: F401 - tests read it from here
from engine.telemetry import timeline


class WorkerLostError(RuntimeError):
    """Actors kept dying: the run stops; the rounds released so far are intact."""


_INTACT = re.compile(r"The (\d+) completed rounds are intact\.")


def with_released(error: WorkerLostError, released: int) -> WorkerLostError:
    """``error`` stating ``released`` intact rounds: when round t+1 dies while round t's
    evaluation was held (``ray.overlap_evaluation``), round t is not released either
    (neither its row nor its checkpoint) and a resume computes it again."""
    text = _INTACT.sub(
        f"The {released} completed rounds are intact; round {released + 1} is computed "
        "again on resume.",
        str(error),
    )
    return WorkerLostError(text)


_Played = TypeVar("_Played")
#: ``release(row, checkpoint)``: :meth:`Executor.run_rounds` hands over a finished row;
#: a true return value stops the run after that row
Release = Callable[[dict, Callable[[], dict]], "bool | None"]


@dataclass(frozen=True)
class RoundPlan:
    """What every round needs besides the pool's state: public, fixed for the run."""

    num_shards: int
    costs: np.ndarray | None  # per-client work for balanced shards; None: sticky shards
    test_slices: list[tuple[int, int]]  # the global test set, one slice per worker
    eval_every: int
    rounds: int
    #: per worker, the clients whose personal heads it evaluates (None: no heads)
    personal_clients: list[np.ndarray] | None


def round_plan(
    dataset: FederatedDataset, server_spec: ServerSpec, local_spec: LocalSpec, num_shards: int
) -> RoundPlan:
    personal = local_spec.pipeline.personal is not None
    everyone = np.arange(dataset.num_clients)
    return RoundPlan(
        num_shards=num_shards,
        costs=client_costs(dataset, local_spec),
        test_slices=eval_slices(len(dataset.y_test), num_shards),
        eval_every=server_spec.eval_every,
        rounds=server_spec.rounds,
        personal_clients=[everyone[i::num_shards] for i in range(num_shards)] if personal else None,
    )


class WorkerPool(Protocol):
    """Where the server and the client workers run; what :func:`play_round` calls.

    ``weights``, ``public`` and partial sums are opaque handles (values in process,
    object references on Ray); the cohort, the round's row and evaluation sums are
    values, as the driver needs them.
    """

    retries: int  # actor losses survived so far (0 in process)
    timer: Any  # engine.telemetry.phases: OFF unless a benchmark installed a PhaseTimer

    def set_timer(self, timer: Any) -> None: ...

    def begin_round(self, rnd: int) -> tuple[np.ndarray, Any, Any]: ...

    def train(
        self,
        rnd: int,
        shards: list[np.ndarray],
        weights: Any,
        public: Any,
        while_training: Callable[[], None] | None = None,
    ) -> list: ...

    def finish_round(self, rnd: int, partials: list) -> dict: ...

    def current_weights(self) -> Any: ...

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list: ...

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]: ...

    #: whether :meth:`evaluate_behind` runs beside the next round's training
    overlaps_evaluation: bool

    def evaluate_behind(self, weights: Any, slices: list[tuple[int, int]]) -> list: ...

    def evaluation_sums(
        self, rnd: int, refs: list, weights: Any, slices: list[tuple[int, int]], recover: bool
    ) -> list | None: ...

    def attempt(self, rnd: int, play: Callable[[], _Played]) -> _Played: ...

    def weights(self) -> np.ndarray: ...

    def checkpoint_handle(self) -> Any: ...

    def checkpoint(self, handle: Any = None) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def close(self) -> None: ...


@dataclass
class EvaluationBehind:
    """Round ``rnd``'s evaluation, running beside the next round's training: the
    weights evaluated and the pool's handles to the per-slice sums."""

    rnd: int
    weights: Any
    refs: list


def play_round(
    pool: WorkerPool,
    rnd: int,
    plan: RoundPlan,
    *,
    while_training: Callable[[], None] | None = None,
    evaluate_behind: bool = False,
) -> tuple[dict, EvaluationBehind | None]:
    """One round on ``pool`` — the only place a round's steps are written.

    The cohort is sampled by the server, split into shards (public: which worker
    trains a client and the float64 summation order, never who takes part), trained,
    reduced, privatised and accounted by the server; then evaluated on evaluation
    rounds. Returns the round's row, and None; or, with ``evaluate_behind`` (a pool
    that ``overlaps_evaluation``; never for personal heads, whose evaluation reads
    client state), the row without its test metrics and the evaluation under way
    (:meth:`Executor.run_rounds` completes the row). ``while_training`` is
    called once the shards are dispatched, while they train.
    """
    timer = pool.timer
    with timer.phase("begin_round"):
        cohort, weights, public = pool.begin_round(rnd)
    with timer.phase("shard_split"):
        shards = shard_cohort(cohort, plan.num_shards, plan.costs)
    partials = pool.train(rnd, shards, weights, public, while_training)
    del weights, public
    with timer.phase("finish_round"):
        row = pool.finish_round(rnd, partials)
    evaluate = is_eval_round(rnd, plan.eval_every, plan.rounds)
    if evaluate and evaluate_behind and plan.personal_clients is None:
        with timer.phase("evaluation_dispatch"):
            weights = pool.current_weights()
            refs = pool.evaluate_behind(weights, plan.test_slices)
            return row, EvaluationBehind(rnd, weights, refs)
    if evaluate:
        with timer.phase("evaluation"):
            timeline.mark("eval start")
            weights = pool.current_weights()
            sums = pool.evaluate(weights, plan.test_slices)
            row["test_accuracy"], row["test_loss"] = combine_sums(sums)
            timeline.mark("eval end")
    if plan.personal_clients is not None:
        row["personal_accuracy_nonprivate"] = float("nan")
        if evaluate:
            results = pool.personal_eval(weights, plan.personal_clients)
            correct = sum(c for c, _ in results)
            total = sum(t for _, t in results)
            row["personal_accuracy_nonprivate"] = correct / total if total else float("nan")
    return row, None


class Executor:
    """Runs rounds of one simulation on a worker pool (see the module docstring)."""

    def __init__(self, pool: WorkerPool, plan: RoundPlan) -> None:
        self.pool, self.plan = pool, plan

    def set_timer(self, timer: Any) -> None:
        """Time the phases of every following round with ``timer`` (an
        :class:`engine.telemetry.phases.PhaseTimer`; ``engine.telemetry.phases.OFF`` stops):
        the driver's
        steps, the server's and, in process, the workers' (Ray workers keep their own:
        :meth:`RayWorkerPool.take_worker_phase_times`). Changes no computation."""
        self.pool.set_timer(timer)

    def run_round(self, rnd: int) -> dict:
        """Play round ``rnd`` and return its row, evaluation included."""
        row, _ = self.pool.attempt(rnd, lambda: play_round(self.pool, rnd, self.plan))
        row["actor_retries_nonprivate"] = self.pool.retries
        return row

    def run_rounds(self, start: int, stop: int, release: Release) -> None:
        """Play rounds ``start .. stop - 1`` and hand each round's row, in round order,
        to ``release(row, checkpoint)``, where ``checkpoint()`` returns the state after
        that round (:meth:`checkpoint`), also when called later.

        A pool that ``overlaps_evaluation`` (the Ray pool) evaluates round t in its
        workers' second thread while round t+1 trains: round t's row is held, its
        checkpoint taken as references before round t+1 begins, and once round t+1's
        shards are dispatched the evaluation's sums are awaited and the row released —
        so ``release`` (the checkpoint file, the Parquet row, Tune's report) also runs
        beside round t+1's training. The values are those of :meth:`run_round`, bit for
        bit: the evaluation reads round t's weights and the public test set, on a copy
        of the model, in the same slices and order. The last round is evaluated before
        it returns. Other pools play :meth:`run_round` round by round.

        A failure stops the run with round t's row unreleased: its checkpoint is not
        written either, so a resume computes round t again, with the same values.

        ``release`` returning true (a callback stopped the run) ends it after that row:
        no later row is released. Beside training, the round under way is finished and
        not released (the pool then holds a model no row describes).
        """
        pool = self.pool
        if not pool.overlaps_evaluation:
            for rnd in range(start, stop):
                interrupt.check()  # a Ctrl-C whose own raise was dropped
                row = self.run_round(rnd)
                if release(row, pool.checkpoint):
                    return
            return
        held: tuple[dict, EvaluationBehind, Any] | None = None  # a row, its sums, its state
        stopped = False

        def checkpoint_of(handle: Any) -> Callable[[], dict]:
            return lambda: pool.checkpoint(handle)

        def release_held(recover: bool) -> None:
            """Complete and release the held row, if its sums are in (``recover``:
            evaluate again what a lost worker did not finish)."""
            nonlocal held, stopped
            if held is None:
                return
            row, behind, handle = held
            with pool.timer.phase("evaluation_wait"):
                sums = pool.evaluation_sums(
                    behind.rnd, behind.refs, behind.weights, self.plan.test_slices, recover
                )
            if sums is None:  # a worker was lost: the round's own recovery runs first
                return
            held = None
            row["test_accuracy"], row["test_loss"] = combine_sums(sums)
            stopped = bool(release(row, checkpoint_of(handle)))

        def beside_training() -> None:
            release_held(recover=False)

        for rnd in range(start, stop):
            interrupt.check()  # a Ctrl-C whose own raise was dropped

            def play(rnd: int = rnd) -> tuple[dict, EvaluationBehind | None]:
                return play_round(
                    pool,
                    rnd,
                    self.plan,
                    while_training=beside_training,
                    evaluate_behind=rnd + 1 < stop,
                )

            try:
                row, behind = pool.attempt(rnd, play)
            except WorkerLostError as lost:
                if held is None:
                    raise
                # Round rnd - 1's evaluation died with the worker: it stays unreleased.
                raise with_released(lost, rnd - 1) from lost
            row["actor_retries_nonprivate"] = pool.retries
            release_held(recover=True)  # when a lost worker kept it from the round
            if stopped:  # the previous row stopped the run: this one is not released
                return
            handle = pool.checkpoint_handle()
            if behind is None:
                if release(row, checkpoint_of(handle)):
                    return
            else:
                held = (row, behind, handle)
        release_held(recover=True)

    def weights(self) -> np.ndarray:
        return self.pool.weights()

    def checkpoint(self) -> dict:
        """Server state plus per-client state, enough to resume bit-identically."""
        return self.pool.checkpoint()

    def restore(self, state: dict) -> None:
        self.pool.restore(state)

    def close(self) -> None:
        self.pool.close()
