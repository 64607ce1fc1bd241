"""Cohort sharding: balanced by estimated work for stateless recipes, sticky otherwise."""

from __future__ import annotations

import numpy as np

from algorithms import build_pipeline
from engine.config import AlgoConfig
from engine.data.federated import FederatedDataset
from engine.federated.client import LocalSpec, client_costs, shard_cohort


def spec(algorithm: str = "dp_fedavg", steps: int | None = None) -> LocalSpec:
    return LocalSpec(
        seed=0, model_name="logreg", epochs=2, batch_size=10, lr=0.1, lr_decay=1.0,
        momentum=0.0, weight_decay=0.0,
        pipeline=build_pipeline(algorithm, AlgoConfig(), 1.0, 0.0, "logreg"), steps=steps,
    )  # fmt: skip


def dataset(sizes: list[int]) -> FederatedDataset:
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(bounds[-1])
    return FederatedDataset(
        name="sizes",
        x_train=np.zeros((n, 3), np.float32),
        y_train=np.zeros(n, np.int64),
        client_train=[np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))],
        client_test=[np.zeros(0, np.int64) for _ in sizes],
        x_test=np.zeros((1, 3), np.float32),
        y_test=np.zeros(1, np.int64),
        num_classes=2,
        input_shape=(3,),
    )


def test_balanced_shards_partition_the_cohort_within_the_greedy_bound() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, k = int(rng.integers(1, 400)), int(rng.integers(1, 9))
        costs = rng.integers(1, 200, n).astype(float)
        cohort = rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False)
        shards = shard_cohort(cohort, k, costs)
        assert len(shards) == k
        joined = np.concatenate(shards) if shards else np.zeros(0)
        assert sorted(joined.tolist()) == sorted(cohort.tolist())  # a partition
        assert all((np.diff(s) > 0).all() for s in shards)  # each ascending
        loads = np.array([costs[s].sum() for s in shards])
        if len(cohort):
            # Greedy longest-first: the busiest shard exceeds the mean load by at most
            # one client's cost (Graham's bound), whatever the costs.
            assert loads.max() <= costs[cohort].sum() / k + costs[cohort].max() + 1e-9
        again = shard_cohort(cohort[::-1].copy(), k, costs)
        assert all(np.array_equal(a, b) for a, b in zip(shards, again))  # deterministic


def test_balanced_beats_modulo_on_uneven_clients() -> None:
    ds = dataset([30, 90] * 50)  # every odd client is three times the work
    costs = client_costs(ds, spec())
    assert costs is not None and costs[1] > costs[0]
    cohort = np.arange(0, 100, 1)
    modulo = [costs[s].sum() for s in shard_cohort(cohort, 2)]
    balanced = [costs[s].sum() for s in shard_cohort(cohort, 2, costs)]
    assert max(modulo) / min(modulo) > 2.0
    assert max(balanced) - min(balanced) <= costs.max()


def test_costs_follow_local_work_and_personal_recipes_stay_sticky() -> None:
    ds = dataset([5, 10, 25, 0])
    by_epochs = client_costs(ds, spec())
    np.testing.assert_allclose(by_epochs, [2 * 5 + 10, 2 * 10 + 10, 2 * 25 + 10, 10])
    by_steps = client_costs(ds, spec(steps=3))
    np.testing.assert_allclose(by_steps, [3 * 5 + 10, 3 * 10 + 10, 3 * 10 + 10, 10])
    assert client_costs(ds, spec("dp2_fedsam")) is None
    cohort = np.array([0, 1, 2, 3, 7, 8])
    assert [s.tolist() for s in shard_cohort(cohort, 3)] == [[0, 3], [1, 7], [2, 8]]
