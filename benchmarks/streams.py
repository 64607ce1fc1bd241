"""The engine's random streams, re-implemented for the plain reference loop.

:mod:`benchmarks.reference_loop` imports nothing from ``engine.privacy.rng``: these
functions follow ``engine/privacy/rng.py``'s recipe (a ``numpy.random.SeedSequence``
over ``(seed, stream, round[, client])``) so that the loop draws the engine's cohorts,
minibatch orders and server noise from its own code, and ``tests/test_benchmarks.py``
checks that they agree with the engine's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# Stream ids, as documented in engine/privacy/rng.py (re-implemented below, not imported).
SAMPLING, NOISE, CLIENT_DATA, MODEL_INIT, DATA = 1, 2, 3, 4, 5


def derive_seed(seed: int, *key: int) -> int:
    """A 63-bit seed from (seed, *key): ``SeedSequence`` state, shifted right by one."""
    ss = np.random.SeedSequence([int(seed), *[int(k) for k in key]])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_stream(seed: int, *key: int) -> np.random.Generator:
    """A numpy generator keyed by (seed, *key)."""
    return np.random.default_rng(derive_seed(seed, *key))


NORMAL_BLOCK = 2**18  # engine/privacy/rng.py's block of seeded Gaussian values


def block_normals(seed: int, key: tuple[int, ...], n: int) -> np.ndarray:
    """The first n float64 N(0, 1) values of the noise stream (seed, *key): blocks of
    ``NORMAL_BLOCK``, block j from PCG64 seeded with ``SeedSequence(seed,
    spawn_key=(len(key), *key, j))``, drawn by a few threads (numpy frees the GIL)."""
    out = np.empty(n, dtype=np.float64)

    def fill(j: int) -> None:
        ss = np.random.SeedSequence(int(seed), spawn_key=(len(key), *key, j))
        part = out[j * NORMAL_BLOCK : (j + 1) * NORMAL_BLOCK]
        np.random.Generator(np.random.PCG64(ss)).standard_normal(out=part)

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        list(pool.map(fill, range(-(-n // NORMAL_BLOCK))))
    return out


def torch_stream(seed: int, *key: int) -> torch.Generator:
    """A CPU torch generator keyed by (seed, *key)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, *key))
    return g


def poisson_cohort(num_clients: int, rate: float, seed: int, rnd: int) -> np.ndarray:
    """Round ``rnd``'s Poisson cohort: every client joins with probability ``rate``."""
    g = numpy_stream(seed, SAMPLING, rnd)
    return np.flatnonzero(g.random(num_clients) < rate).astype(np.int64)


def minibatches(
    idx: np.ndarray, batch_size: int, epochs: int, seed: int, rnd: int, client: int
) -> Iterator[np.ndarray]:
    """``epochs`` shuffled passes over ``idx`` in batches (last one may be short);
    each batch's indices sorted."""
    n = len(idx)
    if n == 0:
        return
    gen = torch_stream(seed, CLIENT_DATA, rnd, client)
    for _ in range(epochs):
        order = idx[torch.randperm(n, generator=gen).numpy()]
        for start in range(0, n, batch_size):
            yield np.sort(order[start : start + batch_size])
