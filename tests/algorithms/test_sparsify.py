"""Sparsification pieces (docs/algorithms.md §2, §3, §5): top-k, rand-k, LUS."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.pieces.sparsify import (
    apply_mask,
    keep_topk,
    lus_sparsify,
    num_kept,
    randk_mask,
    topk_mask,
)

# Vectors with many ties (small integers) or generic floats.
_tied = st.lists(st.integers(-4, 4).map(float), min_size=1, max_size=40)
_floats = st.lists(
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=40
)
vectors = st.one_of(_tied, _floats)


def oracle_topk(values: np.ndarray, k: int) -> set[int]:
    """k largest |values|, ties to the lower index, via numpy lexsort (primary key last)."""
    idx = np.arange(values.size)
    order = np.lexsort((idx, -np.abs(values)))
    return {int(i) for i in order[:k]}


@settings(max_examples=200, deadline=None)
@given(values=vectors, data=st.data())
def test_topk_matches_oracle(values: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(0, len(values)))
    v = torch.tensor(values, dtype=torch.float64)
    mask = topk_mask(v, k)
    assert mask.dtype == torch.bool and mask.shape == v.shape
    assert int(mask.sum()) == k
    kept = set(torch.nonzero(mask).flatten().tolist())
    assert kept == oracle_topk(np.array(values), k)
    if 0 < k < len(values):
        assert v.abs()[mask].min() >= v.abs()[~mask].max()


def _sorted_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """The definition: the first k of a stable sort of -|v| (topk_mask before its O(d)
    path; NaN sorts after every number)."""
    mask = torch.zeros(v.numel(), dtype=torch.bool)
    mask[torch.sort(-v.abs(), stable=True).indices[:k]] = True
    return mask


def test_topk_linear_path_equals_the_sort_on_a_model_sized_vector() -> None:
    """The kthvalue path gives the sort's mask bit for bit: the mlp's 199,210 float32
    coordinates with many ties (and ±0, ±inf), and generic ones; NaN takes the sort."""
    g = torch.Generator().manual_seed(0)
    tied = torch.randint(-6, 7, (199_210,), generator=g).float()
    tied[:50] = float("inf")
    tied[50:60] = -float("inf")
    tied[60:90] = -0.0
    generic = torch.randn(199_210, generator=g)
    for v in (tied, generic):
        for k in (1, 7, 35_459, 99_605, 199_209):
            assert torch.equal(topk_mask(v, k), _sorted_topk(v, k)), k
    with_nan = generic.clone()
    with_nan[::1000] = float("nan")
    assert torch.equal(topk_mask(with_nan, 35_459), _sorted_topk(with_nan, 35_459))


def test_topk_ties_lower_index_first() -> None:
    v = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0])
    assert topk_mask(v, 1).tolist() == [False, True, False, False, False, False]
    assert topk_mask(v, 3).tolist() == [False, True, True, True, False, False]
    assert topk_mask(v, 4).tolist() == [False, True, True, True, True, False]
    # deterministic: repeated calls agree
    assert torch.equal(topk_mask(v, 4), topk_mask(v.clone(), 4))


@settings(max_examples=100, deadline=None)
@given(values=vectors, fraction=st.floats(0.01, 1.0))
def test_keep_topk_zeroes_all_but_topk(values: list[float], fraction: float) -> None:
    v = torch.tensor(values, dtype=torch.float64)
    k = num_kept(len(values), fraction)
    out = keep_topk(v, fraction)
    kept = oracle_topk(np.array(values), k)
    for i, x in enumerate(values):
        assert out[i].item() == (x if i in kept else 0.0)


def test_keep_topk_fraction_one_is_identity() -> None:
    v = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(keep_topk(v, 1.0), v)


@pytest.mark.parametrize(
    ("d", "fraction", "k"),
    [(10, 0.4, 4), (10, 1.0, 10), (10, 0.01, 1), (3, 0.5, 2), (1, 0.3, 1), (1000, 0.7, 700)],
)
def test_num_kept(d: int, fraction: float, k: int) -> None:
    assert num_kept(d, fraction) == k


def test_randk_reproducible_and_seed_dependent() -> None:
    def draw(seed: int) -> torch.Tensor:
        return randk_mask(1000, 0.1, torch.Generator().manual_seed(seed))

    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    for m in (a, c):
        assert m.dtype == torch.bool and m.shape == (1000,)
        assert int(m.sum()) == 100


def test_randk_uniform_coverage() -> None:
    d, fraction, draws = 20, 0.3, 4000
    k = num_kept(d, fraction)
    gen = torch.Generator().manual_seed(123)
    counts = torch.zeros(d)
    for _ in range(draws):
        m = randk_mask(d, fraction, gen)
        assert int(m.sum()) == k
        counts += m
    p = k / d
    std = (draws * p * (1 - p)) ** 0.5
    assert torch.all((counts - draws * p).abs() < 5 * std), counts


def test_apply_mask_rescale_unbiased() -> None:
    d, fraction, draws = 16, 0.25, 4000
    k = num_kept(d, fraction)
    v = torch.linspace(-2.0, 3.0, d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(9)
    total = torch.zeros(d, dtype=torch.float64)
    for _ in range(draws):
        m = randk_mask(d, fraction, gen)
        out = apply_mask(v, m, rescale=True)
        torch.testing.assert_close(out[m], v[m] * d / k)
        assert torch.all(out[~m] == 0)
        total += out
    mean = total / draws
    p = k / d
    std = v.abs() * (d / k) * (p * (1 - p) / draws) ** 0.5
    assert torch.all((mean - v).abs() <= 5 * std + 1e-12), mean - v


def test_apply_mask_without_rescale() -> None:
    v = torch.tensor([1.0, -2.0, 3.0, 4.0])
    m = torch.tensor([True, False, True, False])
    assert apply_mask(v, m).tolist() == [1.0, 0.0, 3.0, 0.0]
    assert apply_mask(v, m, rescale=True).tolist() == [2.0, 0.0, 6.0, 0.0]
    assert v.tolist() == [1.0, -2.0, 3.0, 4.0]


@settings(max_examples=150, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.integers(-5, 5).map(float), st.floats(-10, 10, allow_nan=False)),
        min_size=1,
        max_size=40,
    ),
    sparsity=st.sampled_from([0.1, 0.3, 0.5, 0.7, 0.9, 0.0]),
)
def test_lus_keeps_top_by_grad_times_delta(
    pairs: list[tuple[float, float]], sparsity: float
) -> None:
    delta_np = np.array([p[1] for p in pairs])
    grad_np = np.array([p[0] for p in pairs])
    delta = torch.tensor(delta_np, dtype=torch.float64)
    grad = torch.tensor(grad_np, dtype=torch.float64)
    out = lus_sparsify(delta, grad, sparsity)
    if sparsity == 0.0:
        assert torch.equal(out, delta)
        return
    k = num_kept(len(pairs), 1 - sparsity)
    kept = oracle_topk(grad_np * delta_np, k)
    for i in range(len(pairs)):
        assert out[i].item() == (delta_np[i] if i in kept else 0.0)


def test_lus_fraction_and_importance() -> None:
    d = 1000
    gen = torch.Generator().manual_seed(4)
    delta = torch.randn(d, generator=gen)
    grad = torch.randn(d, generator=gen)
    for c in (0.1, 0.3, 0.5, 0.7, 0.9):
        out = lus_sparsify(delta, grad, c)
        nz = out != 0
        assert int(nz.sum()) == round((1 - c) * d)
        assert torch.equal(out[nz], delta[nz])
        imp = (grad * delta).abs()
        assert imp[nz].min() >= imp[~nz].max()
    # the big-|Δ| coordinate with zero gradient is dropped: importance is |g·Δ|, not |Δ|
    delta2 = torch.tensor([100.0, 1.0, 1.0])
    grad2 = torch.tensor([0.0, 1.0, 2.0])
    assert lus_sparsify(delta2, grad2, 0.5).tolist() == [0.0, 1.0, 1.0]


def test_lus_zero_sparsity_identity_and_inputs_untouched() -> None:
    delta = torch.randn(30, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(30, generator=torch.Generator().manual_seed(2))
    d0, g0 = delta.clone(), grad.clone()
    assert torch.equal(lus_sparsify(delta, grad, 0.0), delta)
    lus_sparsify(delta, grad, 0.7)
    assert torch.equal(delta, d0) and torch.equal(grad, g0)


def test_errors_name_keys() -> None:
    key = re.escape("algo.keep_fraction")
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=key):
            num_kept(10, bad)
        with pytest.raises(ValueError, match=key):
            keep_topk(torch.randn(10), bad)
        with pytest.raises(ValueError, match=key):
            randk_mask(10, bad, torch.Generator().manual_seed(0))
    for bad in (1.0, -0.1, 2.0, float("nan")):
        with pytest.raises(ValueError, match=re.escape("algo.zero_fraction")):
            lus_sparsify(torch.randn(5), torch.randn(5), bad)
    with pytest.raises(ValueError, match="shape"):
        lus_sparsify(torch.randn(5), torch.randn(4), 0.5)
    with pytest.raises(ValueError, match="shape"):
        apply_mask(torch.randn(5), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="k="):
        topk_mask(torch.randn(5), 6)
    with pytest.raises(ValueError, match="empty"):
        apply_mask(torch.randn(3), torch.zeros(3, dtype=torch.bool), rescale=True)
