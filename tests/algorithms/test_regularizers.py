"""Tests for algorithms.pieces.regularizers: the BLUR bounded-update penalty."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from algorithms.pieces.regularizers import blur_loss


def _setup(shift: float, seed: int = 0):
    """A small MLP whose parameters are the anchor plus a uniform shift."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(shift * torch.randn_like(p))
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    return model, params, anchor, x, y


def _dist(params, anchor) -> float:
    return float(sum((p.detach() - a).pow(2).sum() for p, a in zip(params, anchor)).sqrt())


def test_lambda_zero_is_noop():
    model, params, anchor, x, y = _setup(shift=1.0)
    assert _dist(params, anchor) > 0.1
    plain = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params)
    total = nn.functional.cross_entropy(model(x), y) + blur_loss(params, anchor, 0.0, 0.1)
    with_blur = torch.autograd.grad(total, params)
    for a, b in zip(plain, with_blur):
        assert torch.equal(a, b)
    assert float(blur_loss(params, anchor, 0.0, 0.1)) == 0.0


@pytest.mark.parametrize("lam", [0.05, 0.4, 2.0])
def test_gradient_outside_ball_is_lambda_times_offset(lam):
    _, params, anchor, _, _ = _setup(shift=0.5)
    dist = _dist(params, anchor)
    clip = 0.5 * dist
    out = blur_loss(params, anchor, lam, clip)
    assert out.requires_grad and out.dim() == 0
    assert float(out.detach()) == pytest.approx(0.5 * lam * (dist**2 - clip**2), rel=1e-10)
    grads = torch.autograd.grad(out, params)
    for g, p, a in zip(grads, params, anchor):
        assert torch.allclose(g, lam * (p.detach() - a), rtol=0, atol=1e-6)
    # The gradient is not identically zero (guards against a detached term).
    assert max(float(g.abs().max()) for g in grads) > 1e-3


def test_gradient_inside_ball_is_zero():
    _, params, anchor, _, _ = _setup(shift=0.5)
    dist = _dist(params, anchor)
    out = blur_loss(params, anchor, 0.4, 2.0 * dist)
    assert float(out.detach()) == 0.0
    grads = torch.autograd.grad(out, params)
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_whole_model_norm_not_per_tensor():
    """C applies to the flattened model: one tensor far off, the rest at the anchor."""
    params = [torch.tensor([3.0, 4.0], requires_grad=True), torch.zeros(3, requires_grad=True)]
    anchor = [torch.zeros(2), torch.zeros(3)]
    # ‖w − x‖ = 5 > C = 4: value ½·1·(25 − 16) = 4.5, gradient [3, 4] and zeros.
    out = blur_loss(params, anchor, 1.0, 4.0)
    assert float(out.detach()) == pytest.approx(4.5)
    g0, g1 = torch.autograd.grad(out, params)
    assert torch.allclose(g0, torch.tensor([3.0, 4.0]))
    assert torch.equal(g1, torch.zeros(3))


def test_anchor_is_treated_as_constant():
    params = [torch.tensor([3.0, 4.0], requires_grad=True)]
    anchor = [torch.zeros(2, requires_grad=True)]
    out = blur_loss(params, anchor, 1.0, 1.0)
    (g_anchor,) = torch.autograd.grad(out, anchor, allow_unused=True)
    assert g_anchor is None


def test_errors_name_keys():
    _, params, anchor, _, _ = _setup(shift=0.1)
    with pytest.raises(ValueError, match=r"algo\.blur_lambda"):
        blur_loss(params, anchor, -0.1, 1.0)
    with pytest.raises(ValueError, match=r"privacy\.clip_norm"):
        blur_loss(params, anchor, 0.4, -1.0)
    with pytest.raises(ValueError, match="anchor"):
        blur_loss(params, anchor[:-1], 0.4, 1.0)
