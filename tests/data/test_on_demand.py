"""dataset.materialize=false: clients built on demand are the materialised natural
clients, rebuilt identically on any process, and nothing stored grows with N."""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest

from engine.config import ConfigError, DatasetConfig
from engine.data import build_dataset
from engine.data.partition import natural_partition
from engine.data.synthetic import generate_synthetic

KW = dict(num_clients=40, partition="natural", synthetic_mean_samples=10, public_eval_clients=5)


@pytest.mark.parametrize("model", ["shared", "per_client"])
def test_on_demand_clients_equal_the_materialised_natural_clients(model):
    cfg = DatasetConfig(synthetic_model=model, **KW)
    lazy = build_dataset(DatasetConfig(materialize=False, synthetic_model=model, **KW),
                         np.random.default_rng(4))  # fmt: skip
    full = build_dataset(cfg, np.random.default_rng(4))
    assert np.array_equal(lazy.x_test, full.x_test) and np.array_equal(lazy.y_test, full.y_test)
    assert lazy.num_clients == full.num_clients == 40
    pooled = generate_synthetic(40, np.random.default_rng(4), mean_samples=10, model=model)
    natural = natural_partition(pooled.groups)
    for k in range(40):
        tr, te = lazy.client_train[k], lazy.client_test[k]
        assert len(tr) == len(full.client_train[k]) and len(te) == len(full.client_test[k])
        both = np.concatenate([tr, te])
        assert np.array_equal(lazy.x_train[both], pooled.x_train[natural[k]])
        assert np.array_equal(lazy.y_train[both], pooled.y_train[natural[k]])
    assert np.array_equal(lazy.client_sizes(), full.client_sizes())


def test_on_demand_is_the_same_after_pickling_and_cache_eviction():
    ds = build_dataset(DatasetConfig(materialize=False, **KW), np.random.default_rng(1))
    idx = np.sort(np.concatenate([ds.client_train[3], ds.client_train[17][:2]]))
    first = ds.x_train[idx]
    other = pickle.loads(pickle.dumps(ds))  # another process: empty cache
    assert np.array_equal(other.x_train[idx], first)
    for k in range(40):  # touch every client, evicting 3 and 17 from a small cache
        other.y_train[other.client_train[k]]
    assert np.array_equal(other.x_train[idx], first)
    assert np.array_equal(other.y_train[idx], ds.y_train[idx])


def test_on_demand_memory_does_not_grow_with_n():
    held = {}
    for n in (100, 1_000_000):
        tracemalloc.start()
        cfg = DatasetConfig(materialize=False, **{**KW, "num_clients": n})
        ds = build_dataset(cfg, np.random.default_rng(0))
        ds.x_train[ds.client_train[n - 1]]  # read one client
        held[n] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert len(ds.client_train) == n and len(ds.x_train) >= n
    assert held[1_000_000] < held[100] + 64 * 1024  # no per-client table


def test_materialize_false_needs_synthetic_natural():
    with pytest.raises(ConfigError, match="dataset.materialize"):
        DatasetConfig(materialize=False)  # iid
    with pytest.raises(ConfigError, match="dataset.materialize"):
        DatasetConfig(materialize=False, name="digits", partition="iid")


def test_on_demand_shards_are_sticky_without_drawing_every_size(monkeypatch):
    """client_costs would draw all N sizes (O(N) once per run): an on-demand population
    gets None (count-balanced, sticky shards); a materialised one keeps its costs."""
    from algorithms import build_pipeline
    from engine.config import AlgoConfig
    from engine.data.on_demand import OnDemandClientIndex
    from engine.federated.client import LocalSpec, client_costs

    spec = LocalSpec(
        seed=0, model_name="logreg", epochs=2, batch_size=10, lr=0.1, lr_decay=1.0,
        momentum=0.0, weight_decay=0.0,
        pipeline=build_pipeline("dp_fedavg", AlgoConfig(), 1.0, 0.0, "logreg"),
    )  # fmt: skip
    full = build_dataset(DatasetConfig(**KW), np.random.default_rng(2))
    np.testing.assert_allclose(client_costs(full, spec), 2 * full.client_sizes() + 10)

    def boom(self):
        raise AssertionError("drew every client's size")

    monkeypatch.setattr(OnDemandClientIndex, "sizes", boom)
    lazy = build_dataset(DatasetConfig(materialize=False, **KW), np.random.default_rng(2))
    assert client_costs(lazy, spec) is None


