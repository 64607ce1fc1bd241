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

import os
import sys
import time
from typing import Protocol

import numpy as np

from engine.client import ClientWorker, LocalSpec, shard_cohort
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


def ensure_ray(ray_cfg, include_dashboard: bool | None = None) -> bool:
    """Start Ray (or attach to ``ray.address``) unless it is running; True if started.

    The one place dpfl initialises Ray (``dpfl run``, ``compare`` and ``tune``). A local
    instance gets at least the CPUs the workers declare; attaching to an unreachable
    cluster is a ConfigError naming ``ray.address``.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    kwargs: dict = {"log_to_driver": True, "configure_logging": False}
    if ray_cfg.address:
        kwargs["address"] = ray_cfg.address
    else:
        need = ray_cfg.num_workers * ray_cfg.num_cpus_per_worker
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(np.ceil(need)))
        if include_dashboard is not None:
            kwargs["include_dashboard"] = include_dashboard
        if ray_cfg.object_store_memory_mb:
            kwargs["object_store_memory"] = ray_cfg.object_store_memory_mb * 2**20
    try:
        context = ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        if ray_cfg.address:
            raise ConfigError(
                f"ray.address={ray_cfg.address!r}: cannot attach to a Ray cluster "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from None
        raise
    url = getattr(context, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}", file=sys.stderr)
    return True


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
        self.num_clients = dataset.num_clients
        self.personal = self.worker.pipeline.personal is not None
        self.test_slices = eval_slices(len(dataset.y_test), num_shards)

    def run_round(self, rnd: int) -> dict:
        cohort, weights, public = self.server.begin_round(rnd)
        partials = [
            self.worker.train_shard(weights, rnd, shard, public)
            for shard in shard_cohort(cohort, self.num_shards)
        ]
        row = self.server.finish_round(rnd, *partials, evaluate=False)
        if self.server.is_eval_round(rnd):
            weights = self.server.get_weights()
            sums = [self.worker.evaluate_slice(weights, a, b) for a, b in self.test_slices]
            row["test_accuracy"], row["test_loss"] = combine_sums(sums)
        if self.personal and self.server.is_eval_round(rnd):
            weights = self.server.get_weights()
            correct, total = self.worker.personal_eval(weights, np.arange(self.num_clients))
            row["personal_accuracy"] = correct / total if total else float("nan")
        elif self.personal:
            row["personal_accuracy"] = float("nan")
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


class RayExecutor:
    """Persistent client-worker actors plus a server actor."""

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
        data_ref = ray.put(dataset)
        worker_cls = ray.remote(ClientWorker)
        server_cls = ray.remote(Server)
        self.workers = [
            worker_cls.options(
                num_cpus=ray_cfg.num_cpus_per_worker,
                num_gpus=ray_cfg.num_gpus_per_worker,
                name=f"{run_name}:client-worker-{i}",
                max_concurrency=1,
            ).remote(data_ref, local_spec)
            for i in range(ray_cfg.num_workers)
        ]
        self.server = server_cls.options(num_cpus=0, name=f"{run_name}:server").remote(
            data_ref, server_spec
        )
        del data_ref
        self._all_clients = np.arange(dataset.num_clients)
        self.test_slices = eval_slices(len(dataset.y_test), ray_cfg.num_workers)
        self.eval_every, self.rounds = server_spec.eval_every, server_spec.rounds
        from algorithms import build_pipeline

        self.personal = (
            build_pipeline(
                local_spec.algorithm, local_spec.algo, local_spec.clip_norm, 0.0
            ).personal
            is not None
        )
        pings = [w.ping.remote() for w in self.workers] + [self.server.dim.remote()]
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
        ray.get(ready)

    def run_round(self, rnd: int) -> dict:
        ray = self._ray
        cohort_ref, weights_ref, public_ref = self.server.begin_round.options(num_returns=3).remote(
            rnd
        )
        cohort = ray.get(cohort_ref)
        shards = shard_cohort(cohort, len(self.workers))
        partial_refs = [
            w.train_shard.remote(weights_ref, rnd, shard, public_ref)
            for w, shard in zip(self.workers, shards)
        ]
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
            row["personal_accuracy"] = float("nan")
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
                row["personal_accuracy"] = correct / total if total else float("nan")
        return row

    def weights(self) -> np.ndarray:
        return np.array(self._ray.get(self.server.get_weights.remote()))

    def checkpoint(self) -> dict:
        ray = self._ray
        clients: dict = {}
        for part in ray.get([w.client_state.remote() for w in self.workers]):
            clients.update(part)
        return {"server": ray.get(self.server.state_dict.remote()), "clients": clients}

    def restore(self, state: dict) -> None:
        ray = self._ray
        k = len(self.workers)
        clients = state.get("clients", {})
        calls = [self.server.load_state_dict.remote(state["server"])]
        for i, w in enumerate(self.workers):
            mine = {c: v for c, v in clients.items() if int(c) % k == i}
            calls.append(w.restore_client_state.remote(mine))
        ray.get(calls)

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
        if self._owns_ray:
            time.sleep(0.1)
            ray.shutdown()
            self._owns_ray = False
