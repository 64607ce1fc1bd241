"""A synthetic population built on demand (``dataset.materialize=false``).

Nothing per client is stored: client k's examples are generated from (seed, k) by
:class:`~engine.data.synthetic.SyntheticGenerator` when a worker first reads them (the
same examples every time, on any process: they depend only on the seed and k), and a
few recently used clients are cached per process. Example ``i`` of client ``k`` has the
global index ``k × S + i`` with ``S = 20 × synthetic_mean_samples`` (the largest client),
so ``x_train[idx]``, ``y_train[idx]``, ``client_train[k]`` and ``client_test[k]`` behave
like the materialised arrays' without any table whose size grows with N.

Client k's examples are exactly those of client k of a materialised
``dataset.partition=natural`` population with the same seed (tested); the held-out split
is its last ``floor(client_test_fraction × n)`` examples (the examples of a client are
exchangeable, so no draw is needed, and no shared stream couples clients).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from engine.data.synthetic import SyntheticGenerator

CACHE_CLIENTS = 256  # per process; a cohort's clients are read batch after batch


class OnDemandPopulation:
    """Client k's examples from the generator, with a small per-process cache."""

    def __init__(self, gen: SyntheticGenerator, num_clients: int, test_fraction: float) -> None:
        self.gen, self.num_clients, self.test_fraction = gen, num_clients, test_fraction
        self.stride = gen.max_size
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __reduce__(self):  # the cache stays behind: workers build what they read
        return (OnDemandPopulation, (self.gen, self.num_clients, self.test_fraction))

    def client(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {k} out of range for {self.num_clients} clients")
        hit = self._cache.get(k)
        if hit is None:
            x, y, _ = self.gen.clients([(0, np.array([k]))])
            hit = (x, y)
            self._cache[k] = hit
            if len(self._cache) > CACHE_CLIENTS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(k)
        return hit

    def split(self, k: int) -> tuple[int, int]:
        """(training examples, held-out examples) of client k."""
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {k} out of range for {self.num_clients} clients")
        hit = self._cache.get(k)
        n = len(hit[1]) if hit is not None else int(self.gen.client_sizes(0, np.array([k]))[0])
        n_test = min(int(np.floor(self.test_fraction * n)), max(n - 1, 0))
        return n - n_test, n_test

    def rows(self, idx: Any, which: int) -> np.ndarray:
        """Rows ``idx`` (global indices, any shape) of x (``which=0``) or y: the result
        has shape ``idx.shape`` followed by a row's shape, as a NumPy array indexed by
        ``idx`` would (a vectorised group reads a (clients, batch) matrix at once)."""
        index = np.asarray(idx, dtype=np.int64)
        flat = index.reshape(-1)
        owner, pos = np.divmod(flat, self.stride)
        shape = (self.gen.dim,) if which == 0 else ()
        out = np.empty((len(flat), *shape), np.float32 if which == 0 else np.int64)
        for k in np.unique(owner).tolist():
            sel = owner == k
            out[sel] = self.client(k)[which][pos[sel]]
        return out.reshape(index.shape + shape)


class OnDemandArray:
    """``x_train`` or ``y_train`` of an on-demand population (rows by global index)."""

    def __init__(self, population: OnDemandPopulation, which: int) -> None:
        self.population, self.which = population, which
        self.dtype = np.dtype(np.float32 if which == 0 else np.int64)
        n = population.num_clients * population.stride
        self.shape = (n, population.gen.dim) if which == 0 else (n,)
        self.ndim = len(self.shape)
        self.nbytes = 0  # nothing held

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: Any) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        return self.population.rows(idx, self.which)


class OnDemandClientIndex(Sequence[np.ndarray]):
    """``client_train`` (held_out=False) or ``client_test`` of an on-demand population."""

    def __init__(self, population: OnDemandPopulation, held_out: bool) -> None:
        self.population, self.held_out = population, held_out

    def __len__(self) -> int:
        return self.population.num_clients

    def __getitem__(self, k):  # type: ignore[override]
        k = int(k)
        if k < 0:
            k += len(self)
        n_train, n_test = self.population.split(k)
        base = k * self.population.stride
        if self.held_out:
            return np.arange(base + n_train, base + n_train + n_test, dtype=np.int64)
        return np.arange(base, base + n_train, dtype=np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        for k in range(len(self)):
            yield self[k]

    def sizes(self) -> np.ndarray:
        """Every client's size: one draw per client (O(N) time, 8 bytes per client)."""
        pop = self.population
        n = pop.gen.client_sizes(0, np.arange(pop.num_clients))
        n_test = np.minimum(np.floor(pop.test_fraction * n).astype(np.int64), np.maximum(n - 1, 0))
        return n_test if self.held_out else n - n_test
