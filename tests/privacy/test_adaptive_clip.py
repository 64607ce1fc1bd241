"""Adaptive (quantile) clipping: the accounted z, the round's noise and the centred count."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch

from engine.config import ConfigError, load_config
from engine.federated.client import PartialSum
from engine.privacy.accounting import compute_epsilon
from engine.privacy.adaptive_clip import (
    AdaptiveClipError,
    composed_noise_multiplier,
    update_noise_multiplier,
)
from engine.privacy.kernels import clip_update
from engine.simulation import make_executor, prepare, simulate
from tests.conftest import SMALL


def _server(overrides: list[str]):
    prep = prepare(load_config(overrides=[*SMALL, *overrides]))
    return prep, make_executor(prep).pool.server


def _partial(deltas: list[torch.Tensor], clip: float, dim: int) -> PartialSum:
    """What a worker sends: clipped updates summed with the round's C_t."""
    out = PartialSum(update_sum=np.zeros(dim), num_clients=0)
    for d in deltas:
        res = clip_update(d, clip)
        out.update_sum += res.update.double().numpy()
        out.num_clients += 1
        out.num_clipped += int(res.clipped)
    return out


def test_update_noise_multiplier_composes_back_to_the_accounted_z():
    for z, sb in [(0.7, 5.0), (1.2, 1.0), (3.0, 1.6)]:
        zd = update_noise_multiplier(z, sb)
        assert zd > z
        assert composed_noise_multiplier(zd, sb) == pytest.approx(z, rel=1e-12)
        # Independent oracle: RDP of the two Gaussians (sensitivities 1 and 1/2, i.e.
        # multipliers z_Δ and 2σ_b) composed equals one Gaussian with z.
        both = dp_accounting.rdp.RdpAccountant()
        both.compose(dp_accounting.GaussianDpEvent(zd))
        both.compose(dp_accounting.GaussianDpEvent(2 * sb))
        one = dp_accounting.rdp.RdpAccountant()
        one.compose(dp_accounting.GaussianDpEvent(z))
        np.testing.assert_allclose(both._rdp, one._rdp, rtol=1e-9)  # noqa: SLF001


def test_z_must_be_below_twice_the_count_stddev():
    with pytest.raises(AdaptiveClipError, match="clip_count_stddev=0.5"):
        update_noise_multiplier(1.0, 0.5)
    with pytest.raises(ConfigError, match=r"privacy.clip_count_stddev=0.4.*< 2\*clip_count"):
        prepare(
            load_config(
                overrides=[
                    *SMALL,
                    "privacy.clip_mode=adaptive",
                    "privacy.noise_multiplier=1.0",
                    "privacy.clip_count_stddev=0.4",
                ]
            )
        )
    with pytest.raises(ConfigError, match="privacy.clip_mode='median'"):
        load_config(overrides=["privacy.clip_mode=median"])


def test_noise_is_sized_with_the_clip_norm_of_the_round():
    """m clients, all clipped: C_{t+1} ≈ C_t·e^{η/2} = e²·C_t; the update's noise std
    must be z_Δ·C_t (measured over d coordinates and several rounds)."""
    prep, server = _server(
        [
            "privacy.clip_mode=adaptive",
            "privacy.noise_multiplier=0.5",
            "privacy.clip_count_stddev=0.5",
            "privacy.clip_lr=4.0",
            "privacy.clip_norm=0.5",
            "rounds=3",
        ]
    )
    ad = prep.adaptive
    d, m = server.dim(), prep.plan.sampling.denominator
    gen = torch.Generator().manual_seed(0)
    for rnd in range(3):
        _, weights, public = server.begin_round(rnd)
        c_t = public["clip_norm"]
        w_before = torch.from_numpy(weights.copy()).double()
        deltas = [torch.randn(d, generator=gen) * 1e4 for _ in range(int(m))]  # all clipped
        partial = _partial(deltas, c_t, d)
        row = server.finish_round(rnd, partial, evaluate=False)
        assert row["clip_norm"] == c_t
        noise = (server.weights.double() - w_before) * m / prep.config.server.lr
        noise -= torch.from_numpy(partial.update_sum)
        measured = float(noise.std())
        assert measured == pytest.approx(ad.update_noise_multiplier * c_t, rel=0.06)
        # ... and not with the next round's clip norm, which is e^{±1}-ish away
        assert abs(measured / (ad.update_noise_multiplier * server.clip_norm) - 1) > 0.2


def test_released_count_is_centred():
    """60 unclipped clients against an expected cohort of m = 10 (z = 0, σ_b = 0):
    b̃ = (60 − 30)/m + 1/2 = 3.5, while an uncentred count would give 60/m = 6."""
    prep, server = _server(
        ["privacy.clip_mode=adaptive", "privacy.noise_multiplier=0", "privacy.clip_count_stddev=0"]
    )
    m = prep.plan.sampling.denominator
    d = server.dim()
    _, _, public = server.begin_round(0)
    deltas = [torch.full((d,), 1e-4) for _ in range(60)]
    row = server.finish_round(0, _partial(deltas, public["clip_norm"], d), evaluate=False)
    b = (60 - 30) / m + 0.5
    assert row["unclipped_fraction_released"] == pytest.approx(b)
    assert server.clip_norm == pytest.approx(1.0 * math.exp(-0.2 * (b - 0.5)))


