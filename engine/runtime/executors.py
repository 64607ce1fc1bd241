"""Executors: one round function, two worker pools (in process or Ray actors).

A round is written once, in :func:`play_round`: the server samples the cohort, the
cohort is split into ``num_workers`` shards (:func:`engine.federated.client.shard_cohort`, the
same split everywhere), each shard is trained into one partial sum, the server reduces
the partials in shard order, privatises and accounts, and on evaluation rounds the
test set (and, for personal heads, each client's held-out split) is evaluated in
slices spread over the workers. Where that runs is a *worker pool*
(:class:`WorkerPool`): :class:`InProcessPool` calls one server and one client worker
in this process; :class:`RayWorkerPool` holds the Ray actors and everything specific
to Ray — object references instead of values, actor start-up, and fault tolerance
(re-running a lost shard, restoring a round checkpoint). Hence for the same seed and
``num_workers`` the two give bit-identical models (tested). Client randomness is
keyed by (seed, round, client), so it does not depend on which worker trains a client.

Ray layout: one persistent :class:`ClientWorker` actor per worker, each declared with
``num_cpus`` / ``num_gpus`` (fractional GPUs allowed) and holding the dataset once —
``ray.put`` places it in the object store and numpy arrays are read zero-copy — and
one :class:`Server` that owns the global model, the noise streams and the accountant:
an actor, or (``ray.server``, :func:`server_in_driver`) the driver process behind an
actor's interface (:class:`DriverServer`). Per round the driver moves only object
references: the global weights go from the server to the workers and the partial
sums from the workers to the server, through the driver only where the server lives.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.config import ConfigError
from engine.data.federated import FederatedDataset
from engine.federated.client import ClientWorker, LocalSpec, client_costs, owner_shard, shard_cohort
from engine.federated.evaluation import combine_sums, eval_slices
from engine.federated.server import Server, ServerSpec, is_eval_round
from engine.runtime.switches import LOG_TO_DRIVER_ENV, QUIET_ENV
from engine.telemetry import timeline
from engine.telemetry.phases import OFF

ACTOR_START_TIMEOUT_S = 180.0


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


def local_executor(
    dataset: FederatedDataset, server_spec: ServerSpec, local_spec: LocalSpec, num_shards: int
) -> Executor:
    """Everything in this process; the reference the Ray executor must equal."""
    pool = InProcessPool(dataset, server_spec, local_spec)
    return Executor(pool, round_plan(dataset, server_spec, local_spec, num_shards))


def ray_executor(
    dataset: FederatedDataset,
    server_spec: ServerSpec,
    local_spec: LocalSpec,
    ray_cfg,  # engine.config.RayConfig
    run_name: str = "dpfl",
    include_dashboard: bool | None = None,
) -> Executor:
    """Persistent client-worker actors plus a server (:class:`RayWorkerPool`)."""
    pool = RayWorkerPool(dataset, server_spec, local_spec, ray_cfg, run_name, include_dashboard)
    return Executor(pool, round_plan(dataset, server_spec, local_spec, ray_cfg.num_workers))


class InProcessPool:
    """One server and one client worker in this process; shards run one after another."""

    retries = 0

    def __init__(
        self, dataset: FederatedDataset, server_spec: ServerSpec, local_spec: LocalSpec
    ) -> None:
        self.server = Server(dataset, server_spec)
        self.worker = ClientWorker(dataset, local_spec)
        self.timer: Any = OFF

    def set_timer(self, timer: Any) -> None:
        self.timer = self.server.timer = self.worker.timer = timer

    def begin_round(self, rnd: int) -> tuple[np.ndarray, Any, Any]:
        return self.server.begin_round(rnd)

    def train(self, rnd: int, shards: list[np.ndarray], weights: Any, public: Any) -> list:
        with self.timer.phase("train_shards"):
            return [self.worker.train_shard(weights, rnd, shard, public) for shard in shards]

    def finish_round(self, rnd: int, partials: list) -> dict:
        return self.server.finish_round(rnd, *partials, evaluate=False)

    def current_weights(self) -> np.ndarray:
        return self.server.get_weights()

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        return [self.worker.evaluate_slice(weights, a, b) for a, b in slices]

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]:
        return [self.worker.personal_eval(weights, c) for c in clients]

    def attempt(self, rnd: int, play: Callable[[], dict]) -> dict:
        return play()

    def weights(self) -> np.ndarray:
        return self.server.get_weights()

    def checkpoint(self) -> dict:
        return {"server": self.server.state_dict(), "clients": self.worker.client_state()}

    def restore(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])
        self.worker.restore_client_state(state.get("clients", {}))

    def close(self) -> None:
        pass


class _RestartRound(Exception):
    """Internal: restore every actor to the round checkpoint and re-run the round."""


class WorkerLostError(RuntimeError):
    """Actors kept dying: the run stops; the rounds completed so far are intact."""


def server_in_driver(choice: str, address: str | None = None) -> bool:
    """Where :class:`RayWorkerPool` keeps the server (``ray.server``).

    ``actor``: its own actor. ``driver``: this process, called like an actor
    (:class:`DriverServer`). ``auto``: the driver when the Ray cluster has one live
    node (a laptop or a single machine), where it saves a process that would import
    torch and the accountant again while the workers start — about 1.9 s of the time
    to the first round on 2 cores (``benchmarks/startup_eval.py``); an actor on a
    multi-node cluster, and through Ray Client (``ray://`` addresses: the driver is
    then outside the cluster). Results are bit-identical either way (tested)."""
    if choice != "auto":
        return choice == "driver"
    address = address or os.environ.get("RAY_ADDRESS") or ""
    if address.startswith("ray://"):
        return False
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


class _DriverMethod:
    """One :class:`Server` method called like an actor method: ``.remote(*args)`` runs
    it now in this process and returns object references to what it returned."""

    def __init__(self, ray, fn: Callable, num_returns: int = 1) -> None:
        self._ray, self._fn, self._num_returns = ray, fn, num_returns

    def options(self, num_returns: int = 1, **_: Any) -> _DriverMethod:
        return _DriverMethod(self._ray, self._fn, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ray = self._ray

        def arrive(a: Any) -> Any:
            # As an actor's argument would: a reference resolved, a value copied through
            # the object store (so the server never aliases the caller's arrays).
            return ray.get(a if isinstance(a, ray.ObjectRef) else ray.put(a))

        out = self._fn(*map(arrive, args), **{k: arrive(v) for k, v in kwargs.items()})
        if self._num_returns == 1:
            return ray.put(out)
        return [ray.put(o) for o in out]


class DriverServer:
    """A :class:`Server` in the driver process behind an actor handle's interface.

    The server's work is the same either way; only the process differs. It cannot be
    lost on its own (it dies with the driver), so ``max_restarts`` concerns only the
    client workers, and its round checkpoint is a reference like an actor's."""

    def __init__(self, ray, dataset: FederatedDataset, spec: ServerSpec) -> None:
        self._ray = ray
        self.instance = Server(dataset, spec)

    def __getattr__(self, name: str) -> _DriverMethod:
        if name.startswith("__") and name != "__ray_ready__":
            raise AttributeError(name)
        if name == "__ray_ready__":
            return _DriverMethod(self._ray, lambda: True)
        return _DriverMethod(self._ray, getattr(self.instance, name))


