"""Tests for engine.privacy.accounting against dp-accounting 0.6.0.

The pinned ε literals were computed once, directly with dp_accounting (not through
engine.privacy.accounting), with:

    acc = rdp.RdpAccountant(neighboring_relation=ADD_OR_REMOVE_ONE)       # or
    acc = pld.PLDAccountant(ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    acc.compose(PoissonSampledDpEvent(q, GaussianDpEvent(z)), T)
    acc.get_epsilon(delta)

For example q=0.1, z=0.95, T=200, δ=1/500 gives RDP 8.5786 / PLD 7.3012.
"""

from __future__ import annotations

import logging
import math

import dp_accounting
import pytest
from dp_accounting import rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.privacy.accounting import (
    EpsilonTracker,
    SamplingSpec,
    compute_epsilon,
    default_delta,
)
from engine.privacy.resolve import Z_BRACKET, CalibrationError, calibrate_noise_multiplier

logging.getLogger("absl").setLevel(logging.ERROR)

REL = 1e-3

# (q, z, T, delta, eps_rdp, eps_pld or None) -- literals from dp_accounting directly.
REFERENCE = [
    (0.1, 0.95, 200, 1 / 500, 8.578643294252783, 7.301241435053174),
    (0.1, 0.95, 300, 1 / 500, 10.833829103224987, 9.372458915240614),
    (0.1, 0.8, 300, 1 / 500, 15.897971173234259, 13.459127393866584),
    (0.04, 1.0, 1000, 1 / 3400, 7.656629786038248, 6.8102056494311585),
    (0.01, 1.1, 10000, 1e-5, 5.632010670081592, None),
]
# PLD is ~0.5 s per value: check two of them.
PLD_CHECKED = {(0.1, 0.95, 200), (0.04, 1.0, 1000)}

# Direct dp_accounting PLD (disc. 1e-4) for q=0.1, z=1.5, delta=1/500 at t rounds.
SMALL_PLD = {1: 0.19355126370688375, 5: 0.434583737630676, 20: 0.8859426849781665}


def poisson(q: float, n: int = 1000, max_cohort: int | None = None) -> SamplingSpec:
    return SamplingSpec("poisson", n, rate=q, max_cohort=max_cohort)


@pytest.mark.parametrize("q,z,T,delta,eps_rdp,eps_pld", REFERENCE)
def test_compute_epsilon_matches_pinned_dp_accounting_values(q, z, T, delta, eps_rdp, eps_pld):
    spec = poisson(q)
    assert compute_epsilon(z, spec, T, delta, "rdp") == pytest.approx(eps_rdp, rel=REL)
    if eps_pld is not None and (q, z, T) in PLD_CHECKED:
        assert compute_epsilon(z, spec, T, delta, "pld") == pytest.approx(eps_pld, rel=REL)
        # PLD is the tighter accountant on the same event.
        assert eps_pld < eps_rdp


def test_notes_reference_values_rounded():
    # Reference figures computed directly with dp_accounting (see the module docstring),
    # to their 4 decimals.
    spec = poisson(0.1)
    assert round(compute_epsilon(0.95, spec, 200, 1 / 500), 4) == 8.5786
    assert round(compute_epsilon(0.95, spec, 300, 1 / 500), 4) == 10.8338
    assert round(compute_epsilon(1.0, poisson(0.04), 1000, 1 / 3400), 4) == 7.6566


# 10 drawn settings (was 15: ~2.5 s of calibration each on 2 cores)
@settings(max_examples=10, deadline=None)
@given(
    eps=st.floats(0.5, 20.0),
    q=st.floats(0.01, 0.5),
    rounds=st.integers(1, 500),
    log_delta=st.floats(-7.0, -2.0),
)
def test_rdp_calibration_meets_target_and_is_tight(eps, q, rounds, log_delta):
    delta = 10.0**log_delta
    spec = poisson(q)
    z = calibrate_noise_multiplier(eps, delta, spec, rounds, "rdp")
    assert Z_BRACKET[0] <= z <= Z_BRACKET[1]
    assert compute_epsilon(z, spec, rounds, delta, "rdp") <= eps
    if z > Z_BRACKET[0] * (1 + 1e-9):
        # Any materially smaller z overshoots the target. brentq's tolerance is an
        # absolute 1e-4 on z, so for tiny z allow a few absolute tolerances.
        z_smaller = min(z * (1 - 1e-3), z - 3e-4)
        if z_smaller > Z_BRACKET[0]:
            assert compute_epsilon(z_smaller, spec, rounds, delta, "rdp") > eps


def test_rdp_calibration_matches_notes():
    spec = poisson(0.1)
    z = calibrate_noise_multiplier(4.0, 1 / 500, spec, 300, "rdp")
    assert z == pytest.approx(1.6882, abs=5e-4)
    assert compute_epsilon(z, spec, 300, 1 / 500, "rdp") <= 4.0


def test_pld_calibration_matches_notes_and_never_overshoots():
    spec = poisson(0.1)
    z = calibrate_noise_multiplier(4.0, 1 / 500, spec, 300, "pld")
    assert z == pytest.approx(1.5378, abs=5e-4)
    assert compute_epsilon(z, spec, 300, 1 / 500, "pld") <= 4.0
    assert compute_epsilon(z * (1 - 1e-3), spec, 300, 1 / 500, "pld") > 4.0


