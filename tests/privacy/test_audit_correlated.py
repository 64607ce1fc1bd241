"""The canary audit under correlated noise (engine.privacy.audit_correlated): the
decoding of the model trajectory against the servers' own steps, the canaries'
participation against the accountant's sensitivity, and the audit's verdicts — below
the accountant's ε with the noise the accountant assumed, above it with a tenth."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms.dp_bandmf import BandedMF, BandedStep, MinSeparation
from algorithms.dp_ftrl import EpochPasses, FTRLStep, TreeAggregation
from algorithms.server_step import StepContext
from engine.privacy import banded_mf
from engine.privacy.accounting import compute_epsilon
from engine.privacy.audit import AuditSpec, gaussian_pair_epsilon
from engine.privacy.audit_correlated import (
    CorrelatedCanaryAudit,
    decode_momentum,
    matched_filter,
)
from engine.privacy.tree_aggregation import decode_tree, tree_observation, tree_sensitivity_sq

DELTA = 1e-5
GAMMA, LR = 0.9, 0.5


def _mechanism(mode: str, z: float, rounds: int, bands: int = 2):
    """(participation, server step piece, the run's server step, noise scheme) of a
    40-client population, m = 10."""
    sampling: EpochPasses | MinSeparation
    step: FTRLStep | BandedStep
    if mode == "epochs":  # R = 4 rounds per epoch
        sampling, step, scheme = EpochPasses(40, 10), FTRLStep(GAMMA), TreeAggregation()
    else:
        sampling = MinSeparation(40, 10, bands, rounds)
        step, scheme = BandedStep(GAMMA), BandedMF(bands)
    ctx = StepContext(LR, 0.1, 1.0, None, sampling, [], 0)
    return sampling, step, step.start(ctx), scheme


def _audit(spec: AuditSpec, w: torch.Tensor, mode: str, rounds: int, bands: int = 2):
    sampling, step, _, scheme = _mechanism(mode, 1.0, rounds, bands)
    return CorrelatedCanaryAudit(spec, w, scheme.audit_model(sampling, step, rounds))


def _spec(seed: int, k: int, d: int, mode: str, rounds: int, every_round: bool = True):
    statistic = "whitened_tree_nodes" if mode == "epochs" else "whitened_banded_strategy"
    return AuditSpec(seed, k, d, 0.25, 40, DELTA, every_round, statistic, rounds=rounds)


@pytest.mark.parametrize("mode", ["epochs", "bands"])
def test_decoding_the_trajectory_recovers_the_independent_observations(mode):
    """From the models alone (their changes, the public γ, η_s, m), W·X̂ must be the
    mechanism's independent-noise observations: the tree's node values (sum of the
    node's rounds plus its own draw) or BandMF's C·X + Z — computed here from the
    inputs the server step was given."""
    rounds, d = 11, 6  # dp_ftrl: two full epochs of 4 and a partial one of 3
    sampling, _, server, _ = _mechanism(mode, 1.0, rounds, bands=3)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(rounds, d, generator=g, dtype=torch.float64)
    zs = torch.randn(rounds, d, generator=g)
    w = torch.randn(d, generator=g)
    changes = []
    for t in range(rounds):
        new = server.step(t, xs[t], w, zs[t])
        changes.append((new - w).double().numpy())
        w = new
    q = np.array(changes)
    m = sampling.denominator
    if mode == "epochs":
        obs = tree_observation(rounds, sampling.rounds_per_epoch)
        sums = decode_tree(q, sampling.rounds_per_epoch, GAMMA) * m / LR
    else:
        obs = np.array(banded_mf.strategy(rounds, 3))
        sums = decode_momentum(q, GAMMA) * m / LR
    expected = obs @ xs.numpy() + zs.double().numpy()  # each row: one N(0, z²) draw
    np.testing.assert_allclose(obs @ sums, expected, atol=2e-4)
    if mode == "epochs":  # row t covers the node of level v₂(leaf) ending at t
        assert obs[3].tolist()[:4] == [1, 1, 1, 1] and obs[2].tolist()[:4] == [0, 0, 1, 0]
        assert obs[4].tolist()[3:6] == [0, 1, 0]  # a new tree every epoch


@pytest.mark.parametrize("per_epoch", [1, 3, 4, 7])
def test_tree_canary_takes_the_accountants_worst_case(per_epoch):
    """Leaf 1 of every epoch lies in ⌈log₂(r + 1)⌉ released nodes of an epoch of r
    rounds, the D(r) the accountant's tree event charges: the signal norm equals the
    accounted sensitivity after every round (the strongest canary it covers)."""
    for rounds in range(1, 2 * per_epoch + 3):
        w = tree_observation(rounds, per_epoch)
        pattern = (np.arange(rounds) % per_epoch == 0).astype(float)
        assert np.linalg.norm(w @ pattern) ** 2 == pytest.approx(
            tree_sensitivity_sq(rounds, per_epoch)
        )
        d_r = math.ceil(math.log2(min(rounds, per_epoch) + 1))
        assert tree_sensitivity_sq(rounds, per_epoch) >= d_r


@pytest.mark.parametrize("mode", ["epochs", "bands"])
def test_participation_beyond_the_accountant_is_refused(mode):
    """A canary pattern the accountant does not cover (every round) is refused at
    start-up: the audit's verdicts would not be about the accounted mechanism."""
    rounds = 8
    audit = _audit(_spec(0, 4, 10, mode, rounds), torch.zeros(10), mode, rounds)
    assert audit.participations.sum() == 0
    audit.period = 1
    with pytest.raises(RuntimeError, match="exceeds the accounted sensitivity"):
        audit.check_covered()


def _audit_run(mode: str, z: float, scale: float, seed: int, every_round: bool = True):
    """The audit on the mechanism itself (the servers' own steps), without training:
    8 rounds, K = 400 canaries in R^12000, real clients' sums of norm 10 in random
    directions, and the noise the accountant assumed (``scale`` = 1) or a fraction of
    it. Returns (accountant ε, canary's exact ε, estimate, lower bound, audit)."""
    rounds, k, d = 8, 400, 12_000
    sampling, _, server, scheme = _mechanism(mode, z, rounds)
    w = torch.zeros(d)
    audit = _audit(_spec(seed, k, d, mode, rounds, every_round), w, mode, rounds)
    g = torch.Generator().manual_seed(1000 + seed)
    cols: dict = {}
    for t in range(rounds):
        x = audit.canary_sum(t, 1.0, None)
        x = x + 10 * torch.randn(d, generator=g, dtype=torch.float64) / math.sqrt(d)
        new = server.step(t, x, w, torch.randn(d, generator=g) * (z * scale))
        cols = audit.observe_round(t, w, new, rounds)
        w = new
    eps = compute_epsilon(z, sampling, rounds, DELTA, "rdp", noise=scheme)
    signal = float(np.linalg.norm(audit.w @ audit.pattern(rounds)))  # = the sensitivity
    exact = gaussian_pair_epsilon(signal / z, 1.0, 0.0, 1.0, DELTA)
    est = cols["audit_epsilon_estimate_nonprivate"]
    return eps, exact, est, cols["audit_epsilon_lower_nonprivate"], audit


@pytest.mark.parametrize("mode, z", [("epochs", 5.0), ("bands", 4.0)])
def test_audit_below_the_accountant_and_detects_a_tenth_of_the_noise(mode, z):
    """With the accounted noise the 95 % lower bound stays below the accountant's ε and
    the estimate lands near the canary's exact ε (the whitened statistic is the
    Neyman–Pearson test of the canary: K = 400 give ±√(2/K) ≈ 0.07 in μ, ±0.35 in ε
    here). With a tenth of the noise — a mechanism that breaks the accountant's claim —
    the lower bound rises above the accountant's ε: the audit can see a violation."""
    eps, exact, est, lower, audit = _audit_run(mode, z, 1.0, seed=0)
    times = 2 if mode == "epochs" else 4  # rounds 0 and 4 (R = 4) / 0, 2, 4, 6 (b = 2)
    assert audit.participations.tolist() == [times] * 400
    assert 1.5 < exact < eps < 2.5, (exact, eps)  # RDP: the accountant is a bit above
    assert 0 <= lower < eps, (lower, eps)
    assert abs(est - exact) < 0.8, (est, exact)
    eps_bad, _, est_bad, lower_bad, _ = _audit_run(mode, z, 0.1, seed=0)
    assert eps_bad == eps  # the accountant still claims the same ε
    assert lower_bad > eps + 0.5 and est_bad > 4 * eps, (lower_bad, est_bad, eps)


def test_final_model_statistic_and_checkpointed_state():
    """Without ``eval.audit_every_round`` the adversary sees the final model only (the
    base audit's cosine, weaker); the audit state survives a checkpoint."""
    eps, _, est, lower, _ = _audit_run("bands", 4.0, 1.0, seed=1, every_round=False)
    assert 0 <= lower < eps and est < eps
    spec = _spec(0, 3, 5, "epochs", 8)
    a = _audit(spec, torch.zeros(5), "epochs", 8)
    a.canary_sum(0, 1.0, None)
    a.observe_round(0, torch.zeros(5), torch.ones(5), 8)
    b = _audit(spec, torch.zeros(5), "epochs", 8)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.proj, b.proj)
    np.testing.assert_array_equal(a.participations, b.participations)
    assert spec.statistic == "whitened_tree_nodes"


def test_matched_filter_is_the_projection_on_the_canary_signal():
    w = np.array([[1.0, 0.0], [0.5, 1.0]])
    sums = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = w @ np.array([1.0, 0.0])
    np.testing.assert_allclose(
        matched_filter(w, sums, np.array([1.0, 0.0])), v @ (w @ sums) / np.linalg.norm(v)
    )