@pytest.mark.parametrize("gamma", [0.3, 0.5, 0.8])
def test_clip_norm_converges_to_the_target_quantile(gamma):
    """No noise, m = N = 40 clients a round with update norms ~ Uniform(1, 3):
    C_t → the γ-quantile 1 + 2γ. Only the updates' norms matter (no noise), so the
    model is the smallest (logreg, 130 weights; the MLP's 44,810 made this 20x slower)."""
    prep, server = _server(
        [
            "model.name=logreg",
            "privacy.clip_mode=adaptive",
            "privacy.noise_multiplier=0",
            "privacy.clip_count_stddev=0",
            f"privacy.target_quantile={gamma}",
            "privacy.clip_norm=0.1",
            "privacy.clip_lr=0.5",
            "sampling.rate=1",
            "rounds=400",
        ]
    )
    d = server.dim()
    rng = np.random.default_rng(1)
    norms_seen = []
    for rnd in range(400):
        cohort, _, public = server.begin_round(rnd)
        deltas = []
        for _ in range(40):
            u = torch.from_numpy(rng.standard_normal(d)).float()
            deltas.append(u / u.norm() * float(rng.uniform(1, 3)))
        server.finish_round(rnd, _partial(deltas, public["clip_norm"], d), evaluate=False)
        if rnd >= 200:
            norms_seen.append(public["clip_norm"])
    assert float(np.mean(norms_seen)) == pytest.approx(1 + 2 * gamma, rel=0.04)


def test_accounted_epsilon_is_the_same_for_fixed_and_adaptive(tmp_path):
    base = [*SMALL, "rounds=3", "privacy.noise_multiplier=1.3"]
    fixed = simulate(load_config(overrides=base), write=False)
    adaptive = [*base, "privacy.clip_mode=adaptive", "privacy.clip_count_stddev=2"]
    adapt = simulate(load_config(overrides=adaptive), write=False)
    np.testing.assert_array_equal(fixed.rounds["epsilon"], adapt.rounds["epsilon"])
    spec = prepare(load_config(overrides=base)).plan.sampling
    assert adapt.final_epsilon == pytest.approx(
        compute_epsilon(1.3, spec, 3, adapt.privacy["delta"])
    )
    assert adapt.privacy["update_noise_multiplier"] == pytest.approx(
        update_noise_multiplier(1.3, 2.0)
    )
    # calibration from ε: same z as fixed clipping
    eps = [*SMALL, "privacy.epsilon=6"]
    z_fixed = prepare(load_config(overrides=eps)).plan.noise_multiplier
    prep = prepare(
        load_config(overrides=[*eps, "privacy.clip_mode=adaptive", "privacy.clip_count_stddev=5"])
    )
    assert prep.plan.noise_multiplier == z_fixed
    assert prep.adaptive.update_noise_multiplier == pytest.approx(
        update_noise_multiplier(z_fixed, 5)
    )


def test_one_privatizer_holds_c_z_and_the_updates_z_for_server_and_workers():
    """The pipeline is built once: the server and every worker hold the same object,
    the accountant's z and the noise's z_Δ and C_0 are all read from its privatizer,
    and a privatizer whose adaptive parameters disagree with its own z or C is refused."""
    import dataclasses

    from algorithms.pipeline import GaussianPrivatizer, Pipeline

    prep = prepare(
        load_config(
            overrides=[
                *SMALL,
                "privacy.clip_mode=adaptive",
                "privacy.noise_multiplier=0.8",
                "privacy.clip_norm=0.4",
                "ray.executor=local",
            ]
        )
    )
    ex = make_executor(prep)
    priv = prep.pipeline.privatizer
    assert ex.pool.server.pipeline is prep.pipeline
    assert ex.pool.worker.pipeline is prep.pipeline
    assert priv.adaptive is prep.adaptive and priv.clip_norm == 0.4 == ex.pool.server.clip_norm
    assert ex.pool.server.tracker.noise_multiplier == priv.noise_multiplier == 0.8
    assert ex.pool.server.tracker.event == priv.dp_event(prep.plan.sampling)  # what is accounted
    # z_Δ > z: the count's release spends part of the budget, so the sum needs more noise
    assert priv.update_noise_multiplier == prep.adaptive.update_noise_multiplier > 0.8
    with pytest.raises(ValueError, match="adaptive clipping accounted for z=0.8"):
        dataclasses.replace(priv, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="C0=0.4"):
        dataclasses.replace(priv, clip_norm=1.0)
    fixed = GaussianPrivatizer(clip_norm=0.4, noise_multiplier=0.8)
    assert fixed.update_noise_multiplier == 0.8  # fixed clipping: the whole z on the sum
    with pytest.raises(ValueError, match="needs a private recipe"):
        Pipeline().with_adaptive(prep.adaptive)
