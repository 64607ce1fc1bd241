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
interface, :func:`play_round`, :class:`Executor`, and :func:`ensure_ray`, the one
place dpfl starts or attaches to Ray (also for ``dpfl compare`` and ``dpfl tune``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.config import ConfigError
from engine.data.federated import FederatedDataset
from engine.federated.client import LocalSpec, client_costs, shard_cohort
from engine.federated.evaluation import combine_sums, eval_slices
from engine.federated.server import ServerSpec, is_eval_round
from engine.runtime.switches import LOG_TO_DRIVER_ENV, QUIET_ENV
from engine.telemetry import timeline


def ensure_ray(ray_cfg, include_dashboard: bool | None = None, extra_cpus: float = 0.0) -> bool:
    """Start Ray (or attach to ``ray.address``) unless it is running; True if started.

    The one place dpfl initialises Ray (``dpfl run``, ``compare`` and ``tune``). It
    attaches to ``ray.address``, else to ``$RAY_ADDRESS`` (set by Ray inside a job),
    else starts a local instance with at least the CPUs the workers declare plus
    ``extra_cpus`` (a Tune trial's own CPU), so one run or trial always fits (Ray's CPU
    counts are scheduling labels; on a 2-core machine a trial of 2 one-CPU workers and
    its 0.5-CPU head would otherwise wait for resources forever); attaching to an
    unreachable cluster is a ConfigError naming the address.
    """
    import ray

    if ray.is_initialized():
        if not (ray_cfg.address or os.environ.get("RAY_ADDRESS")):  # a Ray of this machine
            from engine.runtime.resources import check_processes

            check_processes(ray_cfg, float(ray.cluster_resources().get("CPU", 0.0)))
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # The CLI sets DPFL_RAY_LOG_TO_DRIVER=0 unless --verbose: workers' output then stays
    # in Ray's session logs instead of the console.
    log_to_driver = os.environ.get(LOG_TO_DRIVER_ENV, "1") != "0"
    kwargs: dict = {"log_to_driver": log_to_driver, "configure_logging": False}
    # Inside a Ray job (dpfl submit) Ray sets RAY_ADDRESS: attach, never start a new one.
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        kwargs["address"] = address
    else:
        from engine.runtime.resources import check_local_fit

        check_local_fit(ray_cfg, extra_cpus)  # no unbounded worker processes
        need = ray_cfg.num_workers * ray_cfg.num_cpus_per_worker + extra_cpus
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(np.ceil(need)))
        if include_dashboard is not None:
            kwargs["include_dashboard"] = include_dashboard
        if ray_cfg.object_store_memory_mb:
            kwargs["object_store_memory"] = ray_cfg.object_store_memory_mb * 2**20
    try:
        timeline.mark("ray.init start")
        context = ray.init(**kwargs)
        timeline.mark("ray.init done")
    except (ConnectionError, RuntimeError, ValueError) as e:
        if address:
            key = "ray.address" if ray_cfg.address else "$RAY_ADDRESS"
            # Ray >= 2.5x turns token authentication on for a new cluster; a driver
            # attaching without RAY_AUTH_MODE=token is refused with a bare ConnectionError.
            auth = not os.environ.get("RAY_AUTH_MODE") and os.path.isfile(
                os.path.expanduser("~/.ray/auth_token")
            )
            raise ConfigError(
                f"{key}={address!r}: cannot attach to a Ray cluster "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                + ("; if it uses token authentication, set RAY_AUTH_MODE=token" if auth else "")
            ) from None
        raise
    url = getattr(context, "dashboard_url", None)
    if url and os.environ.get(QUIET_ENV) != "1":  # dpfl -q: no console line
        print(f"Ray dashboard: http://{url}", file=sys.stderr, flush=True)
    return True


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

    def train(self, rnd: int, shards: list[np.ndarray], weights: Any, public: Any) -> list: ...

    def finish_round(self, rnd: int, partials: list) -> dict: ...

    def current_weights(self) -> Any: ...

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list: ...

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]: ...

    def attempt(self, rnd: int, play: Callable[[], dict]) -> dict: ...

    def weights(self) -> np.ndarray: ...

    def checkpoint(self) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def close(self) -> None: ...


def play_round(pool: WorkerPool, rnd: int, plan: RoundPlan) -> dict:
    """One round on ``pool`` — the only place a round's steps are written.

    The cohort is sampled by the server, split into shards (public: which worker
    trains a client and the float64 summation order, never who takes part), trained,
    reduced, privatised and accounted by the server; then evaluated on evaluation
    rounds. Returns the round's row.
    """
    timer = pool.timer
    with timer.phase("begin_round"):
        cohort, weights, public = pool.begin_round(rnd)
    with timer.phase("shard_split"):
        shards = shard_cohort(cohort, plan.num_shards, plan.costs)
    partials = pool.train(rnd, shards, weights, public)
    del weights, public
    with timer.phase("finish_round"):
        row = pool.finish_round(rnd, partials)
    evaluate = is_eval_round(rnd, plan.eval_every, plan.rounds)
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
    return row


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
        row = self.pool.attempt(rnd, lambda: play_round(self.pool, rnd, self.plan))
        row["actor_retries_nonprivate"] = self.pool.retries
        return row

    def weights(self) -> np.ndarray:
        return self.pool.weights()

    def checkpoint(self) -> dict:
        """Server state plus per-client state, enough to resume bit-identically."""
        return self.pool.checkpoint()

    def restore(self, state: dict) -> None:
        self.pool.restore(state)

    def close(self) -> None:
        self.pool.close()
