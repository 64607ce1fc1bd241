"""The federated dataset: shared arrays plus per-client index lists.

A :class:`FederatedDataset` holds every example once (``x_train``/``y_train`` for
what clients own, ``x_test``/``y_test`` for the global test set) and, for each
client, the indices of its training examples and of its held-out examples (both
index into ``x_train``). Workers receive it once through Ray's object store; numpy
arrays are then read zero-copy from shared memory, so nothing is copied per task.

Privacy note: the unit of privacy is the client, i.e. everything listed in
``client_train[i]`` (and its held-out split). The global test set is public: it holds
no data of any client of the population (see :mod:`engine.data`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class FederatedDataset:
    """Arrays plus per-client index lists.

    Attributes:
        name: Source name (``synthetic``, ``mnist``, ...).
        x_train: Client-owned features, shape ``(n, *input_shape)``; float32 for
            images/vectors, int64 token ids for sequences.
        y_train: Labels, shape ``(n,)``, int64.
        client_train: One int64 index array into ``x_train`` per client.
        client_test: One int64 index array into ``x_train`` per client (held out).
        x_test: Global test features.
        y_test: Global test labels.
        num_classes: Number of output classes (vocabulary size for next-char tasks).
        input_shape: Shape of one example.
        meta: Free-form public facts (e.g. the partition used).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    client_train: list[np.ndarray]
    client_test: list[np.ndarray]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.client_train) != len(self.client_test):
            raise ValueError(
                f"client_train has {len(self.client_train)} clients but client_test "
                f"has {len(self.client_test)}"
            )
        if len(self.x_train) != len(self.y_train):
            raise ValueError("x_train and y_train differ in length")
        if len(self.x_test) != len(self.y_test):
            raise ValueError("x_test and y_test differ in length")

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    def client_sizes(self) -> np.ndarray:
        """Number of training examples per client."""
        return np.array([len(ix) for ix in self.client_train], dtype=np.int64)


def split_client_test(
    client_indices: list[np.ndarray], test_fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's examples into a train and a held-out part.

    Each client keeps at least one training example; ``floor(test_fraction * n)``
    of its examples (chosen uniformly by ``rng``) become its held-out split.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"dataset.client_test_fraction={test_fraction} must be in [0, 1)")
    train, test = [], []
    for ix in client_indices:
        ix = np.asarray(ix, dtype=np.int64)
        perm = rng.permutation(len(ix))
        n_test = min(int(np.floor(test_fraction * len(ix))), max(len(ix) - 1, 0))
        test.append(np.sort(ix[perm[:n_test]]))
        train.append(np.sort(ix[perm[n_test:]]))
    return train, test