def test_on_demand_rows_keep_the_index_shape():
    """A vectorised group reads a (clients, batch) matrix of global indices at once: the
    rows come back in that shape, each equal to the row read alone."""
    ds = build_dataset(DatasetConfig(materialize=False, **KW), np.random.default_rng(3))
    idx = np.stack([ds.client_train[k][:3] for k in (2, 9, 31, 2)])  # (4, 3), a repeat
    x, y = ds.x_train[idx], ds.y_train[idx]
    assert x.shape == (4, 3, ds.x_train.shape[1]) and y.shape == (4, 3)
    for i, j in np.ndindex(*idx.shape):
        assert np.array_equal(x[i, j], ds.x_train[idx[i, j]])
        assert y[i, j] == ds.y_train[int(idx[i, j])]


# A cohort of ~40 clients per worker's shard: the automatic choice (groups of >= 16 on
# the CPU) vectorises, as an explicit group size does.
ON_DEMAND_RUN = [
    "dataset.materialize=false",
    "dataset.partition=natural",
    "dataset.num_clients=400",
    "dataset.public_eval_clients=20",
    "dataset.synthetic_mean_samples=6",
    "dataset.synthetic_dim=12",
    "sampling.rate=0.2",
    "rounds=2",
    "local.batch_size=4",
    "privacy.noise_multiplier=1.0",
    "ray.num_workers=2",
]


@pytest.mark.parametrize("model", ["logreg", "mlp"])
@pytest.mark.parametrize("group", ["null", "8"])
def test_on_demand_with_vectorised_groups_equals_one_by_one(monkeypatch, model, group):
    """The on-demand path with grouping on (the default: dense models train in groups
    of engine.federated.dense_training; an explicit size: vmap groups) trains the
    clients one-by-one training does, to float32 rounding (the tolerance of
    tests/engine/test_vectorized.py), and groups really ran."""
    from engine.config import load_config
    from engine.federated.dense_training import DenseSGDTrainer
    from engine.federated.group_training import VectorizedTrainer
    from engine.simulation import simulate

    groups: list[int] = []
    train_group, dense_group = VectorizedTrainer.train_group, DenseSGDTrainer._group

    def counted(self, global_flat, rnd, clients, public):
        groups.append(len(clients))
        return train_group(self, global_flat, rnd, clients, public)

    def dense_counted(self, batches, *args):
        groups.append(len(batches))
        return dense_group(self, batches, *args)

    monkeypatch.setattr(VectorizedTrainer, "train_group", counted)
    monkeypatch.setattr(DenseSGDTrainer, "_group", dense_counted)
    base = [*ON_DEMAND_RUN, f"model.name={model}", "ray.executor=local"]
    grouped = simulate(load_config(overrides=[*base, f"ray.clients_per_worker_batch={group}"]),
                       write=False)  # fmt: skip
    assert groups and max(groups) > 1
    del groups[:]
    one = simulate(load_config(overrides=[*base, "ray.clients_per_worker_batch=1"]), write=False)
    assert not groups
    np.testing.assert_allclose(grouped.weights, one.weights, rtol=1e-4, atol=1e-5)
    cols = ["cohort_size", "epsilon", "clipped_fraction_nonprivate"]
    assert grouped.rounds[cols].equals(one.rounds[cols])


@pytest.mark.ray
def test_on_demand_with_vectorised_groups_on_ray_equals_in_process(ray_session):
    """Ray workers build the on-demand clients themselves (the population travels without
    its cache) and train them in groups (the default): bit for bit the in-process run."""
    from engine.config import load_config
    from engine.simulation import simulate

    base = [*ON_DEMAND_RUN, "model.name=mlp", "ray.num_cpus_per_worker=1"]
    local = simulate(load_config(overrides=[*base, "ray.executor=local"]), write=False)
    on_ray = simulate(load_config(overrides=[*base, "ray.executor=ray"]), write=False)
    assert np.array_equal(local.weights, on_ray.weights)
    cols = ["epsilon", "test_accuracy", "realised_cohort_size_nonprivate"]
    assert local.rounds[cols].equals(on_ray.rounds[cols])
