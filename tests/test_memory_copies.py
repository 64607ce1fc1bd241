"""Issue 30, item 4: the copies of the examples that the 10^6-client run's driver held
(heap + object store, 2.43 × the data) stay gone.

A materialised synthetic population is generated straight into shared memory
(engine.data.shared), and the Ray pool sends it by reference: the driver, its server and
the workers all read the one segment. Asserted as properties of the arrays (which
memory they lie in, what they share), not as timings or RSS.
"""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys

import numpy as np
import pytest

from engine.config import load_config
from engine.data import build_dataset, shared
from engine.data.synthetic import generate_synthetic

pytestmark = pytest.mark.skipif(not shared.available(), reason="needs os.memfd_create")


def _dataset(num_clients: int = 3000, *more: str):
    cfg = load_config(
        overrides=[
            f"dataset.num_clients={num_clients}",
            "dataset.synthetic_mean_samples=8",
            *more,
        ]
    )
    return build_dataset(cfg.dataset, np.random.default_rng(1))


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_shared_generation_gives_the_heap_values():
    kw = dict(public_clients=40, mean_samples=8)
    heap = generate_synthetic(1500, np.random.default_rng(0), **kw)
    mem = generate_synthetic(1500, np.random.default_rng(0), shared=True, **kw)
    for name in ("x_train", "y_train", "groups"):
        a, b = getattr(heap, name), getattr(mem, name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b), name
    assert shared.segment_of(heap.x_train) is None
    assert shared.segment_of(mem.x_train) is not None
    assert shared.segment_of(mem.y_train) is not None


def test_natural_partition_of_contiguous_groups_matches_the_definition():
    """The synthetic layout (non-decreasing groups) takes a path without np.unique's
    sort and temporaries; its result is the general definition's, dtypes included."""
    from engine.data.partition import natural_partition

    rng = np.random.default_rng(3)
    for _ in range(50):
        ids = np.sort(np.cumsum(rng.integers(1, 3, rng.integers(1, 20))) - 5)
        groups = np.repeat(ids, rng.integers(1, 5, len(ids)))
        for k in (None, 1, len(ids)):
            got = natural_partition(groups, k)
            want = [np.flatnonzero(groups == g) for g in ids[: len(ids) if k is None else k]]
            assert got.flat.dtype == np.int64 and got.offsets.dtype == np.int64
            assert [a.tolist() for a in got] == [a.tolist() for a in want]
    with pytest.raises(ValueError, match="exceeds"):
        natural_partition(np.array([0, 0, 1]), 3)


def test_shared_rows_grow_without_losing_rows():
    rows = shared.SharedRows(4, (3,), np.float32, np.int64)
    for start in range(0, 40, 5):  # many growths past the first capacity
        rows.reserve(start + 5)
        x, y = rows.views(start, start + 5)
        x[:] = np.arange(start, start + 5, dtype=np.float32)[:, None]
        y[:] = np.arange(start, start + 5)
        del x, y  # a mapping with views exported cannot move
    x, y = rows.finish(40)
    assert np.array_equal(y, np.arange(40))
    assert np.array_equal(x[:, 2], np.arange(40, dtype=np.float32))
    assert len(shared.segment_of(x)) == 40 * 3 * 4  # shrunk: the tail is freed


def test_the_public_test_set_is_the_segments_tail_not_a_copy():
    ds = _dataset()
    seg = shared.segment_of(ds.x_train)
    assert seg is not None and shared.segment_of(ds.x_test) is seg
    assert shared.segment_of(ds.y_test) is shared.segment_of(ds.y_train)
    # x_test starts where x_train ends: both are views of the one array
    end = ds.x_train.ctypes.data + ds.x_train.nbytes
    assert ds.x_test.ctypes.data == end


@pytest.mark.parametrize("partition", ["iid", "natural"])
def test_by_reference_pickles_handles_and_shares_memory_in_process(partition):
    ds = _dataset(3000, f"dataset.partition={partition}", "dataset.client_test_fraction=0.25")
    with shared.by_reference():
        blob = pickle.dumps(ds, protocol=5)
    by_value = pickle.dumps(ds, protocol=5)  # off: values, as before (files, Tune)
    assert len(by_value) > ds.x_train.nbytes
    assert len(blob) < ds.x_train.nbytes // 10  # only the client indices travel
    back = pickle.loads(blob)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert np.shares_memory(getattr(back, name), getattr(ds, name)), name
    for name in ("client_train", "client_test"):  # the flat indices too
        assert shared.segment_of(getattr(ds, name).flat) is not None, name
        assert np.shares_memory(getattr(back, name).flat, getattr(ds, name).flat), name
    assert back.num_clients == ds.num_clients
    assert np.array_equal(back.client_sizes(), ds.client_sizes())


