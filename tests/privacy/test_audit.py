"""The canary audit: the estimator against oracles, and its behaviour in real runs."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from scipy import integrate, stats

from algorithms.recipes import RECIPES
from engine.config import ConfigError, load_config
from engine.privacy.audit import (
    gaussian_fit_epsilon,
    gaussian_pair_epsilon,
    hockey_stick,
    threshold_lower_bound,
)
from engine.simulation import prepare, simulate
from tests.conftest import SMALL


@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
def test_equal_variance_pair_is_the_gaussian_mechanism(mu):
    """N(0,1) vs N(μ,1) is the Gaussian mechanism with noise multiplier 1/μ: compare
    with dp-accounting's PLD of GaussianDpEvent(1/μ) (an independent computation)."""
    delta = 1e-5
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(1.0 / mu))
    expected = acc.get_epsilon(delta)
    assert gaussian_pair_epsilon(mu, 1.0, 0.0, 1.0, delta) == pytest.approx(expected, abs=2e-3)


def test_hockey_stick_with_unequal_variances_matches_numerical_integration():
    for mp, sp, mq, sq, eps in [(0.3, 1.4, 0.0, 1.0, 0.5), (1.0, 0.6, 0.2, 1.0, 1.0)]:
        p, q = stats.norm(mp, sp), stats.norm(mq, sq)
        value, _ = integrate.quad(
            lambda x, p=p, q=q, eps=eps: max(0.0, p.pdf(x) - math.exp(eps) * q.pdf(x)),
            -30,
            30,
            limit=500,
            points=[mp, mq],
        )
        assert hockey_stick(mp, sp, mq, sq, eps) == pytest.approx(value, abs=1e-7)


def test_estimate_and_lower_bound_on_a_known_gaussian_mechanism():
    """Statistics drawn from the pair of a Gaussian mechanism with ε ≈ 6.1 at δ = 1e-3:
    the estimate is close to it and the lower bound is positive but below it."""
    delta, mu = 1e-3, 2.0
    rng = np.random.default_rng(0)
    inserted, held_out = rng.normal(mu, 1, 5000), rng.normal(0, 1, 5000)
    true_eps = gaussian_pair_epsilon(mu, 1.0, 0.0, 1.0, delta)
    assert gaussian_fit_epsilon(inserted, held_out, delta) == pytest.approx(true_eps, rel=0.1)
    lower = threshold_lower_bound(inserted, held_out, delta)
    assert 0.5 < lower < true_eps
    # nothing inserted: no lower bound, and a small estimate
    same = rng.normal(0, 1, 5000)
    assert threshold_lower_bound(same, held_out, delta) == 0.0
    assert gaussian_fit_epsilon(same, held_out, delta) < 0.3


AUDIT_RUN = [
    *SMALL,
    "dataset.num_clients=200",
    "sampling.rate=0.1",
    "rounds=20",
    "local.steps=1",
    "eval.every=20",
    "eval.audit_canaries=500",
]


def _audit(z: float) -> tuple[float, float, float]:
    res = simulate(
        load_config(overrides=[*AUDIT_RUN, f"privacy.noise_multiplier={z}"]), write=False
    )
    last = res.rounds.iloc[-1]
    est = float(last["audit_epsilon_estimate_nonprivate"])
    return res.final_epsilon, est, float(last["audit_epsilon_lower_nonprivate"])


def test_estimate_below_the_accountant_with_noise_and_far_above_without():
    eps, est, lower = _audit(0.7)
    assert 0 < est < eps
    assert 0 <= lower < eps
    eps0, est0, lower0 = _audit(0.0)
    assert math.isinf(eps0)
    # σ → 0: the canaries are plainly visible; the estimate passes the noised run's ε
    # (the shift model is bounded by the canaries' own spread: Δ/σ of a few)
    assert est0 > eps and est0 > 2 * est, (est0, eps, est)
    assert lower0 > lower


def test_canaries_do_not_change_the_accounted_epsilon():
    base = [*SMALL, "rounds=3", "privacy.epsilon=3"]
    plain = simulate(load_config(overrides=base), write=False)
    audited = simulate(load_config(overrides=[*base, "eval.audit_canaries=25"]), write=False)
    np.testing.assert_array_equal(plain.rounds["epsilon"], audited.rounds["epsilon"])
    assert plain.privacy["noise_multiplier"] == audited.privacy["noise_multiplier"]
    assert audited.privacy["population_real"] == 40
    assert audited.privacy["population_with_canaries"] == 65
    assert "audit_epsilon_estimate_nonprivate" not in plain.rounds
    # a non-private recipe has no clip norm to scale canaries with: no audit, no columns
    assert (
        prepare(load_config(overrides=[*SMALL, "algorithm=fedavg", "eval.audit_canaries=5"])).audit
        is None
    )
    with pytest.raises(ConfigError, match="eval.audit_canaries=-1: must be >= 0"):
        load_config(overrides=["eval.audit_canaries=-1"])


PRIVATE = [
    name for name, recipe in RECIPES.items() if recipe.private and recipe.participation == "sampled"
]
#: Correlated noise (DP-FTRL, DP-BandMF): the adapted audit (engine.privacy.audit_correlated).
CORRELATED = [name for name, recipe in RECIPES.items() if recipe.participation != "sampled"]


