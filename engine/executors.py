"""Executors: where client workers and the server run — Ray actors or in process.

Both executors perform the identical computation: the server samples the cohort,
the cohort is split into ``num_workers`` contiguous shards (the same split in both),
each shard is trained client by client into one partial sum, and the server reduces
the partials in shard order. Hence for the same seed and ``num_workers`` the Ray and
in-process executors give bit-identical models (tested). Client randomness is keyed
by (seed, round, client), so it does not depend on which worker trains a client.

Ray layout: one persistent :class:`ClientWorker` actor per worker, each declared with
``num_cpus`` / ``num_gpus`` (fractional GPUs allowed) and holding the dataset once —
``ray.put`` places it in the object store and numpy arrays are read zero-copy — and
one :class:`Server` actor that owns the global model, the noise streams and the
accountant. Per round the driver moves only object references: the global weights
go from the server to the workers and the partial sums from the workers to the
server without passing through the driver.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Protocol

import numpy as np

from engine.client import ClientWorker, LocalSpec, client_costs, owner_shard, shard_cohort
from engine.config import ConfigError
from engine.data.federated import FederatedDataset
from engine.evaluation import combine_sums, eval_slices
from engine.server import Server, ServerSpec, is_eval_round

ACTOR_START_TIMEOUT_S = 180.0


class Executor(Protocol):
    def run_round(self, rnd: int) -> dict: ...

    def weights(self) -> np.ndarray: ...

    def checkpoint(self) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def close(self) -> None: ...


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
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # The CLI sets DPFL_RAY_LOG_TO_DRIVER=0 unless --verbose: workers' output then stays
    # in Ray's session logs instead of the console.
    log_to_driver = os.environ.get("DPFL_RAY_LOG_TO_DRIVER", "1") != "0"
    kwargs: dict = {"log_to_driver": log_to_driver, "configure_logging": False}
    # Inside a Ray job (dpfl submit) Ray sets RAY_ADDRESS: attach, never start a new one.
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        kwargs["address"] = address
    else:
        need = ray_cfg.num_workers * ray_cfg.num_cpus_per_worker + extra_cpus
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(np.ceil(need)))
        if include_dashboard is not None:
            kwargs["include_dashboard"] = include_dashboard
        if ray_cfg.object_store_memory_mb:
            kwargs["object_store_memory"] = ray_cfg.object_store_memory_mb * 2**20
    try:
        context = ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        if address:
            key = "ray.address" if ray_cfg.address else "$RAY_ADDRESS"
            raise ConfigError(
                f"{key}={address!r}: cannot attach to a Ray cluster "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None
        raise
    url = getattr(context, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}", file=sys.stderr)
    return True


class _RestartRound(Exception):
    """Internal: restore every actor to the round checkpoint and re-run the round."""


class LocalExecutor:
    """Everything in this process; the reference the Ray executor must equal."""

    def __init__(
        self,
        dataset: FederatedDataset,
        server_spec: ServerSpec,
        local_spec: LocalSpec,
        num_shards: int,
    ) -> None:
        self.server = Server(dataset, server_spec)
        self.worker = ClientWorker(dataset, local_spec)
        self.num_shards = num_shards
        self.costs = client_costs(dataset, local_spec)
        self.num_clients = dataset.num_clients
        self.personal = self.worker.pipeline.personal is not None
        self.test_slices = eval_slices(len(dataset.y_test), num_shards)

    def run_round(self, rnd: int) -> dict:
        cohort, weights, public = self.server.begin_round(rnd)
        partials = [
            self.worker.train_shard(weights, rnd, shard, public)
            for shard in shard_cohort(cohort, self.num_shards, self.costs)
        ]
        row = self.server.finish_round(rnd, *partials, evaluate=False)
        if self.server.is_eval_round(rnd):
            weights = self.server.get_weights()
            sums = [self.worker.evaluate_slice(weights, a, b) for a, b in self.test_slices]
            row["test_accuracy"], row["test_loss"] = combine_sums(sums)
        if self.personal and self.server.is_eval_round(rnd):
            weights = self.server.get_weights()
            correct, total = self.worker.personal_eval(weights, np.arange(self.num_clients))
            row["personal_accuracy_nonprivate"] = correct / total if total else float("nan")
        elif self.personal:
            row["personal_accuracy_nonprivate"] = float("nan")
        row["actor_retries_nonprivate"] = 0
        return row

    def weights(self) -> np.ndarray:
        return self.server.get_weights()

    def checkpoint(self) -> dict:
        """Server state plus per-client state, enough to resume bit-identically."""
        return {"server": self.server.state_dict(), "clients": self.worker.client_state()}

    def restore(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])
        self.worker.restore_client_state(state.get("clients", {}))

    def close(self) -> None:
        pass


class WorkerLostError(RuntimeError):
    """Actors kept dying: the run stops; the rounds completed so far are intact."""


class RayExecutor:
    """Persistent client-worker actors plus a server actor, surviving actor deaths.

    Fault tolerance. Workers and the server are declared with ``max_restarts`` =
    ``ray.max_worker_restarts``. After every completed round the executor keeps object
    references to the server's state (and, for recipes with per-client state, each
    worker's client-state snapshot) in the object store — a round checkpoint that costs
    one O(d) copy, never a trip through the driver. When a client-worker dies during a
    round, only its shard (the lost clients) is re-run on the restarted actor with the
    same inputs and the same (seed, round, client) RNG streams, so its partial sum is
    bit-identical to the lost one. When the server dies, or a worker of a recipe with
    per-client state, every actor is restored to the previous round's checkpoint and
    the round is re-run whole. ε is a function of the rounds completed by the server,
    so each round is composed exactly once whatever was retried. More than
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
        from engine.resources import plan_gpu_share

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
        self.server: Any = server_cls.options(
            num_cpus=0,
            name=f"{run_name}:server",
            max_restarts=self.max_restarts,
            max_task_retries=0,
        ).remote(data_ref, server_spec)
        # Kept for the executor's lifetime: a restarting actor re-reads its constructor
        # arguments from the object store.
        self._data_ref: Any = data_ref
        self._all_clients = np.arange(dataset.num_clients)
        self.costs = client_costs(dataset, local_spec)
        self.test_slices = eval_slices(len(dataset.y_test), ray_cfg.num_workers)
        self.eval_every, self.rounds = server_spec.eval_every, server_spec.rounds
        self.personal = local_spec.pipeline.personal is not None
        self.retries = 0  # actor losses survived so far
        self.retry_seconds = 0.0  # wall time spent re-running lost work
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

    def _train_shards(self, rnd: int, shards, weights_ref, public_ref) -> list:
        """Partial-sum refs of every shard; a dead worker's shard is re-run (only it)."""
        ray = self._ray
        from ray.exceptions import RayActorError

        def submit(i: int):
            return (
                self.workers[i]
                .train_shard_counted.options(num_returns=2)
                .remote(weights_ref, rnd, shards[i], public_ref)
            )

        refs = [submit(i) for i in range(len(self.workers))]
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
        return partials

    def run_round(self, rnd: int) -> dict:
        from ray.exceptions import RayActorError

        self._round_losses = 0
        while True:
            t0 = time.perf_counter()
            try:
                row = self._run_round_once(rnd)
                break
            except (_RestartRound, RayActorError) as e:
                if isinstance(e, RayActorError):
                    self._lost(rnd, "the server or a client-worker", e)
                    for a in [self.server, *self.workers]:
                        self._await_restart(a, "an actor", rnd)
                self._restore_round_checkpoint()
                self.retry_seconds += time.perf_counter() - t0
        self._save_round_checkpoint()
        row["actor_retries_nonprivate"] = self.retries
        return row

    def _run_round_once(self, rnd: int) -> dict:
        ray = self._ray
        cohort_ref, weights_ref, public_ref = self.server.begin_round.options(num_returns=3).remote(
            rnd
        )
        cohort = ray.get(cohort_ref)
        shards = shard_cohort(cohort, len(self.workers), self.costs)
        partial_refs = self._train_shards(rnd, shards, weights_ref, public_ref)
        del weights_ref, public_ref
        row = ray.get(self.server.finish_round.remote(rnd, *partial_refs, evaluate=False))
        eval_round = is_eval_round(rnd, self.eval_every, self.rounds)
        if eval_round:
            weights_ref = self.server.get_weights.remote()
            sums = ray.get(
                [
                    w.evaluate_slice.remote(weights_ref, a, b)
                    for w, (a, b) in zip(self.workers, self.test_slices)
                ]
            )
            row["test_accuracy"], row["test_loss"] = combine_sums(sums)
        if self.personal:
            row["personal_accuracy_nonprivate"] = float("nan")
            if eval_round:
                k = len(self.workers)
                results = ray.get(
                    [
                        w.personal_eval.remote(weights_ref, self._all_clients[i::k])
                        for i, w in enumerate(self.workers)
                    ]
                )
                correct = sum(c for c, _ in results)
                total = sum(t for _, t in results)
                row["personal_accuracy_nonprivate"] = correct / total if total else float("nan")
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
            if a is not None:
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
