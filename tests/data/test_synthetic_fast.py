"""The chunked Synthetic(α, β) generator reproduces the per-client loop it replaced bit
for bit (that loop is kept here as the reference), and its vectorised SeedSequence ->
PCG64 seeding equals numpy's."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data.synthetic import SyntheticGenerator, _pcg64_states, generate_synthetic


def reference_synthetic(num_clients, rng, *, alpha=1.0, beta=1.0, dim=60, num_classes=10,
                        mean_samples=60, public_clients=0, model="shared"):  # fmt: skip
    seed = int(rng.integers(0, 2**63 - 1))
    shared = None
    if model == "shared":
        g0 = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(2, 0)))
        shared = (g0.normal(0.0, 1.0, (num_classes, dim)), g0.normal(0.0, 1.0, num_classes))
    cov_diag = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2)
    scale = np.sqrt(beta + 1.0 + cov_diag)
    xs, ys, owners = [], [], []
    keys = [(0, k) for k in range(num_clients)] + [(1, j) for j in range(public_clients)]
    for k, key in enumerate(keys):
        g = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))
        size = int(np.clip(g.lognormal(np.log(mean_samples), 0.5), 4, 20 * mean_samples))
        u_k = g.normal(0.0, np.sqrt(alpha))
        b_mean = g.normal(0.0, np.sqrt(beta))
        if shared is None:
            w = g.normal(u_k, 1.0, (num_classes, dim))
            b = g.normal(u_k, 1.0, num_classes)
        else:
            w, b = shared[0] + u_k, shared[1] + u_k
        v = g.normal(b_mean, 1.0, dim)
        x = g.normal(v, np.sqrt(cov_diag), (size, dim))
        y = np.argmax(x @ w.T + b, axis=1)
        xs.append((x / scale).astype(np.float32))
        ys.append(y.astype(np.int64))
        owners.append(np.full(size, k, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(owners)


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32 + 5, 2**63 - 2, 8716235418726354123])
@pytest.mark.parametrize("stream", [0, 1, 2])
def test_pcg64_states_equal_numpys_seeding(seed, stream):
    ks = np.array([0, 1, 2, 255, 65536, 999_999, 2**32 - 1])
    for k, (state, inc) in zip(ks, _pcg64_states(seed, stream, ks)):
        want = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream, int(k)))).state
        assert want["state"] == {"state": state, "inc": inc}
    with pytest.raises(ValueError):
        _pcg64_states(seed, stream, np.array([2**32]))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"model": "per_client", "alpha": 0.5, "beta": 0.3},
        {"mean_samples": 4, "dim": 7, "num_classes": 3, "beta": 2.0},
        {"mean_samples": 30, "public_clients": 9, "alpha": 0.0},
        {"model": "per_client", "public_clients": 4, "dim": 5, "num_classes": 2},
    ],
)
@pytest.mark.parametrize("seed", [0, 3])
def test_generate_synthetic_equals_the_per_client_loop(kw, seed):
    ours = generate_synthetic(57, np.random.default_rng(seed), **kw)
    x, y, owners = reference_synthetic(57, np.random.default_rng(seed), **kw)
    assert ours.x_train.dtype == np.float32 and ours.y_train.dtype == np.int64
    assert np.array_equal(ours.x_train, x) and np.array_equal(ours.y_train, y)
    assert ours.groups is not None and np.array_equal(ours.groups, owners)


@pytest.mark.parametrize("chunk_values", [1, 700, 5000])
def test_chunking_and_growth_change_nothing(chunk_values):
    """Chunks flushed after every client, or a few clients, and outputs grown many times."""
    gen = SyntheticGenerator(12345, mean_samples=20, dim=9, num_classes=4)
    segments = [(0, np.arange(40)), (1, np.arange(6)), (0, np.array([7, 3]))]
    x, y, sizes = gen.clients(segments, chunk_values=chunk_values)
    ref = gen.clients(segments, chunk_values=1 << 20)
    assert np.array_equal(x, ref[0]) and np.array_equal(y, ref[1])
    assert np.array_equal(sizes, ref[2]) and len(y) == sizes.sum()
    alone = [gen.client_sizes(0, np.arange(40)), gen.client_sizes(1, np.arange(6))]
    assert np.array_equal(sizes[:46], np.concatenate(alone))
    # clients 7 and 3, generated again at the end, are the same examples
    ends = np.cumsum(sizes)
    assert np.array_equal(x[ends[45] :][: sizes[46]], x[ends[6] : ends[7]])
    assert np.array_equal(x[ends[46] :], x[ends[2] : ends[3]])