@pytest.mark.parametrize("algorithm", CORRELATED)
def test_correlated_noise_recipes_run_the_adapted_audit_and_refuse_adaptive_clipping(algorithm):
    """Adaptive clipping (its count release is not accounted with the correlated event)
    is refused, naming the key. The canary audit runs its correlated-noise form: every
    canary in the participation's worst-case rounds, the whitened statistic over the
    trajectory, its 95 % lower bound below the accountant's ε, which the canaries do
    not change."""
    assert CORRELATED, "no correlated-noise recipe registered"
    base = [*SMALL, f"algorithm={algorithm}", "rounds=3"]
    with pytest.raises(ConfigError, match="privacy.clip_mode"):
        over = [*base, "privacy.clip_mode=adaptive", "privacy.clip_count_stddev=2"]
        prepare(load_config(overrides=over))
    run = [
        *SMALL,
        f"algorithm={algorithm}",
        "dataset.num_clients=80",
        "sampling.rate=0.1",
        "rounds=8",
        "local.steps=1",
        "eval.every=8",
        "privacy.epsilon=2",
    ]
    audited = [*run, "eval.audit_canaries=200", "eval.audit_every_round=true"]
    plain = prepare(load_config(overrides=run)).plan
    res = simulate(load_config(overrides=audited), write=False)
    assert res.privacy["noise_multiplier"] == plain.noise_multiplier
    assert res.final_epsilon == pytest.approx(plain.planned_epsilon) and res.final_epsilon <= 2
    stat = {"dp_ftrl": "whitened_tree_nodes", "dp_bandmf": "whitened_banded_strategy"}
    assert res.privacy["audit_statistic"] == stat.get(algorithm, res.privacy["audit_statistic"])
    last = res.rounds.iloc[-1]
    assert last["audit_canaries_participated_nonprivate"] == 200
    assert 0 <= last["audit_epsilon_lower_nonprivate"] < res.final_epsilon
    assert last["audit_epsilon_estimate_nonprivate"] > 0
    assert np.isnan(res.rounds["audit_epsilon_lower_nonprivate"].iloc[0])


@pytest.mark.parametrize("algorithm", PRIVATE)
def test_adaptive_clipping_and_audit_on_every_private_recipe(algorithm):
    over = [
        *SMALL,
        f"algorithm={algorithm}",
        "rounds=3",
        "privacy.clip_mode=adaptive",
        "privacy.clip_count_stddev=2",
        "privacy.clip_lr=1.0",
        "eval.audit_canaries=10",
        "eval.audit_every_round=true",
    ]
    res = simulate(load_config(overrides=over), write=False)
    r = res.rounds
    c, b = r["clip_norm"].to_numpy(), r["unclipped_fraction_released"].to_numpy()
    # the next clip norm is exactly the public update from the released count
    np.testing.assert_allclose(c[1:], c[:-1] * np.exp(-1.0 * (b[:-1] - 0.5)), rtol=1e-12)
    assert c[0] == 1.0
    # every update was clipped with the round's C_t
    assert (r["max_clipped_norm_nonprivate"].to_numpy() <= c * (1 + 1e-9)).all()
    assert np.isfinite(r["audit_epsilon_estimate_nonprivate"].iloc[-1])
    assert r["audit_epsilon_lower_nonprivate"].iloc[-1] >= 0


def test_compare_prints_the_audit_beside_the_accountant(tmp_path):
    from engine.simulation.compare import compare, format_table

    config = load_config(overrides=[*SMALL, "eval.audit_canaries=20", "privacy.epsilon=4"])
    summary = compare(config, ["fedavg", "dp_fedavg"], tmp_path, progress=False)
    table = format_table(summary)
    assert "epsilon" in table and "audit_epsilon_estimate_nonprivate" in table
    row = summary.set_index("algorithm").loc["dp_fedavg"]
    assert row["epsilon"] <= 4
    assert np.isfinite(row["audit_epsilon_estimate_nonprivate"])
    assert np.isnan(summary.set_index("algorithm").loc["fedavg", "audit_epsilon_lower_nonprivate"])


def test_the_estimate_does_not_read_a_variance_mismatch_as_privacy_loss():
    """The Gaussian mechanism shifts the mean only. Statistics with equal means and a
    10 % larger spread among the inserted canaries (what sampling noise alone gives
    with ~100 canaries) must not look like leakage; a per-set variance fit reads
    ε ≈ 1.6 at δ = 1e-5 there."""
    delta = 1e-5
    rng = np.random.default_rng(1)
    inserted, held_out = rng.normal(0, 1.1, 20000), rng.normal(0, 1, 20000)
    assert gaussian_pair_epsilon(0.0, 1.1, 0.0, 1.0, delta) > 1.5  # the per-set fit's reading
    assert gaussian_fit_epsilon(inserted, held_out, delta) < 0.3
    # and with K = 100 canaries and nothing inserted, the estimate stays small on average
    small = [
        gaussian_fit_epsilon(rng.normal(0, 1, 100), rng.normal(0, 1, 100), delta) for _ in range(50)
    ]
    assert np.mean(small) < 0.8, np.mean(small)