class RayWorkerPool:
    """Persistent client-worker actors plus a server, surviving actor deaths.

    Everything Ray-specific lives here: actors declared with their resources (and a GPU
    share, see :mod:`engine.runtime.resources`), the dataset put once in the object store,
    object references passed between actors so the O(d) vectors never go through the
    driver (unless the server lives there, ``ray.server``), and fault tolerance.

    Fault tolerance. Workers and a server actor are declared with ``max_restarts`` =
    ``ray.max_worker_restarts`` (a server in the driver can only die with it). After
    every completed round the executor keeps object references to the server's state
    (and, for recipes with per-client state, each worker's client-state snapshot) in the
    object store — a round checkpoint that costs one O(d) copy. When a client-worker
    dies during a round, only its shard (the lost clients) is re-run on the restarted
    actor with the same inputs and the same (seed, round, client) RNG streams, so its
    partial sum is bit-identical to the lost one. When the server dies, or a worker of a
    recipe with per-client state, every actor is restored to the previous round's
    checkpoint and the round is re-run whole. ε is a function of the rounds completed by
    the server, so each round is composed exactly once whatever was retried. More than
    ``max_worker_restarts`` losses in one round raise :class:`WorkerLostError`.
    """

    def __init__(
        self,
        dataset: FederatedDataset,
        server_spec: ServerSpec,
        local_spec: LocalSpec,
        ray_cfg,  # engine.config.RayConfig
        run_name: str = "dpfl",
        include_dashboard: bool | None = None,
    ) -> None:
        import ray

        self._ray = ray
        self._owns_ray = False
        self._owns_ray = ensure_ray(ray_cfg, include_dashboard)
        self.run_name = run_name
        self.max_restarts = int(ray_cfg.max_worker_restarts)
        from engine.runtime.resources import plan_gpu_share

        gpus, measured = plan_gpu_share(
            ray_cfg, local_spec.model_name, dataset, local_spec.batch_size
        )
        self.gpu_plan = {"num_gpus_per_worker": gpus, **measured}
        if measured:
            print(f"dpfl: GPU packing {self.gpu_plan}", file=sys.stderr)
        if gpus > 0:  # vectorised groups are sized for this share of the GPU
            local_spec = dataclasses.replace(local_spec, gpu_share=float(gpus))
        data_ref = ray.put(dataset)
        worker_cls = ray.remote(ClientWorker)
        server_cls = ray.remote(Server)
        # Ray actor handles: their methods are called as .remote(), which mypy cannot see
        self.workers: list[Any] = [
            worker_cls.options(
                num_cpus=ray_cfg.num_cpus_per_worker,
                num_gpus=gpus,
                name=f"{run_name}:client-worker-{i}",
                max_concurrency=1,
                max_restarts=self.max_restarts,
                max_task_retries=0,  # the executor re-runs lost shards itself
            ).remote(data_ref, local_spec)
            for i in range(ray_cfg.num_workers)
        ]
        self.server_in_driver = server_in_driver(ray_cfg.server, ray_cfg.address)
        if self.server_in_driver:  # built while the worker processes start
            self.server: Any = DriverServer(ray, ray.get(data_ref), server_spec)
        else:
            self.server = server_cls.options(
                num_cpus=0,
                name=f"{run_name}:server",
                max_restarts=self.max_restarts,
                max_task_retries=0,
            ).remote(data_ref, server_spec)
        # Kept for the executor's lifetime: a restarting actor re-reads its constructor
        # arguments from the object store.
        self._data_ref: Any = data_ref
        self.personal = local_spec.pipeline.personal is not None
        self.retries = 0  # actor losses survived so far
        self.retry_seconds = 0.0  # wall time spent re-running lost work
        self.timer: Any = OFF
        server: Any = self.server  # an actor handle (its methods are called by .remote())
        pings = [w.ping.remote() for w in self.workers] + [server.dim.remote()]
        ready, pending = ray.wait(pings, num_returns=len(pings), timeout=ACTOR_START_TIMEOUT_S)
        if pending:
            self.close()
            raise RuntimeError(
                f"ray.num_workers={ray_cfg.num_workers} workers with "
                f"ray.num_cpus_per_worker={ray_cfg.num_cpus_per_worker} and "
                f"ray.num_gpus_per_worker={ray_cfg.num_gpus_per_worker} could not all start "
                f"within {ACTOR_START_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.cluster_resources()}"
            )
        try:  # a constructor that raised (e.g. no usable GPU) surfaces here
            ray.get(ready)
            self.worker_devices = ray.get([w.device_name.remote() for w in self.workers])
        except Exception:
            self.close()  # free the actor names for the next attempt in this Ray session
            raise
        timeline.mark("workers ready")
        if any(d != "cpu" for d in self.worker_devices):
            print(f"dpfl: client workers train on {self.worker_devices}", file=sys.stderr)
        self._save_round_checkpoint()

    # ------------------------------------------------------------ fault tolerance
    def _save_round_checkpoint(self) -> None:
        """References to the current server (and client) state, kept in the object store."""
        self._ckpt_server = self.server.state_dict.remote()
        self._ckpt_clients = (
            [w.client_state.remote() for w in self.workers] if self.personal else None
        )

    def _restore_round_checkpoint(self) -> None:
        ray = self._ray
        calls = [self.server.load_state_dict.remote(self._ckpt_server)]
        if self._ckpt_clients is not None:
            calls += [
                w.restore_client_state.remote(ref)
                for w, ref in zip(self.workers, self._ckpt_clients)
            ]
        ray.get(calls)

    def _lost(self, rnd: int, what: str, error: Exception) -> None:
        self.retries += 1
        self._round_losses += 1
        print(
            f"dpfl: round {rnd + 1}: {what} died ({type(error).__name__}); "
            f"retry {self._round_losses} of {self.max_restarts}",
            file=sys.stderr,
        )
        if self._round_losses > self.max_restarts:
            raise WorkerLostError(
                f"round {rnd + 1}: {what} died {self._round_losses} times, more than "
                f"ray.max_worker_restarts={self.max_restarts}; stopping. The "
                f"{rnd} completed rounds are intact."
            ) from error

    def _await_restart(self, actor, what: str, rnd: int) -> None:
        """Block until ``actor`` answers again after a loss (Ray is restarting it)."""
        ray = self._ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        deadline = time.perf_counter() + ACTOR_START_TIMEOUT_S
        while time.perf_counter() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=10)
                return
            except (ActorUnavailableError, GetTimeoutError):
                time.sleep(0.1)
            except ActorDiedError as e:
                raise WorkerLostError(
                    f"round {rnd + 1}: {what} is dead and will not restart "
                    f"(ray.max_worker_restarts={self.max_restarts} used up); stopping. "
                    f"The {rnd} completed rounds are intact."
                ) from e
        raise WorkerLostError(
            f"round {rnd + 1}: {what} did not come back within {ACTOR_START_TIMEOUT_S:.0f} s"
        )

    def set_timer(self, timer: Any) -> None:
        """The driver's (and a driver server's) phases go to ``timer``; each worker
        actor keeps its own, read with :meth:`take_worker_phase_times`."""
        self.timer = timer
        if isinstance(self.server, DriverServer):
            self.server.instance.timer = timer
        self._ray.get([w.set_timing.remote(timer.enabled) for w in self.workers])

    def take_worker_phase_times(self) -> list[dict[str, float]]:
        """Each worker's phase seconds since the last call (empty when not timing)."""
        return self._ray.get([w.take_phase_times.remote() for w in self.workers])

    # ----------------------------------------------------- what play_round calls
    def begin_round(self, rnd: int) -> tuple[np.ndarray, Any, Any]:
        """The cohort (a value: the driver splits it), weights and public state (refs)."""
        cohort_ref, weights_ref, public_ref = self.server.begin_round.options(num_returns=3).remote(
            rnd
        )
        return self._ray.get(cohort_ref), weights_ref, public_ref

    def train(self, rnd: int, shards: list[np.ndarray], weights: Any, public: Any) -> list:
        """Partial-sum refs of every shard; a dead worker's shard is re-run (only it)."""
        ray = self._ray
        from ray.exceptions import RayActorError

        def submit(i: int):
            return (
                self.workers[i]
                .train_shard_counted.options(num_returns=2)
                .remote(weights, rnd, shards[i], public)
            )

        with self.timer.phase("dispatch"):
            refs = [submit(i) for i in range(len(self.workers))]
        # The round's noise depends on no client data: the server draws it now, while
        # the shards train (in the driver, or queued on a server actor before
        # finish_round), instead of after the last partial sum has arrived.
        t_wait = time.perf_counter()
        self.server.prepare_noise.remote(rnd)
        partials = [r[0] for r in refs]
        pending = {i: refs[i][1] for i in range(len(refs))}
        while pending:
            i = next(iter(pending))
            try:
                ray.get(pending[i])
                del pending[i]
            except RayActorError as e:
                t0 = time.perf_counter()
                what = f"{self.run_name}:client-worker-{i}"
                self._lost(rnd, what, e)
                self._await_restart(self.workers[i], what, rnd)
                if self.personal:  # its per-client state went with it
                    self.retry_seconds += time.perf_counter() - t0
                    raise _RestartRound() from e
                partials[i], pending[i] = submit(i)
                self.retry_seconds += time.perf_counter() - t0
        self.timer.add("train_wait", time.perf_counter() - t_wait)
        return partials

    def finish_round(self, rnd: int, partials: list) -> dict:
        return self._ray.get(self.server.finish_round.remote(rnd, *partials, evaluate=False))

    def current_weights(self) -> Any:
        return self.server.get_weights.remote()

    def evaluate(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        k = len(self.workers)
        return self._ray.get(
            [
                self.workers[i % k].evaluate_slice.remote(weights, a, b)
                for i, (a, b) in enumerate(slices)
            ]
        )

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]:
        k = len(self.workers)
        return self._ray.get(
            [self.workers[i % k].personal_eval.remote(weights, c) for i, c in enumerate(clients)]
        )

    def attempt(self, rnd: int, play: Callable[[], dict]) -> dict:
        """``play()`` the round; when an actor dies, restart what was lost (see the
        class docstring) and play it again. Saves the round checkpoint after it."""
        from ray.exceptions import RayActorError

        self._round_losses = 0
        while True:
            t0 = time.perf_counter()
            try:
                row = play()
                break
            except (_RestartRound, RayActorError) as e:
                if isinstance(e, RayActorError):
                    self._lost(rnd, "the server or a client-worker", e)
                    for a in [self.server, *self.workers]:
                        self._await_restart(a, "an actor", rnd)
                self._restore_round_checkpoint()
                self.retry_seconds += time.perf_counter() - t0
        with self.timer.phase("round_checkpoint_refs"):
            self._save_round_checkpoint()
        return row

    def weights(self) -> np.ndarray:
        return np.array(self._ray.get(self.server.get_weights.remote()))

    def checkpoint(self) -> dict:
        """The round checkpoint the executor already holds (state after the last round)."""
        ray = self._ray
        client_refs = self._ckpt_clients or [w.client_state.remote() for w in self.workers]
        clients: dict = {}
        for part in ray.get(client_refs):
            clients.update(part)
        return {"server": ray.get(self._ckpt_server), "clients": clients}

    def restore(self, state: dict) -> None:
        ray = self._ray
        k = len(self.workers)
        clients = state.get("clients", {})
        calls = [self.server.load_state_dict.remote(state["server"])]
        for i, w in enumerate(self.workers):
            owners = owner_shard(np.fromiter(clients, np.int64, len(clients)), k)
            mine = {c: v for (c, v), o in zip(clients.items(), owners) if o == i}
            calls.append(w.restore_client_state.remote(mine))
        ray.get(calls)
        self._save_round_checkpoint()

    def close(self) -> None:
        ray = self._ray
        for a in [*getattr(self, "workers", []), getattr(self, "server", None)]:
            if a is not None and not isinstance(a, DriverServer):
                try:
                    ray.kill(a)
                except Exception:  # noqa: BLE001 - best effort on shutdown
                    pass
        self.workers = []
        self.server = None
        self._data_ref = None
        self._ckpt_server = self._ckpt_clients = None
        if self._owns_ray:
            time.sleep(0.1)
            ray.shutdown()
            self._owns_ray = False
