"""A held-out public test set that is the pooled arrays' tail is a view of them, not a
copy (issue 30: the driver of a 10^6-client run held 10 % of the examples twice), with
the same values as the copy it replaces."""

from __future__ import annotations

import numpy as np

from engine.data import hold_out_public
from engine.data.sources import PooledData


def test_tail_public_set_is_a_view_with_the_same_values() -> None:
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(10), 4)  # in order: the public groups are the tail
    x = rng.standard_normal((len(groups), 3)).astype(np.float32)
    y = rng.integers(0, 5, len(groups))
    pooled = PooledData(x, y, x[:0], y[:0], 5, (3,), groups=groups)
    population, x_test, y_test = hold_out_public(pooled, 3, "synthetic")
    assert np.shares_memory(x_test, x) and np.shares_memory(y_test, y)
    np.testing.assert_array_equal(x_test, x[28:])
    np.testing.assert_array_equal(y_test, y[28:])
    assert len(population.y_train) == 28


def test_public_set_from_two_sources_is_still_one_array() -> None:
    """With the writers' own test data (LEAF) the public set joins two parts."""
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(6), 3)
    test_groups = np.repeat(np.arange(6), 2)
    x = rng.standard_normal((18, 2)).astype(np.float32)
    xt = rng.standard_normal((12, 2)).astype(np.float32)
    y, yt = rng.integers(0, 3, 18), rng.integers(0, 3, 12)
    pooled = PooledData(x, y, xt, yt, 3, (2,), groups=groups, test_groups=test_groups)
    _, x_test, y_test = hold_out_public(pooled, 2, "femnist")
    np.testing.assert_array_equal(x_test, np.concatenate([x[12:], xt[8:]]))
    np.testing.assert_array_equal(y_test, np.concatenate([y[12:], yt[8:]]))
