"""A public validation set: training examples that no client holds.

``dataset.validation_size = k > 0`` draws k of the pooled training examples (uniformly,
without replacement, from the data seed) *before* the examples are partitioned into
clients, and removes them from the arrays the clients index: no client of the
population ever holds one. Like the global test set (:mod:`engine.data`), the
validation set is therefore public under client-level DP: its examples belong to
nobody in the population, so a metric computed on it (``val_accuracy``) reads only
the released model and public data, and selecting hyperparameters by it costs no
privacy beyond the trials' own ε (``dpfl leaderboard``).

It is disjoint from the test set by construction: torchvision's official test split
and the digits' fixed test split are separate examples, and synthetic/LEAF's public
clients are removed before the draw. Only ``iid`` and ``dirichlet`` partitions take
one (a natural client's examples are its writer's, so holding some out would not make
them public; the config refuses it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.data.sources import PooledData


def hold_out_validation(
    pooled: PooledData, size: int, rng: np.random.Generator
) -> tuple[PooledData, np.ndarray, np.ndarray]:
    """Draw ``size`` training examples from ``pooled`` (``rng.choice`` without
    replacement, kept in their original order) and return the pooled data without them,
    and the held-out features and labels. ``size`` must leave examples for the clients.
    """
    n = len(pooled.y_train)
    if not 0 < size < n:
        raise ValueError(
            f"dataset.validation_size={size}: must be between 1 and the {n - 1} training "
            "examples that leave at least one for the clients"
        )
    held = np.sort(rng.choice(n, size, replace=False))
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    groups = None if pooled.groups is None else pooled.groups[keep]
    rest = dataclasses.replace(
        pooled, x_train=pooled.x_train[keep], y_train=pooled.y_train[keep], groups=groups
    )
    return rest, pooled.x_train[held], pooled.y_train[held]
