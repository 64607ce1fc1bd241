"""engine.data.federated.ClientIndex and the vectorised partitions: the compact index
holds exactly what the per-client lists held, and every partition draws from ``rng`` as
the earlier per-client loops did (those loops are kept here as the reference)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.federated import ClientIndex, FederatedDataset, split_client_test
from engine.data.partition import dirichlet_partition, iid_partition, natural_partition

# --------------------------------------------------- the earlier loops (reference)


def iid_reference(n, k, rng):
    perm = rng.permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, k)]


def dirichlet_reference(labels, k, alpha, rng, min_size=1, max_tries=100):
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(k)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(k, alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(np.int64)[:-1]
            for j, chunk in enumerate(np.split(idx, cuts)):
                parts[j].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ValueError("max_tries")


def natural_reference(groups, k=None):
    _, first = np.unique(groups, return_index=True)
    order = groups[np.sort(first)]
    if k is not None:
        order = order[:k]
    return [np.flatnonzero(groups == g).astype(np.int64) for g in order]


def split_reference(client_indices, fraction, rng):
    train, test = [], []
    for ix in client_indices:
        ix = np.asarray(ix, dtype=np.int64)
        perm = rng.permutation(len(ix))
        n_test = min(int(np.floor(fraction * len(ix))), max(len(ix) - 1, 0))
        test.append(np.sort(ix[perm[:n_test]]))
        train.append(np.sort(ix[perm[n_test:]]))
    return train, test


def same(index, lists) -> bool:
    return len(index) == len(lists) and all(
        a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(index, lists)
    )


# ------------------------------------------------------------------- ClientIndex


def test_client_index_round_trip_views_and_pickle():
    arrays = [np.array([3, 5, 9]), np.zeros(0, np.int64), np.array([0]), np.array([1, 2])]
    index = ClientIndex.from_arrays(arrays)
    assert same(index, [a.astype(np.int64) for a in arrays])
    assert np.array_equal(index.sizes(), [3, 0, 1, 2])
    assert np.array_equal(index[-1], [1, 2]) and len(index[1]) == 0
    assert index[0].base is not None and not index[0].flags.writeable  # a view, read-only
    with pytest.raises(IndexError):
        index[4]
    assert same(pickle.loads(pickle.dumps(index)), list(index))
    assert [len(a) for a in index + index] == [3, 0, 1, 2] * 2  # list semantics of +


def test_client_index_costs_bytes_not_objects():
    n = 100_000
    index = ClientIndex.from_owners(np.arange(n) // 8, np.arange(n), n // 8)
    assert index.flat.nbytes + index.offsets.nbytes <= 8 * n + 8 * (n // 8 + 1)


def test_dataset_compacts_lists_and_sizes_come_from_offsets():
    x, y = np.zeros((6, 2), np.float32), np.zeros(6, np.int64)
    train = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5])]
    ds = FederatedDataset("toy", x, y, train, [np.zeros(0, np.int64)] * 3, x, y, 2, (2,))
    assert isinstance(ds.client_train, ClientIndex) and ds.num_clients == 3
    assert np.array_equal(ds.client_sizes(), [3, 1, 2]) and ds.client_sizes().dtype == np.int64


# --------------------------------------------------- partitions equal the loops


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2000), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_iid_partition_equals_the_loop(n, data, seed):
    k = data.draw(st.integers(1, n))
    ours = iid_partition(n, k, np.random.default_rng(seed))
    assert same(ours, iid_reference(n, k, np.random.default_rng(seed)))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(20, 1500),
    classes=st.integers(1, 6),
    k=st.integers(1, 12),
    alpha=st.sampled_from([0.05, 0.3, 1.0, 50.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_partition_equals_the_loop(n, classes, k, alpha, seed):
    labels = np.random.default_rng(seed).integers(0, classes, n)
    try:
        ref = dirichlet_reference(labels, k, alpha, np.random.default_rng(seed))
    except ValueError:
        with pytest.raises(ValueError):
            dirichlet_partition(labels, k, alpha, np.random.default_rng(seed))
        return
    assert same(dirichlet_partition(labels, k, alpha, np.random.default_rng(seed)), ref)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 800), g=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_natural_partition_equals_the_loop(n, g, seed):
    groups = np.random.default_rng(seed).integers(0, g, n) * 7 - 3  # unsorted ids
    have = len(np.unique(groups))
    for k in (None, 1, have):
        assert same(natural_partition(groups, k), natural_reference(groups, k))
    strings = np.array([f"w{v}" for v in groups])
    assert same(natural_partition(strings), natural_reference(strings))


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=40),
    fraction=st.sampled_from([0.0, 0.1, 0.2, 0.5, 0.9]),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_client_test_equals_the_loop(sizes, fraction, seed):
    perm = np.random.default_rng(seed).permutation(sum(sizes))
    clients = np.split(perm, np.cumsum(sizes)[:-1])
    g1, g2 = np.random.default_rng(seed), np.random.default_rng(seed)
    train, test = split_client_test(clients, fraction, g1)
    ref_train, ref_test = split_reference(clients, fraction, g2)
    assert same(train, ref_train) and same(test, ref_test)
    held = any(min(int(fraction * len(c)), max(len(c) - 1, 0)) > 0 for c in clients)
    if held or not all(np.all(np.diff(c) >= 0) for c in clients):
        assert g1.random() == g2.random()  # the same draws were consumed
    else:  # nothing held out of sorted clients: the index is returned, rng left alone
        assert g1.random() == np.random.default_rng(seed).random()


def test_sort_segments_chunked_equals_sorting_each_client():
    from engine.data.federated import sort_segments

    g = np.random.default_rng(0)
    sizes = g.integers(0, 6, 50)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    values = g.permutation(int(offsets[-1])).astype(np.int64)
    want = [np.sort(values[offsets[k] : offsets[k + 1]]) for k in range(50)]
    sort_segments(values, offsets, chunk=3)
    assert same(ClientIndex(values, offsets), want)


def test_split_client_test_over_several_chunks_equals_the_loop():
    n = 140_000  # more clients than one chunk of 65536
    clients = iid_partition(3 * n, n, np.random.default_rng(2))
    train, test = split_client_test(clients, 0.4, np.random.default_rng(3))
    ref_train, ref_test = split_reference(list(clients), 0.4, np.random.default_rng(3))
    assert same(train, ref_train) and same(test, ref_test)
