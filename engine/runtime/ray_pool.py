"""The Ray worker pool: persistent client-worker actors plus a server (an actor, or
the driver: :mod:`engine.runtime.driver_server`), object references between them, and
fault tolerance (:class:`RayWorkerPool`); :func:`ray_executor` builds its executor."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from engine.data.federated import FederatedDataset
from engine.data.shared import by_reference
from engine.federated.client import ClientWorker, LocalSpec, owner_shard
from engine.federated.server import Server, ServerSpec
from engine.runtime.driver_server import DriverServer, server_in_driver, single_machine
from engine.runtime.executors import Executor, WorkerLostError, round_plan
from engine.runtime.ray_start import ensure_ray, release_ray
from engine.telemetry import timeline
from engine.telemetry.phases import OFF

ACTOR_START_TIMEOUT_S = 180.0
_Played = TypeVar("_Played")
#: The client workers' second concurrency group: evaluations beside training.
EVAL_GROUP = "eval"


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


class _RestartRound(Exception):
    """Internal: restore every actor to the round checkpoint and re-run the round."""


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
        self.personal = local_spec.pipeline.personal is not None
        # Evaluation of round t beside round t+1's training (Executor.run_rounds): not
        # for personal heads, whose evaluation reads the client state that the next
        # round changes.
        apart = bool(ray_cfg.overlap_evaluation) and not self.personal
        if apart:  # each worker keeps a second model for it
            local_spec = dataclasses.replace(local_spec, apart_evaluation=True)
        # On one machine the examples go by reference when they live in shared memory
        # (engine.data.shared): written once, not copied into the object store while
        # the driver still holds them (issue 30: 2.43 x the data in the driver).
        with by_reference(single_machine(ray_cfg.address)):
            data_ref = ray.put(dataset)
        # One thread trains (the default group, max_concurrency=1: shards in order);
        # evaluations beside training run in a second (EVAL_GROUP) on their own model.
        worker_cls = ray.remote(concurrency_groups={EVAL_GROUP: 1})(  # type: ignore[call-overload]
            ClientWorker
        )
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
            #: whether evaluations run beside the next round's training (EVAL_GROUP)
            self.overlaps_evaluation = apart and all(
                ray.get([w.evaluates_apart.remote() for w in self.workers])
            )
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

    def train(
        self,
        rnd: int,
        shards: list[np.ndarray],
        weights: Any,
        public: Any,
        while_training: Callable[[], None] | None = None,
    ) -> list:
        """Partial-sum refs of every shard; a dead worker's shard is re-run (only it).
        ``while_training()`` runs once the shards are dispatched, before the wait."""
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
        self.server.prefetch_noise.remote(rnd)
        if while_training is not None:
            while_training()
            t_wait = time.perf_counter()
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

    def evaluate_behind(self, weights: Any, slices: list[tuple[int, int]]) -> list:
        """Start evaluating ``weights`` in the workers' :data:`EVAL_GROUP` thread, on
        their apart models, without waiting: references, one per slice, for
        :meth:`evaluation_sums`. The next round's shards train meanwhile."""
        k = len(self.workers)
        return [
            self.workers[i % k]
            .evaluate_slice_apart.options(concurrency_group=EVAL_GROUP)
            .remote(weights, a, b)
            for i, (a, b) in enumerate(slices)
        ]

    def evaluation_sums(
        self, rnd: int, refs: list, weights: Any, slices: list[tuple[int, int]], recover: bool
    ) -> list | None:
        """The sums of :meth:`evaluate_behind`'s ``refs`` (round ``rnd``'s model). When
        a worker died before its slice was done: None if not ``recover`` (the caller
        retries once the round's own recovery has run), else the slice is evaluated
        again on the restarted worker (an evaluation reads only the weights and the
        public test set). Raises :class:`WorkerLostError` when the worker does not come
        back."""
        ray = self._ray
        from ray.exceptions import RayActorError

        k = len(self.workers)
        sums: list = [None] * len(refs)
        for i, ref in enumerate(refs):
            for _ in range(self.max_restarts + 1):
                try:
                    sums[i] = ray.get(ref)
                    break
                except RayActorError:
                    if not recover:
                        return None
                    what = f"{self.run_name}:client-worker-{i % k}"
                    self._await_restart(self.workers[i % k], what, rnd)
                    a, b = slices[i]
                    ref = (
                        self.workers[i % k]
                        .evaluate_slice_apart.options(concurrency_group=EVAL_GROUP)
                        .remote(weights, a, b)
                    )
            else:
                raise WorkerLostError(
                    f"round {rnd + 1}: {self.run_name}:client-worker-{i % k} died "
                    f"{self.max_restarts + 1} times while it evaluated test slice "
                    f"{slices[i]}; stopping. The {rnd} completed rounds are intact."
                )
        return sums

    def personal_eval(self, weights: Any, clients: list[np.ndarray]) -> list[tuple[int, int]]:
        k = len(self.workers)
        return self._ray.get(
            [self.workers[i % k].personal_eval.remote(weights, c) for i, c in enumerate(clients)]
        )

    def attempt(self, rnd: int, play: Callable[[], _Played]) -> _Played:
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

    def checkpoint_handle(self) -> tuple[Any, list]:
        """References to the state after the last round, the round checkpoint's:
        :meth:`checkpoint` reads them, also once the next round is under way. Only
        personal heads are client state (``OneByOneTrainer`` stores nothing else), so
        without them no worker is asked for its (empty) store."""
        return self._ckpt_server, self._ckpt_clients or []

    def checkpoint(self, handle: tuple[Any, list] | None = None) -> dict:
        """The checkpoint behind ``handle`` (:meth:`checkpoint_handle`; default: now)."""
        ray = self._ray
        server_ref, client_refs = handle if handle is not None else self.checkpoint_handle()
        clients: dict = {}
        for part in ray.get(client_refs):
            clients.update(part)
        return {"server": ray.get(server_ref), "clients": clients}

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
        server = getattr(self, "server", None)
        if isinstance(server, DriverServer):
            server.instance.close()  # its noise thread; an actor's ends with its process
        for a in [*getattr(self, "workers", []), server]:
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
            release_ray(settle_s=0.1)  # ray.shutdown(), or left for the dpfl executable's exit
            self._owns_ray = False
