"""Laplacian smoothing (docs/algorithms.md §4): the FFT operator against a dense solve."""

from __future__ import annotations

import math
import re

import pytest
import torch

from algorithms.pieces.smoothing import laplacian_smooth, smooth_flat


def cycle_laplacian(n: int) -> torch.Tensor:
    """Dense cycle-graph Laplacian: 2 on the diagonal, −1 on both neighbours (wrapping)."""
    lap = 2.0 * torch.eye(n, dtype=torch.float64)
    for i in range(n):
        lap[i, (i + 1) % n] -= 1.0
        lap[i, (i - 1) % n] -= 1.0
    return lap


@pytest.mark.parametrize("n", [3, 4, 7, 50])
@pytest.mark.parametrize("sigma", [0.01, 0.5, 1.0, 3.0])
def test_equals_dense_solve(n: int, sigma: float) -> None:
    gen = torch.Generator().manual_seed(n * 100 + int(sigma * 10))
    v = torch.randn(n, dtype=torch.float64, generator=gen)
    a = torch.eye(n, dtype=torch.float64) + sigma * cycle_laplacian(n)
    expected = torch.linalg.solve(a, v)
    torch.testing.assert_close(laplacian_smooth(v, sigma), expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("n", [3, 8, 11])
def test_equals_literal_complex_fft_formula(n: int) -> None:
    v = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    sigma = 0.7
    k = torch.arange(n, dtype=torch.float64)
    denom = 1 + 2 * sigma - 2 * sigma * torch.cos(2 * math.pi * k / n)
    expected = torch.fft.ifft(torch.fft.fft(v) / denom).real
    torch.testing.assert_close(laplacian_smooth(v, sigma), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sigma_zero_is_identity(dtype: torch.dtype) -> None:
    v = torch.randn(33, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = laplacian_smooth(v, 0.0)
    assert torch.equal(out, v)
    assert out.dtype == dtype


def test_result_is_a_new_tensor() -> None:
    v = torch.randn(10, generator=torch.Generator().manual_seed(1))
    before = v.clone()
    for sigma in (0.0, 1.0):
        out = laplacian_smooth(v, sigma)
        out.add_(1.0)
        assert torch.equal(v, before)


@pytest.mark.parametrize("n", [3, 5, 64, 1001])
def test_mean_preserved(n: int) -> None:
    v = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) + 3.0
    out = laplacian_smooth(v, 2.5)
    assert math.isclose(float(out.mean()), float(v.mean()), rel_tol=0, abs_tol=1e-12)


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_tensors_unsmoothed(n: int) -> None:
    v = torch.tensor([1.5, -2.0][:n])
    assert torch.equal(laplacian_smooth(v, 4.0), v)


def test_dtype_kept() -> None:
    v = torch.randn(20, generator=torch.Generator().manual_seed(2))
    out = laplacian_smooth(v, 1.0)
    assert out.dtype == torch.float32
    expected = laplacian_smooth(v.double(), 1.0).float()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("n", [4, 10, 50])
@pytest.mark.parametrize("sigma", [0.1, 1.0, 5.0])
def test_alternating_vector_shrinks_by_one_plus_four_sigma(n: int, sigma: float) -> None:
    v = torch.tensor([(-1.0) ** i for i in range(n)], dtype=torch.float64)
    out = laplacian_smooth(v, sigma)
    torch.testing.assert_close(out, v / (1 + 4 * sigma), atol=1e-12, rtol=0)
    assert math.isclose(float(out.norm() / v.norm()), 1 / (1 + 4 * sigma), rel_tol=1e-12)


def test_high_frequency_energy_damped_low_frequency_kept() -> None:
    n = 64
    t = torch.arange(n, dtype=torch.float64)
    low = torch.cos(2 * math.pi * t / n)
    high = torch.cos(2 * math.pi * 20 * t / n)
    out = laplacian_smooth(low + high, 1.0)

    # each Fourier mode is an eigenvector: its gain is 1 / (1 + 2σ − 2σ cos(2πk/n))
    def gain(k: int) -> float:
        return 1 / (3 - 2 * math.cos(2 * math.pi * k / n))

    torch.testing.assert_close(out, gain(1) * low + gain(20) * high, atol=1e-12, rtol=0)
    assert gain(20) < 0.3 < 0.95 < gain(1)


def test_hand_computed_2x2_linear_weight() -> None:
    """A (2, 2) Linear weight [[a, b], [c, d]] flattens to [a, b, c, d]: a 4-cycle.

    With σ_ls = 1, A = I + L = circ(3, −1, 0, −1). Its eigenvalues are
    1 + 2 − 2cos(2πk/4) = 1, 3, 5, 3, so A⁻¹ = circ(p0, p1, p2, p1) with
    p_j = (1/4) Σ_k cos(2πjk/4)/λ_k:
        p0 = (1 + 1/3 + 1/5 + 1/3)/4 = 7/15,
        p1 = (1 + 0 − 1/5 + 0)/4     = 3/15,
        p2 = (1 − 1/3 + 1/5 − 1/3)/4 = 2/15.
    Check: A·(7, 3, 2, 3)/15 = (21 − 3 − 3, −7 + 9 − 2, −3 + 6 − 3, −7 − 2 + 9)/15 = e0.
    For [a, b, c, d] = [1, 2, 3, 4]:
        ṽ0 = (7a + 3b + 2c + 3d)/15 = (7 + 6 + 6 + 12)/15 = 31/15
        ṽ1 = (3a + 7b + 3c + 2d)/15 = (3 + 14 + 9 + 8)/15 = 34/15
        ṽ2 = (2a + 3b + 7c + 3d)/15 = (2 + 6 + 21 + 12)/15 = 41/15
        ṽ3 = (3a + 2b + 3c + 7d)/15 = (3 + 4 + 9 + 28)/15 = 44/15
    (sum 150/15 = 10 = 1 + 2 + 3 + 4). A 2-element bias [5, 6] is left unsmoothed.
    """
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    bias = torch.tensor([5.0, 6.0], dtype=torch.float64)
    flat = torch.cat([weight.flatten(), bias])
    out = smooth_flat(flat, [(2, 2), (2,)], 1.0, scope="tensor")
    expected = torch.tensor([31 / 15, 34 / 15, 41 / 15, 44 / 15, 5.0, 6.0], dtype=torch.float64)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_smooth_flat_per_tensor_is_segmentwise() -> None:
    shapes = [(4, 3), (4,), (2, 3, 5), (1,), (), (7,)]
    sizes = [math.prod(s) for s in shapes]
    flat = torch.randn(sum(sizes), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = smooth_flat(flat, shapes, 0.8)
    expected = torch.cat([laplacian_smooth(seg, 0.8) for seg in flat.split(sizes)])
    assert torch.equal(out, expected)
    model = smooth_flat(flat, shapes, 0.8, scope="model")
    torch.testing.assert_close(model, laplacian_smooth(flat, 0.8), atol=0, rtol=0)
    assert not torch.allclose(out, model)
    # per-tensor smoothing preserves each tensor's own sum
    for seg_in, seg_out in zip(flat.split(sizes), out.split(sizes)):
        assert math.isclose(float(seg_in.sum()), float(seg_out.sum()), abs_tol=1e-12)


def test_smooth_flat_row_major_order_matters() -> None:
    """Smoothing a transposed copy is a different operator (§4: order matters)."""
    w = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    natural = smooth_flat(w.flatten(), [(3, 5)], 1.0).view(3, 5)
    transposed = smooth_flat(w.t().flatten(), [(5, 3)], 1.0).view(5, 3).t()
    assert not torch.allclose(natural, transposed)


def test_smooth_flat_sigma_zero_identity() -> None:
    flat = torch.randn(17, generator=torch.Generator().manual_seed(5))
    for scope in ("tensor", "model"):
        assert torch.equal(smooth_flat(flat, [(3, 4), (5,)], 0.0, scope=scope), flat)


def test_errors_name_keys() -> None:
    v = torch.randn(5)
    with pytest.raises(ValueError, match=re.escape("algo.sigma_ls")):
        laplacian_smooth(v, -0.1)
    with pytest.raises(ValueError, match=re.escape("algo.sigma_ls")):
        laplacian_smooth(v, float("nan"))
    with pytest.raises(ValueError, match=re.escape("algo.sigma_ls")):
        smooth_flat(v, [(5,)], -1.0)
    with pytest.raises(ValueError, match=re.escape("algo.ls_scope")):
        smooth_flat(v, [(5,)], 1.0, scope="layer")
    with pytest.raises(ValueError, match="entries"):
        smooth_flat(v, [(2, 2)], 1.0)
    with pytest.raises(ValueError, match="1-D"):
        laplacian_smooth(torch.randn(2, 3), 1.0)
