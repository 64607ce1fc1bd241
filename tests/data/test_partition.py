"""Tests for engine.data.partition, split_client_test, generate_synthetic, build_dataset."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import DatasetConfig
from engine.data import build_dataset, load_pooled
from engine.data.federated import split_client_test
from engine.data.partition import dirichlet_partition, iid_partition, natural_partition
from engine.data.synthetic import generate_synthetic


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    """Every index in [0, n) appears in exactly one part; parts are sorted int64."""
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)
    allidx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(allidx), np.arange(n))


def max_class_fraction(labels: np.ndarray, parts: list[np.ndarray], k: int) -> float:
    return float(np.mean([np.bincount(labels[p], minlength=k).max() / len(p) for p in parts]))


# ------------------------------------------------------------------------ iid


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_iid_partition_exact_cover_and_balanced(n, data, seed):
    k = data.draw(st.integers(1, n))
    parts = iid_partition(n, k, np.random.default_rng(seed))
    assert len(parts) == k
    assert_exact_cover(parts, n)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_partition_is_random_and_seeded():
    a = iid_partition(1000, 10, np.random.default_rng(0))
    b = iid_partition(1000, 10, np.random.default_rng(0))
    c = iid_partition(1000, 10, np.random.default_rng(1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    # A shuffle, not contiguous blocks: client 0 spans the whole range.
    assert a[0].max() - a[0].min() > 500


@pytest.mark.parametrize("k", [0, 11])
def test_iid_partition_errors_name_key(k):
    with pytest.raises(ValueError, match="dataset.num_clients"):
        iid_partition(10, k, np.random.default_rng(0))


# ------------------------------------------------------------------ dirichlet


LABELS = np.repeat(np.arange(10), 200)  # 2000 examples, 10 balanced classes


@pytest.mark.parametrize("alpha", [0.1, 1.0, 1000.0])
def test_dirichlet_partition_exact_cover(alpha):
    parts = dirichlet_partition(LABELS, 20, alpha, np.random.default_rng(3))
    assert len(parts) == 20
    assert_exact_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 1


def test_dirichlet_small_alpha_is_label_skewed_large_alpha_is_uniform():
    skewed = [
        max_class_fraction(
            LABELS, dirichlet_partition(LABELS, 20, 0.1, np.random.default_rng(s)), 10
        )
        for s in range(5)
    ]
    uniform = [
        max_class_fraction(
            LABELS, dirichlet_partition(LABELS, 20, 1000.0, np.random.default_rng(s)), 10
        )
        for s in range(5)
    ]
    iid = max_class_fraction(LABELS, iid_partition(len(LABELS), 20, np.random.default_rng(0)), 10)
    assert np.mean(skewed) > 0.55
    assert np.mean(uniform) < 0.2
    assert iid < 0.2
    # Large alpha also gives near-equal client sizes (proportions ≈ 1/K per class).
    sizes = [len(p) for p in dirichlet_partition(LABELS, 20, 1000.0, np.random.default_rng(0))]
    assert max(sizes) < 1.5 * min(sizes)


def test_dirichlet_min_size_respected():
    for s in range(3):
        parts = dirichlet_partition(LABELS, 20, 0.3, np.random.default_rng(s), min_size=30)
        assert min(len(p) for p in parts) >= 30
        assert_exact_cover(parts, len(LABELS))


def test_dirichlet_errors_name_keys():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="dataset.alpha"):
        dirichlet_partition(LABELS, 10, 0.0, rng)
    with pytest.raises(ValueError, match="dataset.num_clients"):
        dirichlet_partition(LABELS[:50], 51, 1.0, rng)
    with pytest.raises(ValueError, match="dataset.num_clients"):
        dirichlet_partition(LABELS[:100], 10, 1.0, rng, min_size=11)
    # Unsatisfiable in a few draws: the message names both knobs.
    with pytest.raises(ValueError, match="dataset.alpha=0.01 with dataset.num_clients=50"):
        dirichlet_partition(np.repeat(np.arange(10), 10), 50, 0.01, rng, min_size=2, max_tries=3)


# -------------------------------------------------------------------- natural


def test_natural_partition_order_of_first_appearance():
    groups = np.array([5, 5, 2, 9, 2, 5, 7, 9])
    parts = natural_partition(groups)
    expected = [[0, 1, 5], [2, 4], [3, 7], [6]]
    assert [p.tolist() for p in parts] == expected
    assert_exact_cover(parts, len(groups))
    # Truncation keeps the first groups to appear.
    assert [p.tolist() for p in natural_partition(groups, 2)] == expected[:2]
    assert [p.tolist() for p in natural_partition(groups, 4)] == expected
    with pytest.raises(ValueError, match="dataset.num_clients=5"):
        natural_partition(groups, 5)


def test_natural_partition_string_groups():
    groups = np.array(["w9", "w1", "w9", "w3", "w1"])
    parts = natural_partition(groups)
    assert [p.tolist() for p in parts] == [[0, 2], [1, 4], [3]]
    for p in parts:
        assert len(set(groups[p])) == 1


# ---------------------------------------------------------- split_client_test


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=12),
    fraction=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_client_test_properties(sizes, fraction, seed):
    offsets = np.cumsum([0, *sizes])
    clients = [np.arange(offsets[i], offsets[i + 1], dtype=np.int64) for i in range(len(sizes))]
    train, test = split_client_test(clients, fraction, np.random.default_rng(seed))
    assert len(train) == len(test) == len(clients)
    for ix, tr, te in zip(clients, train, test):
        n = len(ix)
        assert len(np.intersect1d(tr, te)) == 0
        assert np.array_equal(np.sort(np.concatenate([tr, te])), ix)
        assert np.all(np.diff(tr) > 0) and np.all(np.diff(te) > 0)
        if n >= 1:
            assert len(tr) >= 1
        # floor(fraction * n), except that one training example is always kept.
        assert len(te) <= fraction * n + 1e-9
        assert len(te) > fraction * n - 1 or len(te) == n - 1


def test_split_client_test_is_random():
    clients = [np.arange(1000, dtype=np.int64)]
    _, te = split_client_test(clients, 0.2, np.random.default_rng(0))
    assert len(te[0]) == 200
    assert te[0].max() - te[0].min() > 800  # drawn uniformly, not a tail slice


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_split_client_test_error_names_key(fraction):
    with pytest.raises(ValueError, match="dataset.client_test_fraction"):
        split_client_test([np.arange(5)], fraction, np.random.default_rng(0))


# ------------------------------------------------------------------ synthetic


def test_generate_synthetic_shapes_and_standardisation():
    k, dim, classes = 30, 20, 5
    pooled = generate_synthetic(k, np.random.default_rng(0), dim=dim, num_classes=classes)
    n = len(pooled.y_train)
    assert pooled.x_train.shape == (n, dim) and pooled.x_train.dtype == np.float32
    assert pooled.y_train.dtype == np.int64
    assert pooled.y_train.min() >= 0 and pooled.y_train.max() < classes
    assert len(np.unique(pooled.y_train)) > 1
    assert pooled.num_classes == classes and tuple(pooled.input_shape) == (dim,)
    assert len(pooled.y_test) == 0 and pooled.x_test.shape == (0, dim)
    counts = np.bincount(pooled.groups)
    assert len(counts) == k
    assert counts.min() >= 4
    assert counts.sum() == n
    # Groups are contiguous blocks (client 0 first, ...).
    assert np.all(np.diff(pooled.groups) >= 0)
    # Standardised with the generator's constants (not the data's): the features of
    # the whole population have mean ~0 and variance ~1, within sampling error.
    many = generate_synthetic(4000, np.random.default_rng(1), dim=dim, mean_samples=4)
    x = many.x_train.astype(np.float64)
    # Client offsets B_k ~ N(0, 1) dominate: the mean's standard error is ~ sqrt(0.5/4000).
    assert np.abs(x.mean(0)).max() < 5 * np.sqrt(0.5 / 4000)
    np.testing.assert_allclose(x.var(0), 1.0, atol=0.1)


def test_synthetic_client_does_not_change_other_clients():
    """Issue 13 item 4: one client's data must not change any other client's features
    (the old recipe standardised with the statistics of all clients)."""
    kw = {"dim": 15, "num_classes": 4, "mean_samples": 10}
    full = generate_synthetic(30, np.random.default_rng(7), **kw)
    fewer = generate_synthetic(29, np.random.default_rng(7), **kw)  # client 29 removed
    more = generate_synthetic(31, np.random.default_rng(7), **kw)
    for other in (fewer, more):
        for k in range(29):
            a, b = full.groups == k, other.groups == k
            assert np.array_equal(full.x_train[a], other.x_train[b])
            assert np.array_equal(full.y_train[a], other.y_train[b])


def test_generate_synthetic_error_names_key():
    with pytest.raises(ValueError, match="dataset.num_clients"):
        generate_synthetic(0, np.random.default_rng(0))


# -------------------------------------------------------------- build_dataset


def synthetic_cfg(partition: str, **kw) -> DatasetConfig:
    return DatasetConfig(
        name="synthetic",
        num_clients=50,
        partition=partition,
        synthetic_dim=20,
        synthetic_mean_samples=30,
        **kw,
    )


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "natural"])
def test_build_dataset_synthetic(partition):
    cfg = synthetic_cfg(partition)
    ds = build_dataset(cfg, np.random.default_rng(11))
    n = len(ds.y_train)
    assert ds.num_clients == 50
    assert ds.meta["partition"] == partition
    assert ds.input_shape == (20,)
    # Train and held-out splits partition all pooled examples exactly once.
    assert_exact_cover(list(ds.client_train) + list(ds.client_test), n)
    for tr, te in zip(ds.client_train, ds.client_test):
        assert len(tr) >= 1
        assert len(np.intersect1d(tr, te)) == 0
    # The global test set is public: exactly the examples of the held-out synthetic
    # clients N..N+K-1 (K = ceil(N/10) = 5), none of which belongs to the population.
    assert ds.meta["eval_source"] == "public: 5 held-out clients"
    pooled = generate_synthetic(
        50, np.random.default_rng(11), dim=20, mean_samples=30, public_clients=5
    )  # what build_dataset draws first from the same rng
    public = pooled.groups >= 50
    assert np.array_equal(ds.x_test, pooled.x_train[public])
    assert np.array_equal(ds.y_test, pooled.y_train[public])
    assert np.array_equal(ds.x_train, pooled.x_train[~public])

    if partition == "natural":
        # Client k holds exactly the examples generated for synthetic client k.
        groups = load_pooled(cfg, np.random.default_rng(11)).groups
        for k, (tr, te) in enumerate(zip(ds.client_train, ds.client_test)):
            assert np.array_equal(np.sort(np.concatenate([tr, te])), np.flatnonzero(groups == k))


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "natural"])
def test_build_dataset_is_seeded(partition):
    cfg = synthetic_cfg(partition)
    a = build_dataset(cfg, np.random.default_rng(5))
    b = build_dataset(cfg, np.random.default_rng(5))
    c = build_dataset(cfg, np.random.default_rng(6))
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_train, b.y_train)
    assert np.array_equal(a.x_test, b.x_test) and np.array_equal(a.y_test, b.y_test)
    for p, q in zip(a.client_train + a.client_test, b.client_train + b.client_test):
        assert np.array_equal(p, q)
    assert a.x_train.shape != c.x_train.shape or not np.array_equal(a.x_train, c.x_train)
    assert not all(
        len(p) == len(q) and np.array_equal(p, q) for p, q in zip(a.client_train, c.client_train)
    )


def test_public_eval_clients_never_depend_on_the_population():
    """Issue 13 item 3: the synthetic test set is public: it holds no client's data,
    so changing the population (here its size) leaves it bit-identical, and clients
    may hold nothing out."""
    a = build_dataset(
        synthetic_cfg("natural", public_eval_clients=3, client_test_fraction=0.0),
        np.random.default_rng(4),
    )
    b = build_dataset(
        DatasetConfig(
            name="synthetic",
            num_clients=20,
            partition="natural",
            synthetic_dim=20,
            synthetic_mean_samples=30,
            public_eval_clients=3,
        ),
        np.random.default_rng(4),
    )
    assert len(a.y_test) > 0 and all(len(t) == 0 for t in a.client_test)
    assert np.array_equal(a.x_test, b.x_test) and np.array_equal(a.y_test, b.y_test)
    rows = {r.tobytes() for r in a.x_train}
    assert not any(r.tobytes() in rows for r in a.x_test)  # disjoint from every client
    assert np.array_equal(a.x_train[: len(b.x_train)], b.x_train)  # clients 0..19 shared


def test_public_eval_clients_must_leave_a_population():
    with pytest.raises(ValueError, match="dataset.public_eval_clients"):
        DatasetConfig(name="synthetic", public_eval_clients=0)


def _linear_fit_accuracy(pooled, public_from: int) -> tuple[float, float]:
    """Least-squares one-hot linear classifier fit on the population's examples, scored
    on the public clients; returns (accuracy, majority-class share) there."""
    own = pooled.groups < public_from
    x = np.c_[pooled.x_train, np.ones(len(pooled.x_train))]
    onehot = np.eye(pooled.num_classes)[pooled.y_train[own]]
    coef, *_ = np.linalg.lstsq(x[own], onehot, rcond=None)
    y_pub = pooled.y_train[~own]
    acc = float(np.mean(np.argmax(x[~own] @ coef, axis=1) == y_pub))
    return acc, float(np.bincount(y_pub).max() / len(y_pub))


def test_shared_synthetic_rule_generalises_to_public_clients_per_client_does_not():
    """``shared``: one labelling rule, so a linear model fit on the population beats the
    majority class on held-out public clients by far; ``per_client`` (as published):
    each client's rule is its own, so the same fit stays near the majority class."""
    kw = dict(dim=20, num_classes=5, mean_samples=30, public_clients=40)
    shared = generate_synthetic(200, np.random.default_rng(3), model="shared", **kw)
    acc, majority = _linear_fit_accuracy(shared, 200)
    assert acc > majority + 0.2, (acc, majority)
    per_client = generate_synthetic(200, np.random.default_rng(3), model="per_client", **kw)
    acc, majority = _linear_fit_accuracy(per_client, 200)
    assert acc < majority + 0.1, (acc, majority)
    with pytest.raises(ValueError, match="dataset.synthetic_model='iid'"):
        generate_synthetic(5, np.random.default_rng(0), model="iid")
