"""DP-BandMF (issue 32): the banded strategy, its sensitivity under b-min-separation,
the correlated noise and the accounted ε, each against an independent computation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from algorithms.dp_bandmf import BandedServer, BandedStep
from engine.config import load_config
from engine.privacy import banded_mf as bm
from engine.privacy.accounting import SamplingSpec, compute_epsilon
from engine.privacy.resolve import calibrate_noise_multiplier
from engine.simulation import plan_privacy


def random_banded(n: int, b: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = np.tril(rng.normal(size=(n, n))) * (np.subtract.outer(np.arange(n), np.arange(n)) < b)
    np.fill_diagonal(c, np.abs(np.diag(c)) + 0.5)
    return c


def brute_force_sensitivity(c: np.ndarray, t: int, b: int) -> float:
    """max over every participation set in [0, t) whose members are ≥ b apart of
    max_{unit δ_i} ‖Σ_{i∈π} C[:t, i] δ_iᵀ‖_F, taken as the Gram form's largest value
    over sign patterns of scalar δ_i ∈ {−1, 1} (enough for disjoint supports) —
    computed directly from the matrix, without the disjoint-support argument."""
    best = 0.0
    cols = c[:t, :t]
    for r in range(1, t + 1):
        for pi in itertools.combinations(range(t), r):
            if any(j - i < b for i, j in zip(pi, pi[1:])):
                continue
            for signs in itertools.product((-1.0, 1.0), repeat=len(pi)):
                v = sum(s * cols[:, i] for s, i in zip(signs, pi))
                best = max(best, float(np.linalg.norm(v)))
    return best


@pytest.mark.parametrize(("n", "b"), [(7, 2), (8, 3), (6, 1)])
def test_sensitivity_equals_brute_force(n: int, b: int) -> None:
    c = random_banded(n, b, seed=n + b)
    for t in (n, n - 2):
        assert bm.sensitivity(c, t, b) == pytest.approx(brute_force_sensitivity(c, t, b), 1e-12)


def test_a_matrix_that_is_not_banded_is_refused() -> None:
    c = random_banded(6, 2)
    c[5, 0] = 0.1
    with pytest.raises(ValueError, match="not lower triangular with 2 bands"):
        bm.sensitivity(c, 6, 2)


def test_strategy_is_banded_unit_columns_and_beats_its_start(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    bm.strategy.cache_clear()
    c = bm.strategy(24, 3)
    bm.check_banded(c, 3)
    assert np.allclose(np.linalg.norm(c, axis=0), 1.0)
    assert bm.workload_loss(c) < bm.workload_loss(bm.toeplitz_sqrt(24, 3))
    # unit columns, 3 bands: 8 participations in 24 rounds, sensitivity √8
    assert bm.sensitivity(c, 24, 3) == pytest.approx(math.sqrt(8))
    bm.strategy.cache_clear()
    assert np.array_equal(bm.strategy(24, 3), c)  # read back from the cache
    assert list((tmp_path / "strategies").glob("*.npy"))
    bm.strategy.cache_clear()


def test_noise_is_the_inverse_strategy_times_z() -> None:
    """Online forward substitution equals the dense solve C⁻¹Z (numpy)."""
    c = random_banded(11, 3, seed=4)
    z = np.random.default_rng(1).normal(size=(11, 5))
    want = np.linalg.solve(c, z)
    noise = bm.BandedNoise(c, 3)
    got = np.stack([noise.advance(torch.from_numpy(z[t])).numpy() for t in range(11)])
    assert np.allclose(got, want, atol=1e-10)
    assert len(noise.history) == 2


def test_server_step_equals_a_dense_reference() -> None:
    """x_T = x_0 + η Σ_t M_t, M_t = γ M_{t−1} + (x_t + (C⁻¹Z)_t)/m, computed densely."""
    c = random_banded(9, 2, seed=2)
    rng = np.random.default_rng(3)
    sums, z = rng.normal(size=(9, 4)), rng.normal(size=(9, 4))
    server = BandedServer(BandedStep(0.8), c, 2, 3.0, 0.5)
    w = torch.zeros(4, dtype=torch.float32)
    for t in range(9):
        w = server.step(t, torch.from_numpy(sums[t]), w, torch.from_numpy(z[t]))
    noisy = (sums + np.linalg.solve(c, z)) / 3.0
    m, x = np.zeros(4), np.zeros(4)
    for t in range(9):
        m = 0.8 * m + noisy[t]
        x = x + 0.5 * m
    assert np.allclose(w.numpy(), x, atol=1e-5)


def test_group_cohorts_are_b_min_separated() -> None:
    n, m, b = 40, 6, 4
    last: dict[int, int] = {}
    for t in range(5 * b):
        cohort = bm.group_cohort(9, t, n, m, b)
        assert len(cohort) == m == len(set(cohort.tolist()))
        for i in cohort.tolist():
            assert t - last.get(i, -b) >= b
            last[i] = t
    with pytest.raises(ValueError, match="N/bands = 10"):
        bm.group_cohort(9, 0, n, 11, b)


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Balle & Wang (2018): δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""

    def gap(e: float) -> float:
        return norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta

    return brentq(gap, 0.0, 500.0)


def test_epsilon_is_the_gaussian_mechanism_with_the_strategys_sensitivity() -> None:
    spec = SamplingSpec("bands", 100, cohort_size=10, bands=4, horizon=20)
    sens = bm.sensitivity(bm.strategy(20, 4), 20, 4)
    z = 3.0
    exact = exact_gaussian_epsilon(sens / z, 1e-5)
    rdp = compute_epsilon(z, spec, 20, 1e-5, "rdp")
    pld = compute_epsilon(z, spec, 20, 1e-5, "pld")
    assert exact <= pld <= rdp <= 1.3 * exact
    assert pld == pytest.approx(exact, rel=0.02)
    # fewer rounds: the strategy's first rows only, a smaller sensitivity
    assert compute_epsilon(z, spec, 5, 1e-5) < rdp


def test_calibration_and_plan() -> None:
    spec = SamplingSpec("bands", 100, cohort_size=10, bands=4, horizon=20)
    z = calibrate_noise_multiplier(2.0, 1e-5, spec, 20)
    assert compute_epsilon(z, spec, 20, 1e-5) <= 2.0 < compute_epsilon(0.999 * z, spec, 20, 1e-5)
    base = ["algorithm=dp_bandmf", "dataset.num_clients=200", "rounds=12", "privacy.epsilon=3"]
    plan = plan_privacy(load_config(overrides=base))
    assert plan.sampling.mode == "bands" and plan.sampling.bands == 4
    assert plan.summary()["sampling"] == "b_min_separation" and plan.planned_epsilon <= 3.0
    # m = 60: the default b shrinks to ⌊200/60⌋ = 3; b = 4 given explicitly is refused
    wide = plan_privacy(load_config(overrides=[*base, "sampling.rate=0.3"]))
    assert wide.sampling.bands == 3
    with pytest.raises(Exception, match="N/bands = 50"):
        plan_privacy(load_config(overrides=[*base, "sampling.rate=0.3", "algo.bands=4"]))