def test_another_process_maps_the_same_segment_read_only():
    ds = _dataset()
    with shared.by_reference():
        blob = pickle.dumps(ds, protocol=5)
    code = (
        "import pickle, sys, hashlib, numpy as np\n"
        "from engine.data import shared\n"
        "d = pickle.loads(sys.stdin.buffer.read())\n"
        "h = hashlib.sha1()\n"
        "for a in (d.x_train, d.y_train, d.x_test, d.y_test):\n"
        "    h.update(np.ascontiguousarray(a).tobytes())\n"
        "seg = shared.segment_of(d.x_train)\n"
        "print(h.hexdigest(), d.x_train.flags.writeable, seg is not None,"
        " shared.segment_of(d.x_test) is seg)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, check=True
    ).stdout.split()
    assert out == [
        _digest(ds.x_train, ds.y_train, ds.x_test, ds.y_test).encode(),
        b"False",  # read-only: a worker cannot change the driver's examples
        b"True",  # mapped from the segment, not a copy received through the pickle
        b"True",  # one mapping for the population and the public test set
    ]


def test_a_handle_to_someone_elses_segment_is_refused():
    ds = _dataset(500)
    with shared.by_reference():
        view = shared.reference(ds.x_train)
    assert isinstance(view, shared.SharedView)
    wrong = shared.SharedView(**{**view.__dict__, "token": "0" * 16})
    with pytest.raises(RuntimeError, match="one machine"):
        wrong.resolve()


@pytest.mark.ray
def test_ray_put_by_reference_reaches_workers_without_a_store_copy(ray_session):
    ray = ray_session
    from engine.runtime.driver_server import single_machine

    ds = _dataset()
    assert single_machine()
    with shared.by_reference(single_machine()):
        ref = ray.put(ds)
    here = ray.get(ref)  # the driver's server reads this: the same pages, not a store copy
    assert np.shares_memory(here.x_train, ds.x_train)

    @ray.remote(num_cpus=0)
    def read(d):  # self-contained: a Ray worker may not import this test module
        import hashlib

        import numpy as np

        from engine.data import shared

        h = hashlib.sha1()
        for a in (d.x_train, d.y_train, d.x_test, d.y_test):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest(), shared.segment_of(d.x_train) is not None

    assert ray.get(read.remote(ref)) == (
        _digest(ds.x_train, ds.y_train, ds.x_test, ds.y_test),
        True,
    )


def test_iid_partition_in_shared_memory_is_the_same_partition():
    from engine.data.partition import iid_partition

    for n, k in ((1, 1), (10, 3), (100_003, 777), (3_000_000, 1000)):  # > one 2^20 chunk
        heap = iid_partition(n, k, np.random.default_rng(n))
        mem = iid_partition(n, k, np.random.default_rng(n), shared=True)
        assert shared.segment_of(mem.flat) is not None
        assert np.array_equal(heap.flat, mem.flat) and mem.flat.dtype == heap.flat.dtype
        assert np.array_equal(heap.offsets, mem.offsets)


@pytest.mark.parametrize("fraction", [0.0, 0.1])  # 0.1 of clients of < 10: nothing held out
@pytest.mark.parametrize("sort_input", [True, False])
def test_a_split_that_holds_nothing_out_is_the_index_itself(monkeypatch, fraction, sort_input):
    """No draws and no copy when nothing is held out: the same result as the per-client
    permutations sorted back (forced here by declaring the index unsorted)."""
    from engine.data import federated

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 10, 500)
    perm = rng.permutation(int(sizes.sum()))
    parts = np.split(perm, np.cumsum(sizes)[:-1])
    parts = [np.sort(p) if sort_input else p for p in parts]
    fast = federated.split_client_test(parts, fraction, np.random.default_rng(1))
    monkeypatch.setattr(federated, "_segments_sorted", lambda index: False)
    slow = federated.split_client_test(parts, fraction, np.random.default_rng(1))
    monkeypatch.undo()
    for a, b in zip(fast, slow):
        assert np.array_equal(a.flat, b.flat) and a.flat.dtype == b.flat.dtype
        assert np.array_equal(a.offsets, b.offsets)
    index = federated.ClientIndex.from_arrays(parts)
    train, _ = federated.split_client_test(index, fraction, np.random.default_rng(1))
    assert np.shares_memory(train.flat, index.flat) == sort_input  # no copy when sorted
    shared_train, _ = federated.split_client_test(
        index, fraction, np.random.default_rng(1), shared=True
    )
    assert shared.segment_of(shared_train.flat) is not None
