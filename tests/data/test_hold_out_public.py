"""hold_out_public's path for groups in increasing order (the synthetic generator's
layout: slices instead of a sort of every example's group, np.isin and a mask) gives
what the general path gives, and unsorted groups (LEAF) still take the general path."""

from __future__ import annotations

import numpy as np
import pytest

from engine.data import _first_appearance, hold_out_public
from engine.data.sources import PooledData


def reference(pooled: PooledData, k: int):
    """hold_out_public as written before the sorted-groups path."""
    _, first = np.unique(pooled.groups, return_index=True)
    order = pooled.groups[np.sort(first)]
    public = order[-k:]
    in_pub = np.isin(pooled.groups, public)
    pop = np.flatnonzero(~in_pub)
    x_tr, y_tr, g_tr = pooled.x_train[pop], pooled.y_train[pop], pooled.groups[pop]
    x_parts, y_parts = [pooled.x_train[in_pub]], [pooled.y_train[in_pub]]
    if pooled.test_groups is not None:
        t_pub = np.isin(pooled.test_groups, public)
        x_parts.append(pooled.x_test[t_pub])
        y_parts.append(pooled.y_test[t_pub])
    return order, x_tr, y_tr, g_tr, np.concatenate(x_parts), np.concatenate(y_parts)


def pooled(groups: np.ndarray, test_groups: np.ndarray | None = None) -> PooledData:
    rng = np.random.default_rng(len(groups))
    nt = 0 if test_groups is None else len(test_groups)
    return PooledData(
        x_train=rng.standard_normal((len(groups), 3)).astype(np.float32),
        y_train=rng.integers(0, 5, len(groups)),
        x_test=rng.standard_normal((nt, 3)).astype(np.float32),
        y_test=rng.integers(0, 5, nt),
        num_classes=5,
        input_shape=(3,),
        groups=groups,
        test_groups=test_groups,
    )


SORTED = np.repeat(np.arange(30), np.random.default_rng(0).integers(1, 6, 30))
CASES = [
    (SORTED, None),
    (SORTED, np.array([29, 3, 28, 0, 29])),
    (np.repeat([5, 9, 9, 11], [2, 1, 3, 4]), None),  # non-contiguous values, still sorted
    (np.random.default_rng(1).permutation(SORTED), None),  # LEAF-like: general path
    (np.repeat([4, 2, 7, 0, 3], [2, 3, 1, 2, 2]), np.array([0, 3, 3])),  # groups unsorted
]


@pytest.mark.parametrize("groups,test_groups", CASES)
@pytest.mark.parametrize("k", [1, 2])
def test_hold_out_public_equals_the_general_path(groups, test_groups, k):
    data = pooled(groups, test_groups)
    order, x_tr, y_tr, g_tr, x_te, y_te = reference(data, k)
    assert np.array_equal(_first_appearance(groups), order)
    pop, x_test, y_test = hold_out_public(data, k, "synthetic")
    assert np.array_equal(pop.x_train, x_tr) and np.array_equal(pop.y_train, y_tr)
    assert np.array_equal(pop.groups, g_tr)
    assert np.array_equal(x_test, x_te) and np.array_equal(y_test, y_te)
    assert x_test.dtype == x_te.dtype and y_test.dtype == y_te.dtype


def test_first_appearance_of_one_example():
    assert _first_appearance(np.array([7])).tolist() == [7]
