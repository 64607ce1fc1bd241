"""Data sources: what a loader returns before it is partitioned into clients.

A source loader returns a :class:`PooledData` — pooled training arrays, the global
test set, and (for sources with natural clients such as LEAF writers or speaking
roles) a group id per training example. :func:`engine.data.build_dataset` then
partitions it (IID, Dirichlet, or natural) and splits each client's held-out part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PooledData:
    """Pooled arrays as read from disk (or generated).

    Attributes:
        x_train: Training features, ``(n, *input_shape)``: float32 images scaled to
            [0, 1] and normalised per channel, or int64 token ids for text.
        y_train: int64 labels ``(n,)``.
        x_test, y_test: The source's test set (public unless ``test_groups`` is set).
        num_classes: Number of classes (vocabulary size for next-character tasks).
        input_shape: Shape of one example, e.g. ``(1, 28, 28)`` or ``(80,)``.
        groups: Natural client id per training example (int64), or ``None`` when
            the source has no natural clients.
        test_groups: Natural client id per test example (LEAF: the same writers'
            test data, numbered like ``groups``), or ``None``. When set, ``x_test`` is
            the clients' own data, not public; :func:`engine.data.build_dataset` then
            evaluates on held-out writers instead.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None


class DatasetFilesMissing(ValueError):
    """Raised when a dataset's files are absent; the message names path and format."""