def test_fixed_size_sampling_is_replace_one_with_half_multiplier():
    n, m, z, rounds, delta = 500, 50, 0.95, 300, 1 / 500
    spec = SamplingSpec("fixed", n, cohort_size=m)
    assert spec.adjacency == "replace_one"
    assert spec.denominator == m
    ours = compute_epsilon(z, spec, rounds, delta)

    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z / 2)),
        rounds,
    )
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert ours == pytest.approx(300.8209304905048, rel=REL)  # pinned, direct dp_accounting

    # Sound but loose: far above Poisson sampling at the same rate q = m/N.
    eps_poisson = compute_epsilon(z, poisson(m / n, n), rounds, delta)
    assert eps_poisson == pytest.approx(10.833829103224987, rel=REL)
    assert ours > 10 * eps_poisson


def test_fixed_size_sampling_rejects_pld():
    spec = SamplingSpec("fixed", 500, cohort_size=50)
    with pytest.raises(ValueError, match="privacy.accountant"):
        compute_epsilon(1.0, spec, 10, 1e-3, "pld")
    with pytest.raises(ValueError, match="privacy.accountant"):
        calibrate_noise_multiplier(4.0, 1e-3, spec, 10, "pld")
    with pytest.raises(ValueError, match="privacy.accountant"):
        EpsilonTracker(1.0, spec, 1e-3, "pld")


def test_truncated_poisson_with_generous_cap_costs_almost_nothing():
    n, q, z, rounds, delta = 400, 0.1, 1.2, 50, 1e-3
    cap = math.ceil(q * n + 4 * math.sqrt(q * n))  # 66
    truncated = poisson(q, n, max_cohort=cap)
    assert truncated.name == "truncated_poisson"
    assert truncated.default_accountant() == "pld"
    eps_trunc = compute_epsilon(z, truncated, rounds, delta, "pld")
    eps_plain = compute_epsilon(z, poisson(q, n), rounds, delta, "pld")
    # Pinned, direct dp_accounting (TruncatedSubsampledGaussianDpEvent, PLD 1e-4).
    assert eps_trunc == pytest.approx(2.3578381742782692, rel=REL)
    assert eps_trunc >= eps_plain * (1 - 1e-4)
    assert eps_trunc <= eps_plain * 1.01


def test_truncated_poisson_rejects_rdp():
    spec = poisson(0.1, 400, max_cohort=66)
    with pytest.raises(ValueError, match="privacy.accountant"):
        compute_epsilon(1.2, spec, 10, 1e-3, "rdp")
    with pytest.raises(ValueError, match="privacy.accountant"):
        EpsilonTracker(1.2, spec, 1e-3, "rdp")


def test_epsilon_tracker_rdp_equals_compute_epsilon():
    spec, delta, z = poisson(0.1, 500), 1 / 500, 0.95
    tracker = EpsilonTracker(z, spec, delta, "rdp")
    ts = [0, 1, 2, 10, 50, 200, 300]
    eps = [tracker.epsilon(t) for t in ts]
    assert eps[0] == 0.0
    for t, e in zip(ts, eps):
        assert e == pytest.approx(compute_epsilon(z, spec, t, delta, "rdp"), rel=1e-9, abs=0)
    assert all(a < b for a, b in zip(eps, eps[1:]))
    assert eps[ts.index(200)] == pytest.approx(8.578643294252783, rel=REL)
    assert eps[ts.index(300)] == pytest.approx(10.833829103224987, rel=REL)


def test_epsilon_tracker_pld_equals_compute_epsilon():
    spec, delta, z = poisson(0.1, 500), 1 / 500, 1.5
    tracker = EpsilonTracker(z, spec, delta, "pld")
    assert tracker.epsilon(0) == 0.0
    prev = 0.0
    for t, ref in SMALL_PLD.items():
        e = tracker.epsilon(t)
        assert e == pytest.approx(compute_epsilon(z, spec, t, delta, "pld"), rel=1e-6)
        assert e == pytest.approx(ref, rel=REL)
        assert e > prev
        prev = e


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_zero_noise_is_infinite_epsilon(accountant):
    spec = poisson(0.1, 500)
    tracker = EpsilonTracker(0.0, spec, 1e-3, accountant)
    assert tracker.epsilon(0) == 0.0
    assert tracker.epsilon(1) == math.inf
    assert compute_epsilon(0.0, spec, 5, 1e-3, accountant) == math.inf


def test_unreachable_target_raises_calibration_error():
    spec = poisson(0.1, 500)
    with pytest.raises(CalibrationError, match="privacy.epsilon") as info:
        calibrate_noise_multiplier(1e-4, 1 / 500, spec, 1000, "rdp")
    assert isinstance(info.value, ValueError)
    # The claim in the message is true: even z at the top of the bracket is too little.
    assert compute_epsilon(Z_BRACKET[1], spec, 1000, 1 / 500) > 1e-4
    with pytest.raises(CalibrationError, match="privacy.epsilon"):
        calibrate_noise_multiplier(0.0, 1 / 500, spec, 10, "rdp")


@pytest.mark.parametrize("n", [2, 10, 500, 3400, 10**6])
def test_default_delta(n):
    d = default_delta(n)
    assert d == min(n**-1.1, 0.01 / n)
    assert 0 < d < 1 / n and n * d <= 0.01


def test_sampling_spec_validation_names_keys():
    with pytest.raises(ValueError, match="sampling.mode"):
        SamplingSpec("uniform", 10, rate=0.1)
    with pytest.raises(ValueError, match="sampling.rate"):
        SamplingSpec("poisson", 10, rate=0.0)
    with pytest.raises(ValueError, match="sampling.cohort_size"):
        SamplingSpec("fixed", 10, cohort_size=11)
    assert poisson(0.05, 200).denominator == pytest.approx(10.0)
    assert poisson(0.05, 200).adjacency == "add_remove"
