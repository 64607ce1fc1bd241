"""The federated dataset: shared arrays plus per-client index lists.

A :class:`FederatedDataset` holds every example once (``x_train``/``y_train`` for
what clients own, ``x_test``/``y_test`` for the global test set) and, for each
client, the indices of its training examples and of its held-out examples (both
index into ``x_train``). Workers receive it once through Ray's object store; numpy
arrays are then read zero-copy from shared memory, so nothing is copied per task. A
generated population's examples and flat indices are already in shared memory
(:mod:`engine.data.shared`); on one machine the Ray pool sends those by reference, so
they are not copied into the object store either.

The per-client indices are a :class:`ClientIndex`: one flat int64 array plus offsets
(CSR), so a population of 10^6 clients costs 8 bytes per client and per example, not
a Python object per client; ``client_train[k]`` is a read-only view of client k's
indices, and ``len``/iteration work as on a list.

Privacy note: the unit of privacy is the client, i.e. everything listed in
``client_train[i]`` (and its held-out split). The global test set is public: it holds
no data of any client of the population (see :mod:`engine.data`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from engine.data.shared import empty, reference, resolve, segment_of


class ClientIndex(Sequence[np.ndarray]):
    """Per-client sorted int64 index arrays, stored as one flat array plus offsets.

    ``index[k]`` is ``flat[offsets[k]:offsets[k + 1]]`` (a read-only view); ``len``,
    iteration and ``sizes()`` need no per-client Python objects.
    """

    __slots__ = ("flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        flat = np.asarray(flat, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
            raise ValueError("ClientIndex offsets must be 1-D and start at 0")
        if offsets[-1] != len(flat) or np.any(np.diff(offsets) < 0):
            raise ValueError("ClientIndex offsets must be non-decreasing and end at len(flat)")
        if flat.flags.writeable:  # views handed out must not edit the shared index
            flat = flat.view()
            flat.flags.writeable = False
        self.flat = flat
        self.offsets = offsets

    @classmethod
    def from_arrays(cls, arrays: Sequence[Any]) -> ClientIndex:
        """The same per-client arrays, compacted (values and order kept)."""
        if isinstance(arrays, ClientIndex):
            return arrays
        parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in parts], out=offsets[1:])
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return cls(flat, offsets)

    @classmethod
    def from_owners(cls, owner: np.ndarray, values: np.ndarray, num_clients: int) -> ClientIndex:
        """Client ``owner[i]`` holds ``values[i]``; each client's values come out sorted."""
        owner = np.asarray(owner, dtype=np.int64)
        values = np.asarray(values, dtype=np.int64)
        counts = np.bincount(owner, minlength=num_clients)[:num_clients]
        span = int(values.max()) + 1 if len(values) else 1
        if len(values) == 0:
            order = np.zeros(0, np.int64)
        elif values.min() >= 0 and span * max(num_clients, 1) < 2**62:
            order = np.argsort(owner * span + values, kind="stable")  # one key: faster
        else:
            order = np.lexsort((values, owner))
        offsets = np.zeros(num_clients + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(values[order], offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = int(k)
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"client {k} out of range for {n} clients")
        return self.flat[self.offsets[k] : self.offsets[k + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        for k in range(len(self)):
            yield self.flat[self.offsets[k] : self.offsets[k + 1]]

    def __add__(self, other: Sequence[np.ndarray]) -> list[np.ndarray]:
        return list(self) + list(other)  # as for the lists this replaces

    def __radd__(self, other: Sequence[np.ndarray]) -> list[np.ndarray]:
        return list(other) + list(self)

    def sizes(self) -> np.ndarray:
        """Number of indices per client (int64)."""
        return np.diff(self.offsets)

    def __reduce__(self):
        return (_rebuild_index, (reference(self.flat), reference(self.offsets)))

    def __repr__(self) -> str:
        return f"ClientIndex({len(self)} clients, {len(self.flat)} indices)"


@dataclass(frozen=True)
class FederatedDataset:
    """Arrays plus per-client index lists.

    Attributes:
        name: Source name (``synthetic``, ``mnist``, ...).
        x_train: Client-owned features, shape ``(n, *input_shape)``; float32 for
            images/vectors, int64 token ids for sequences.
        y_train: Labels, shape ``(n,)``, int64.
        client_train: One int64 index array into ``x_train`` per client (a
            :class:`ClientIndex`; a list of arrays given here is compacted into one).
        client_test: One int64 index array into ``x_train`` per client (held out).
        x_test: Global test features.
        y_test: Global test labels.
        num_classes: Number of output classes (vocabulary size for next-char tasks).
        input_shape: Shape of one example.
        meta: Free-form public facts (e.g. the partition used).
        x_val, y_val: The public validation set (``dataset.validation_size``,
            :mod:`engine.data.validation`): examples no client holds, disjoint from the
            test set; None without one.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    client_train: Sequence[np.ndarray]
    client_test: Sequence[np.ndarray]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    meta: dict = field(default_factory=dict)
    x_val: np.ndarray | None = None
    y_val: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("client_train", "client_test"):
            index = getattr(self, name)
            if not hasattr(index, "sizes"):  # a plain list of arrays: compact it
                object.__setattr__(self, name, ClientIndex.from_arrays(index))
        if len(self.client_train) != len(self.client_test):
            raise ValueError(
                f"client_train has {len(self.client_train)} clients but client_test "
                f"has {len(self.client_test)}"
            )
        if len(self.x_train) != len(self.y_train):
            raise ValueError("x_train and y_train differ in length")
        if len(self.x_test) != len(self.y_test):
            raise ValueError("x_test and y_test differ in length")

    def __reduce__(self):
        """Pickled field by field; arrays in shared memory go as handles while
        :func:`engine.data.shared.by_reference` is on (else by value, as always)."""
        values = tuple(reference(getattr(self, f.name)) for f in fields(self))
        return (_rebuild_dataset, values)

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    def client_sizes(self) -> np.ndarray:
        """Number of training examples per client (int64, one entry per client)."""
        return np.asarray(self.client_train.sizes(), dtype=np.int64)  # type: ignore[attr-defined]


def _rebuild_index(flat: Any, offsets: Any) -> ClientIndex:
    return ClientIndex(resolve(flat), resolve(offsets))


def _rebuild_dataset(*values: Any) -> FederatedDataset:
    return FederatedDataset(*map(resolve, values))


def sort_segments(values: np.ndarray, offsets: np.ndarray, chunk: int = 65536) -> None:
    """Sort ``values[offsets[k]:offsets[k + 1]]`` for every k, in place, a chunk of
    segments at a time (temporaries stay the size of a chunk, not of ``values``)."""
    for a in range(0, len(offsets) - 1, chunk):
        b = min(a + chunk, len(offsets) - 1)
        lo, hi = int(offsets[a]), int(offsets[b])
        if hi == lo:
            continue
        part = values[lo:hi]
        owner = np.repeat(np.arange(b - a, dtype=np.int64), np.diff(offsets[a : b + 1]))
        low = int(part.min())
        span = int(part.max()) - low + 1
        if span * (b - a) < 2**62:
            part[:] = part[np.argsort(owner * span + (part - low), kind="stable")]
        else:
            part[:] = part[np.lexsort((part, owner))]


def _segments_sorted(index: ClientIndex) -> bool:
    """Whether every client's indices are in increasing order (what a split sorts to)."""
    drops = np.flatnonzero(index.flat[1:] < index.flat[:-1]) + 1
    return bool(np.isin(drops, index.offsets).all())


def split_client_test(
    client_indices: Sequence[np.ndarray],
    test_fraction: float,
    rng: np.random.Generator,
    shared: bool = False,
) -> tuple[ClientIndex, ClientIndex]:
    """Split each client's examples into a train and a held-out part.

    Each client keeps at least one training example; ``floor(test_fraction * n)``
    of its examples (chosen uniformly by ``rng``) become its held-out split. ``rng``
    draws one permutation per client, in client order (the only per-client Python
    step); selection and sorting are done a chunk of clients at a time. When nothing is
    held out (``floor(test_fraction * n) = 0`` for every client) and each client's
    indices are already sorted, the index is returned as it is and ``rng`` is not drawn
    from: the result is the same. ``shared``: the
    two flat indices are allocated in shared memory (:mod:`engine.data.shared`), to be
    sent by reference with examples that are.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"dataset.client_test_fraction={test_fraction} must be in [0, 1)")
    index = ClientIndex.from_arrays(client_indices)
    sizes = index.sizes()
    n_test = np.minimum(np.floor(test_fraction * sizes).astype(np.int64), np.maximum(sizes - 1, 0))
    test_off = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(n_test, out=test_off[1:])
    if test_off[-1] == 0 and _segments_sorted(index):
        # Nothing held out: the permutations would only be sorted back into the index
        # (10^6 clients: ~11 s and a copy of the index). The caller's rng is not used
        # afterwards (build_dataset), so skipping its draws changes no value.
        flat = index.flat
        if shared and segment_of(flat) is None:
            flat = empty(len(flat), np.int64, True)
            flat[:] = index.flat
        return ClientIndex(flat, index.offsets), ClientIndex(np.zeros(0, np.int64), test_off)
    train_off = index.offsets - test_off
    test_flat = empty(int(test_off[-1]), np.int64, shared)
    train_flat = empty(int(train_off[-1]), np.int64, shared)
    chunk = 65536
    for a in range(0, len(sizes), chunk):
        b = min(a + chunk, len(sizes))
        m = sizes[a:b]
        perms = [rng.permutation(s) for s in m.tolist()]
        if not perms or index.offsets[b] == index.offsets[a]:
            continue
        owner = np.repeat(np.arange(a, b, dtype=np.int64), m)
        start = index.offsets[:-1][owner]
        picked = index.flat[start + np.concatenate(perms).astype(np.int64)]  # ix[perm]
        position = np.arange(index.offsets[a], index.offsets[b], dtype=np.int64) - start
        is_test = position < n_test[owner]
        # within a client, test picks come first and training picks after: keep order
        test_flat[test_off[a] : test_off[b]] = picked[is_test]
        train_flat[train_off[a] : train_off[b]] = picked[~is_test]
    sort_segments(test_flat, test_off)
    sort_segments(train_flat, train_off)
    return ClientIndex(train_flat, train_off), ClientIndex(test_flat, test_off)
