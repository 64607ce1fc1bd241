"""Partitions of a pooled dataset into clients: IID, Dirichlet over labels, natural.

All functions are pure given an explicit ``numpy.random.Generator``, return one
sorted int64 index array per client, and assign every example to exactly one
client (tested).
"""

from __future__ import annotations

import numpy as np


def iid_partition(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``n`` examples and deal them into ``num_clients`` near-equal parts."""
    if num_clients < 1 or num_clients > n:
        raise ValueError(
            f"dataset.num_clients={num_clients} must be between 1 and the {n} examples"
        )
    perm = rng.permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_clients)]


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed partition (Hsu et al. 2019): per class, proportions ~ Dir(alpha).

    For each class the examples of that class are shuffled and split among clients
    in proportions drawn from ``Dirichlet(alpha * 1)``. Redrawn (up to
    ``max_tries``) until every client holds at least ``min_size`` examples.
    Small ``alpha`` gives strongly non-IID clients; large ``alpha`` tends to IID.
    """
    if alpha <= 0:
        raise ValueError(f"dataset.alpha={alpha} must be > 0")
    labels = np.asarray(labels)
    n = len(labels)
    if num_clients < 1 or num_clients * min_size > n:
        raise ValueError(
            f"dataset.num_clients={num_clients} cannot each get {min_size} of {n} examples"
        )
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(np.int64)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ValueError(
        f"dataset.alpha={alpha} with dataset.num_clients={num_clients} left a client with "
        f"fewer than {min_size} examples after {max_tries} draws; raise alpha or lower "
        "num_clients"
    )


def natural_partition(groups: np.ndarray, num_clients: int | None = None) -> list[np.ndarray]:
    """One client per natural group (writer, speaking role), in order of first appearance.

    If ``num_clients`` is given, the first ``num_clients`` groups are kept (an error
    if there are fewer).
    """
    groups = np.asarray(groups)
    _, first = np.unique(groups, return_index=True)
    order = groups[np.sort(first)]
    if num_clients is not None:
        if num_clients > len(order):
            raise ValueError(
                f"dataset.num_clients={num_clients} exceeds the {len(order)} natural "
                "clients (writers/roles) in the data"
            )
        order = order[:num_clients]
    return [np.flatnonzero(groups == g).astype(np.int64) for g in order]
