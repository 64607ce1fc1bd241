"""The run's privacy mechanism and the one (ε, δ, z) resolver (issue 27, item 2).

* :class:`engine.privacy.mechanism.GaussianMechanism` sizes every noise draw: z·C on the
  server's sum, z·C/√m per client under client-side noise, z_Δ·C_t under adaptive
  clipping, from the seeded or the secure stream;
* :func:`engine.privacy.resolve.resolve_privacy` turns any two of (ε, δ, z) into the
  third, and agrees with dp-accounting run directly;
* no module outside ``engine/privacy`` multiplies a noise multiplier by a clip norm.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from algorithms.pipeline import GaussianPrivatizer
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec, compute_epsilon, round_event, run_event
from engine.privacy.adaptive_clip import AdaptiveClipSpec
from engine.privacy.mechanism import GaussianMechanism
from engine.privacy.resolve import CalibrationError, resolve_privacy

ROOT = Path(__file__).resolve().parents[2]
Z, C, M, D = 1.3, 0.7, 16.0, 257


def bound(mech: GaussianMechanism, seed: int = 3) -> GaussianMechanism:
    return mech.bind(rngs.Randomness(seed))


# ----------------------------------------------------------------- noise std


def pcg64_normals(seed: int, key: tuple[int, ...], n: int) -> torch.Tensor:
    """Oracle for n < one block: numpy's PCG64 seeded as docs/architecture.md says,
    SeedSequence(seed, spawn_key=(len(key), *key, block 0))."""
    ss = np.random.SeedSequence(seed, spawn_key=(len(key), *key, 0))
    return torch.from_numpy(np.random.Generator(np.random.PCG64(ss)).standard_normal(n))


def test_server_noise_std_is_z_times_c_from_the_rounds_stream() -> None:
    mech = bound(GaussianMechanism(C, Z))
    assert mech.noise_std() == Z * C
    drawn = mech.server_noise(D, 5, None)
    expected = pcg64_normals(3, (rngs.NOISE, 5), D)
    assert torch.equal(drawn, expected * (Z * C))


def test_client_noise_std_is_z_c_over_root_m_from_the_clients_stream() -> None:
    mech = bound(GaussianMechanism(C, Z, site="client"))
    assert mech.noise_std(M) == Z * C / math.sqrt(M)
    drawn = mech.client_noise(D, 5, 11, M)
    expected = pcg64_normals(3, (rngs.NOISE, 5, 12), D)
    assert torch.equal(drawn, expected * (Z * C / 4.0))
    # the server adds nothing then, but draws (std 0) so its stream is the same
    assert torch.equal(mech.server_noise(D, 5, None), torch.zeros(D, dtype=torch.float64))


def test_adaptive_clipping_noises_with_z_delta_and_the_current_clip_norm() -> None:
    spec = AdaptiveClipSpec.build(Z, C, expected_cohort=M * 10, count_stddev=8.0)
    mech = bound(GaussianMechanism(C, Z, adaptive=spec))
    assert mech.update_noise_multiplier == spec.update_noise_multiplier > Z
    assert mech.noise_std() == spec.update_noise_multiplier * C
    row = mech.release_count(0, num_clients=160, num_clipped=150)
    assert row["clip_norm"] == C and mech.clip_t != C  # C_1 moved (many clipped: up)
    assert mech.clip_t > C
    assert mech.noise_std() == spec.update_noise_multiplier * mech.clip_t
    # the accountant sees the configured z, not z_Δ
    sampling = SamplingSpec("poisson", 1000, rate=0.16)
    assert repr(mech.dp_event(sampling)) == repr(round_event(Z, sampling))
    # a worker follows the server's C_t through the round's public state
    worker = bound(GaussianMechanism(C, Z, adaptive=spec))
    worker.follow(mech.public_state())
    assert worker.clip_t == mech.clip_t
    worker.follow({})
    assert worker.clip_t == C


def test_noise_refuses_an_infinite_clip_norm_and_a_template_draws_nothing() -> None:
    with pytest.raises(ValueError, match="infinite clip norm"):
        bound(GaussianMechanism(math.inf, Z)).server_noise(3, 0, None)
    template = GaussianPrivatizer(C, Z).mechanism
    with pytest.raises(RuntimeError, match="template"):
        template.server_noise(3, 0, None)
    a, b = template.bind(rngs.Randomness(0)), template.bind(rngs.Randomness(0))
    assert a is not b and a.clip_t == b.clip_t == template.clip_norm == C


def test_the_randomness_switch_is_one_place() -> None:
    seeded, secure = rngs.Randomness(7), rngs.Randomness(7, secure=True)
    assert isinstance(seeded.stream(rngs.NOISE, 1), rngs.SeededStream)
    assert isinstance(secure.stream(rngs.NOISE, 1), rngs.SecureRandom)
    assert (seeded.mode, secure.mode) == (rngs.SEEDED_SIMULATION, rngs.SECURE)
    a = GaussianMechanism(C, Z).bind(secure).server_noise(4000, 1, None)
    b = GaussianMechanism(C, Z).bind(secure).server_noise(4000, 1, None)
    assert not torch.equal(a, b)  # nothing regenerates a secure draw
    assert float(a.std()) == pytest.approx(Z * C, rel=0.1)


def test_events_are_the_accountants() -> None:
    poisson = SamplingSpec("poisson", 1000, rate=0.1)
    mech = GaussianMechanism(C, Z)
    assert repr(mech.dp_event(poisson)) == repr(round_event(Z, poisson))
    assert repr(mech.dp_event(poisson, 30)) == repr(run_event(Z, poisson, 30))
    from algorithms.dp_ftrl import EpochPasses, TreeAggregation

    epochs = EpochPasses(100, cohort_size=10)
    with pytest.raises(ValueError, match="correlated noise"):
        mech.dp_event(epochs)
    tree = GaussianMechanism(C, Z, scheme=TreeAggregation())
    assert repr(tree.dp_event(epochs, 25)) == repr(run_event(Z, epochs, 25))
    assert repr(tree.dp_event(epochs, 25)) == repr(run_event(Z, epochs, 25, TreeAggregation()))
    with pytest.raises(ValueError, match="tree aggregation needs epoch participation"):
        tree.dp_event(poisson)


# ----------------------------------------------------------------- resolver


SPEC = SamplingSpec("poisson", 10**9, rate=0.05)
ROUNDS, DELTA = 200, 1e-5


def direct_rdp(z: float, delta: float) -> float:
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(z)), ROUNDS)
    return float(acc.get_epsilon(delta))


def test_resolver_epsilon_from_z_and_delta_is_dp_accountings() -> None:
    r = resolve_privacy(SPEC, ROUNDS, noise_multiplier=1.1, delta=DELTA)
    assert r.epsilon == pytest.approx(direct_rdp(1.1, DELTA), rel=1e-9)
    assert (r.noise_multiplier, r.delta, r.accountant) == (1.1, DELTA, "rdp")
    assert r.target_epsilon is None


def test_resolver_z_from_epsilon_and_delta_meets_the_target_tightly() -> None:
    r = resolve_privacy(SPEC, ROUNDS, epsilon=3.0, delta=DELTA)
    assert r.epsilon == compute_epsilon(r.noise_multiplier, SPEC, ROUNDS, DELTA)
    assert r.epsilon <= 3.0 < direct_rdp(r.noise_multiplier * (1 - 1e-3), DELTA)
    assert direct_rdp(r.noise_multiplier, DELTA) == pytest.approx(r.epsilon, rel=1e-9)


def test_resolver_delta_from_epsilon_and_z_is_dp_accountings() -> None:
    r = resolve_privacy(SPEC, ROUNDS, epsilon=3.0, noise_multiplier=1.1)
    acc = rdp.RdpAccountant()
    acc.compose(run_event(1.1, SPEC, ROUNDS))
    assert r.delta == pytest.approx(acc.get_delta(3.0), rel=1e-4)
    assert r.epsilon <= 3.0 and r.epsilon == compute_epsilon(1.1, SPEC, ROUNDS, r.delta)
    # the three directions agree: (ε, δ) of this triple gives its z back
    back = resolve_privacy(SPEC, ROUNDS, epsilon=3.0, delta=r.delta)
    assert back.noise_multiplier == pytest.approx(1.1, rel=1e-3)


def test_resolver_pld_and_refusals() -> None:
    r = resolve_privacy(SPEC, ROUNDS, epsilon=3.0, noise_multiplier=1.1, accountant="pld")
    assert r.accountant == "pld" and 0 < r.delta < 1
    assert compute_epsilon(1.1, SPEC, ROUNDS, r.delta, "pld") <= 3.0
    with pytest.raises(ValueError, match="exactly two"):
        resolve_privacy(SPEC, ROUNDS, epsilon=3.0)
    with pytest.raises(ValueError, match="exactly two"):
        resolve_privacy(SPEC, ROUNDS, epsilon=3.0, delta=DELTA, noise_multiplier=1.0)
    with pytest.raises(CalibrationError):
        resolve_privacy(SPEC, ROUNDS, epsilon=3.0, noise_multiplier=0.0)
    with pytest.raises(CalibrationError, match="unreachable"):
        resolve_privacy(SPEC, 10**6, epsilon=1e-4, delta=DELTA)


def test_the_public_api_uses_the_resolver() -> None:
    from engine import calibrate_delta, calibrate_noise, epsilon

    z = calibrate_noise(3.0, DELTA, 0.05, ROUNDS)
    assert z == resolve_privacy(SPEC, ROUNDS, epsilon=3.0, delta=DELTA).noise_multiplier
    assert epsilon(z, 0.05, ROUNDS, DELTA) <= 3.0
    d = calibrate_delta(3.0, z, 0.05, ROUNDS)
    assert 0 < d <= DELTA * (1 + 1e-3)


# ------------------------------------------------------- z·C only in privacy

NOISE_NAMES = ("noise_multiplier", "sigma")
CLIP_NAMES = ("clip",)


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _is_noise(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in NOISE_NAMES) or low == "z" or low.startswith("z_")


def _is_clip(name: str) -> bool:
    return any(k in name.lower() for k in CLIP_NAMES) or name == "C"


def noise_times_clip(source: str) -> list[int]:
    """Lines of ``source`` where a product has a noise multiplier on one side and a
    clip norm on the other (``z * C``, ``z_noise * clip / √m``, ``noise_multiplier *
    self.clip_norm`` ...)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left, right = _names(node.left), _names(node.right)
            if (any(map(_is_noise, left)) and any(map(_is_clip, right))) or (
                any(map(_is_clip, left)) and any(map(_is_noise, right))
            ):
                hits.append(node.lineno)
    return hits


def test_the_scan_finds_what_it_looks_for() -> None:
    assert noise_times_clip("std = z_noise * clip / math.sqrt(m)") == [1]
    assert noise_times_clip("s = priv.noise_multiplier * self.clip_norm") == [1]
    assert noise_times_clip("s = C * (z + 0)") == [1]
    assert noise_times_clip("s = noise * support\nt = lr * clip_norm_ratio") == []


def test_nothing_outside_engine_privacy_multiplies_z_by_c() -> None:
    offenders = []
    for package in ("engine", "algorithms", "tuning"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("engine/privacy/"):
                continue
            for line in noise_times_clip(path.read_text(encoding="utf-8")):
                offenders.append(f"{rel}:{line}")
    assert offenders == [], "z·C computed outside engine.privacy.mechanism: " + ", ".join(offenders)
