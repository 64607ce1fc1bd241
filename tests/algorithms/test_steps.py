"""Tests for algorithms.pieces.steps: plain, SAM/ASAM and DP-FedPGN local gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from algorithms.pieces.steps import (
    gradients,
    pgn_gradients,
    sam_gradients,
    sam_perturbation,
)


def apply_sgd_(params: list[torch.Tensor], grads: list[torch.Tensor], lr: float) -> None:
    """w <- w - lr*g in place: the plain step these hand checks take."""
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p.sub_(g, alpha=float(lr))


A = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)


class Quadratic(nn.Module):
    """One parameter w ∈ R², loss f(w) = ½ wᵀ A w with A = diag(2, 1), ∇f = A w."""

    def __init__(self, w0: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w0, dtype=torch.float64))

    def loss(self) -> torch.Tensor:
        return 0.5 * self.w @ A @ self.w


def _mlp_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(16, 5)
    y = torch.randint(0, 3, (16,))
    params = [p for p in model.parameters() if p.requires_grad]

    def closure() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    return model, params, closure


def _copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _assert_equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in ts))


# --------------------------------------------------------------------------- gradients


def test_gradients_match_backward_and_leave_grad_untouched():
    model, params, closure = _mlp_setup()
    loss, grads = gradients(params, closure)
    assert all(p.grad is None for p in params)
    assert all(not g.requires_grad for g in grads)
    closure().backward()
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g)
    assert loss == pytest.approx(float(closure().detach()))


def test_gradients_unused_param_gets_zeros():
    lin = nn.Linear(2, 1)
    unused = nn.Parameter(torch.ones(3))
    x = torch.ones(4, 2)
    _, grads = gradients([*lin.parameters(), unused], lambda: lin(x).sum())
    assert torch.equal(grads[2], torch.zeros(3))
    assert float(grads[0].abs().sum()) > 0


# --------------------------------------------------------------------------- SAM / ASAM


@pytest.mark.parametrize("asam", [False, True])
def test_sam_rho_zero_is_exactly_sgd(asam):
    _, params, closure = _mlp_setup()
    loss0, g0 = gradients(params, closure)
    loss1, g1 = sam_gradients(params, closure, rho=0.0, asam=asam)
    assert loss0 == loss1
    _assert_equal_lists(g0, g1)


@pytest.mark.parametrize("asam", [False, True])
def test_sam_restores_params_bit_exactly(asam):
    _, params, closure = _mlp_setup()
    saved = _copy(params)
    _, g_plain = gradients(params, closure)
    loss, g_sam = sam_gradients(params, closure, rho=0.3, asam=asam)
    _assert_equal_lists(_copy(params), saved)
    # It really evaluated elsewhere: the SAM gradient differs from the plain one.
    assert any(not torch.allclose(a, b) for a, b in zip(g_plain, g_sam))
    assert loss == pytest.approx(float(closure().detach()))


def test_sam_restores_params_on_error():
    _, params, closure = _mlp_setup()
    saved = _copy(params)
    calls = {"n": 0}

    def flaky() -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return closure()

    with pytest.raises(RuntimeError, match="boom"):
        sam_gradients(params, flaky, rho=0.5, asam=False)
    _assert_equal_lists(_copy(params), saved)


@pytest.mark.parametrize("rho", [0.05, 0.5, 2.0])
def test_sam_perturbation_has_global_norm_rho(rho):
    _, params, closure = _mlp_setup()
    _, grads = gradients(params, closure)
    e = sam_perturbation(params, grads, rho, asam=False)
    assert _norm(e) == pytest.approx(rho, rel=1e-5)
    # Direction: parallel to g (global, not per tensor).
    gn = _norm(grads)
    for ei, gi in zip(e, grads):
        assert torch.allclose(ei, rho * gi / gn, atol=1e-6)


@pytest.mark.parametrize("rho", [0.05, 0.5])
def test_asam_perturbation_lies_on_asam_ball(rho):
    _, params, closure = _mlp_setup()
    assert all(bool((p != 0).all()) for p in params)
    _, grads = gradients(params, closure)
    e = sam_perturbation(params, grads, rho, asam=True)
    scaled_back = [ei / p.detach().abs() for ei, p in zip(e, params)]
    assert _norm(scaled_back) == pytest.approx(rho, rel=1e-5)
    # And ASAM differs from plain SAM here.
    e_plain = sam_perturbation(params, grads, rho, asam=False)
    assert any(not torch.allclose(a, b) for a, b in zip(e, e_plain))


@pytest.mark.parametrize("asam", [False, True])
def test_sam_perturbation_zero_cases(asam):
    params = [torch.ones(3), torch.ones(2)]
    zeros = [torch.zeros(3), torch.zeros(2)]
    _assert_equal_lists(sam_perturbation(params, zeros, 0.5, asam), zeros)
    grads = [torch.ones(3), torch.ones(2)]
    _assert_equal_lists(sam_perturbation(params, grads, 0.0, asam), zeros)


def test_sam_hand_computed_step():
    """Plain SAM on f(w) = ½ wᵀ diag(2, 1) w, w0 = [1, 1], ρ = 0.1, η = 0.1.

    g = A w0 = [2, 1], ‖g‖ = √5 = 2.2360679775
    e = 0.1·[2, 1]/√5 = [0.0894427191, 0.04472135955]
    w0 + e = [1.0894427191, 1.04472135955]
    ∇f(w0 + e) = A(w0 + e) = [2.1788854382, 1.04472135955]
    w1 = w0 − 0.1·∇f(w0 + e) = [1 − 0.21788854382, 1 − 0.104472135955]
       = [0.78211145618, 0.895527864045];  loss at w0 = ½(2 + 1) = 1.5
    """
    m = Quadratic([1.0, 1.0])
    params = [m.w]
    e = sam_perturbation(params, [A @ m.w.detach()], 0.1, asam=False)
    assert torch.allclose(
        e[0], torch.tensor([0.0894427191, 0.04472135955], dtype=torch.float64), rtol=0, atol=1e-9
    )
    loss, grads = sam_gradients(params, m.loss, rho=0.1, asam=False)
    assert loss == pytest.approx(1.5, abs=1e-12)
    expect_g = torch.tensor([2.1788854382, 1.04472135955], dtype=torch.float64)
    assert torch.allclose(grads[0], expect_g, rtol=0, atol=1e-7)
    apply_sgd_(params, grads, lr=0.1)
    expect_w = torch.tensor([0.78211145618, 0.895527864045], dtype=torch.float64)
    assert torch.allclose(m.w.detach(), expect_w, rtol=0, atol=1e-7)


def test_asam_hand_computed_step():
    """ASAM on the same quadratic, w0 = [1, 2], ρ = 0.1, η = 0.1.

    g = A w0 = [2, 2];  T_w = |w0| = [1, 2]
    T_w g = [2, 4], ‖T_w g‖ = √20 = 2√5 = 4.472135955
    T_w² g = [1·2, 4·2] = [2, 8]
    e = 0.1·[2, 8]/(2√5) = [0.04472135955, 0.1788854382]
      (plain SAM would give 0.1·[2, 2]/(2√2) = [0.0707, 0.0707])
    w0 + e = [1.04472135955, 2.1788854382]
    ∇f(w0 + e) = [2·1.04472135955, 2.1788854382] = [2.0894427191, 2.1788854382]
    w1 = w0 − 0.1·∇f = [1 − 0.20894427191, 2 − 0.21788854382]
       = [0.79105572809, 1.78211145618];  loss at w0 = ½(2·1 + 4) = 3
    """
    m = Quadratic([1.0, 2.0])
    params = [m.w]
    e = sam_perturbation(params, [A @ m.w.detach()], 0.1, asam=True)
    assert torch.allclose(
        e[0], torch.tensor([0.04472135955, 0.1788854382], dtype=torch.float64), rtol=0, atol=1e-9
    )
    loss, grads = sam_gradients(params, m.loss, rho=0.1, asam=True)
    assert loss == pytest.approx(3.0, abs=1e-12)
    expect_g = torch.tensor([2.0894427191, 2.1788854382], dtype=torch.float64)
    assert torch.allclose(grads[0], expect_g, rtol=0, atol=1e-7)
    apply_sgd_(params, grads, lr=0.1)
    expect_w = torch.tensor([0.79105572809, 1.78211145618], dtype=torch.float64)
    assert torch.allclose(m.w.detach(), expect_w, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- PGN


def test_pgn_hand_computed_step():
    """PGN on the quadratic, w0 = [1, 1], g̃ = [1, −1], β = 0.3, ρ = 0.2, η = 0.1.

    ‖g̃‖ = √2;  δ = 0.2·[1, −1]/√2 = [0.141421356237, −0.141421356237]
    w0 + δ = [1.141421356237, 0.858578643763]
    ∇F(w0 + δ) = [2.282842712475, 0.858578643763]
    g = 0.3·∇F + 0.7·g̃ = [0.684852813742 + 0.7, 0.257573593129 − 0.7]
      = [1.384852813742, −0.442426406871]
    w1 = w0 − 0.1·g = [0.861514718626, 1.044242640687]
    loss at w0 + δ = ½(2·1.141421356237² + 0.858578643763²) = 1.671421356237
    """
    m = Quadratic([1.0, 1.0])
    params = [m.w]
    saved = _copy(params)
    g_tilde = [torch.tensor([1.0, -1.0], dtype=torch.float64)]
    loss, grads = pgn_gradients(params, m.loss, beta=0.3, rho=0.2, g_tilde=g_tilde)
    _assert_equal_lists(_copy(params), saved)
    assert loss == pytest.approx(1.671421356237, abs=1e-9)
    expect_g = torch.tensor([1.384852813742, -0.442426406871], dtype=torch.float64)
    assert torch.allclose(grads[0], expect_g, rtol=0, atol=1e-7)
    apply_sgd_(params, grads, lr=0.1)
    expect_w = torch.tensor([0.861514718626, 1.044242640687], dtype=torch.float64)
    assert torch.allclose(m.w.detach(), expect_w, rtol=0, atol=1e-7)


def test_pgn_beta_one_rho_zero_is_exactly_gradients():
    _, params, closure = _mlp_setup()
    loss0, g0 = gradients(params, closure)
    g_tilde = [torch.randn_like(p) for p in params]
    for gt in (g_tilde, None):
        loss1, g1 = pgn_gradients(params, closure, beta=1.0, rho=0.0, g_tilde=gt)
        assert loss1 == loss0
        _assert_equal_lists(g0, g1)


def test_pgn_without_g_tilde_is_scaled_gradient():
    _, params, closure = _mlp_setup()
    saved = _copy(params)
    _, g0 = gradients(params, closure)
    _, g1 = pgn_gradients(params, closure, beta=0.3, rho=0.2, g_tilde=None)
    _assert_equal_lists(_copy(params), saved)
    for a, b in zip(g0, g1):
        assert torch.allclose(b, 0.3 * a, rtol=0, atol=1e-7)
    # A zero g̃ also gives δ = 0 (same as None).
    zeros = [torch.zeros_like(p) for p in params]
    _, g2 = pgn_gradients(params, closure, beta=0.3, rho=0.2, g_tilde=zeros)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_pgn_restores_params_bit_exactly():
    _, params, closure = _mlp_setup()
    saved = _copy(params)
    _, g0 = gradients(params, closure)
    g_tilde = [torch.randn_like(p) for p in params]
    _, g1 = pgn_gradients(params, closure, beta=1.0, rho=0.5, g_tilde=g_tilde)
    _assert_equal_lists(_copy(params), saved)
    assert any(not torch.allclose(a, b) for a, b in zip(g0, g1))


# --------------------------------------------------------------------------- errors


def test_errors_name_keys():
    _, params, closure = _mlp_setup()
    _, grads = gradients(params, closure)
    with pytest.raises(ValueError, match=r"algo\.rho"):
        sam_perturbation(params, grads, -0.1, asam=False)
    with pytest.raises(ValueError, match=r"algo\.rho"):
        sam_gradients(params, closure, rho=-1.0, asam=True)
    with pytest.raises(ValueError, match=r"algo\.beta"):
        pgn_gradients(params, closure, beta=1.5, rho=0.2, g_tilde=None)
    with pytest.raises(ValueError, match=r"algo\.beta"):
        pgn_gradients(params, closure, beta=-0.1, rho=0.2, g_tilde=None)
    with pytest.raises(ValueError, match=r"algo\.rho"):
        pgn_gradients(params, closure, beta=0.5, rho=-0.2, g_tilde=None)
    with pytest.raises(ValueError, match="g_tilde"):
        pgn_gradients(params, closure, beta=0.5, rho=0.2, g_tilde=grads[:1])
