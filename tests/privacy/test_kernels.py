"""Tests for engine.privacy.kernels and the server's noise path (docs/algorithms.md §0).

Noise is checked by measuring it: on an all-zero sum the privatised output is pure
noise / denominator, whose standard deviation must be z·C/denominator and whose
distribution must be Gaussian (excess kurtosis ≈ 0).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from algorithms import build_pipeline
from engine.config import AlgoConfig
from engine.data.federated import FederatedDataset
from engine.federated.client import PartialSum
from engine.federated.server import Server, ServerSpec
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec, compute_epsilon
from engine.privacy.kernels import clip_update, gaussian_noise
from engine.privacy.mechanism import GaussianMechanism


def excess_kurtosis(x: np.ndarray) -> float:
    x = np.asarray(x, np.float64)
    c = x - x.mean()
    return float(np.mean(c**4) / np.mean(c**2) ** 2 - 3.0)


@functools.lru_cache(maxsize=1)
def random_vectors() -> tuple[torch.Tensor, ...]:
    """Vectors of many scales, dimensions and dtypes (norms from ~1e-30 to ~1e32)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for dtype in (torch.float32, torch.float64):
        for d in (1, 7, 1000, 20_000):
            for log_scale in (-30, -6, -1, 0, 1, 3, 10, 20, 30):
                v = torch.randn(d, generator=g, dtype=torch.float64) * 10.0**log_scale
                out.append(v.to(dtype))
    return tuple(out)


# ----------------------------------------------------------------------- clipping


@pytest.mark.parametrize("clip_norm", [1e-3, 0.7, 1e4])
def test_clip_bound_holds_at_every_scale(clip_norm):
    for v in random_vectors():
        before = v.clone()
        res = clip_update(v, clip_norm)
        out_norm = float(torch.linalg.vector_norm(res.update.double()))
        true_norm = float(torch.linalg.vector_norm(v.double()))
        assert out_norm <= clip_norm * (1 + 1e-6)
        assert res.norm == pytest.approx(true_norm, rel=1e-12)
        assert res.update.dtype == v.dtype and res.update.shape == v.shape
        assert torch.equal(v, before)  # input not modified in place
        assert not res.nonfinite
        if true_norm <= clip_norm:
            assert not res.clipped
            assert torch.equal(res.update, v)  # bit-identical
        else:
            assert res.clipped
            # Clipping only rescales: direction kept, norm exactly C (to rounding).
            assert out_norm == pytest.approx(clip_norm, rel=1e-5)
            cos = float(torch.dot(res.update.double(), v.double()) / (out_norm * true_norm))
            assert cos == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("clip_norm", [1e-3, 0.7, 1e4, math.inf])
def test_float32_fast_path_agrees_with_float64_path(clip_norm):
    """float32 updates are measured by one float64 reduction; their results must match
    clipping the same update held in float64 (the peak-scaled path), and ``out_norm``
    must be the exact float64 norm of the returned update."""
    for v in random_vectors():
        if v.dtype != torch.float32:
            continue
        fast = clip_update(v, clip_norm)
        ref = clip_update(v.double(), clip_norm)
        assert fast.out_norm == float(torch.linalg.vector_norm(fast.update.double()))
        assert fast.out_norm <= clip_norm
        assert fast.clipped == ref.clipped
        assert fast.norm == pytest.approx(ref.norm, rel=1e-12)
        np.testing.assert_allclose(
            fast.update.double().numpy(), ref.update.numpy(), rtol=2e-6, atol=0.0
        )


@pytest.mark.parametrize(
    "value,dim,clip_norm", [(1e38, 100, 1e-6), (3e38, 1000, 1.0), (1e35, 1000, 1e-3)]
)
def test_clip_bound_for_huge_float32_updates(value, dim, clip_norm):
    v = torch.full((dim,), value, dtype=torch.float32)
    res = clip_update(v, clip_norm)
    assert float(torch.linalg.vector_norm(res.update.double())) <= clip_norm
    assert res.clipped


def test_clip_bound_is_exact_and_handles_float64_overflow():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        v = torch.randn(997, generator=gen) * float(torch.rand(1, generator=gen) * 1e3)
        assert float(torch.linalg.vector_norm(clip_update(v, 0.3).update.double())) <= 0.3
    huge = torch.full((10,), 1e308, dtype=torch.float64)  # norm overflows float64
    res = clip_update(huge, 2.0)
    assert res.norm == math.inf  # the true norm exceeds the float64 range
    assert float(torch.linalg.vector_norm(res.update)) == pytest.approx(2.0)


def test_infinite_clip_norm_is_identity():
    for v in random_vectors():
        res = clip_update(v, math.inf)
        assert torch.equal(res.update, v)
        assert not res.clipped and not res.nonfinite
        assert res.norm == pytest.approx(float(torch.linalg.vector_norm(v.double())), rel=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonfinite_updates_are_zeroed_before_clipping(bad, dtype):
    v = torch.linspace(-5.0, 5.0, 101, dtype=dtype) * 1e3
    v[17] = bad
    for clip_norm in (0.5, math.inf):
        res = clip_update(v, clip_norm)
        assert res.nonfinite
        assert not res.clipped
        assert res.norm == 0.0
        assert res.update.dtype == dtype
        assert torch.equal(res.update, torch.zeros_like(v))
        assert float(torch.linalg.vector_norm(res.update.double())) <= 0.5


# ------------------------------------------- the mechanism's noised average


def privatize_sum(
    clipped_sum: torch.Tensor,
    *,
    noise_multiplier: float,
    clip_norm: float,
    denominator: float,
    seed: int = 0,
    rnd: int = 0,
) -> torch.Tensor:
    """(Σ + N(0, (zC)² I)) / denominator, as the server forms it: the mechanism's
    central noise of round ``rnd`` (seeded stream) added to the sum."""
    mech = GaussianMechanism(clip_norm, noise_multiplier).bind(rngs.Randomness(seed))
    noise = mech.server_noise(clipped_sum.numel(), rnd, None)
    return mech.privatize(clipped_sum, noise, denominator)


def test_privatize_sum_noise_level_and_shape():
    z, c, denom, d = 1.3, 0.7, 50.0, 200_000
    out = privatize_sum(
        torch.zeros(d, dtype=torch.float32), noise_multiplier=z, clip_norm=c, denominator=denom
    )
    assert out.dtype == torch.float64 and out.shape == (d,)
    x = out.numpy()
    expected = z * c / denom
    assert x.std() == pytest.approx(expected, rel=0.01)
    assert abs(excess_kurtosis(x)) < 0.05
    assert abs(x.mean()) < 5 * expected / math.sqrt(d)
    # Coordinates are independent: neighbours are uncorrelated.
    r = np.corrcoef(x[:-1], x[1:])[0, 1]
    assert abs(r) < 5 / math.sqrt(d)


def test_privatize_sum_is_sum_plus_noise_over_denominator():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(5000, generator=g, dtype=torch.float64) * 3.0
    kw = dict(noise_multiplier=0.9, clip_norm=1.5, denominator=12.5, seed=3, rnd=4)
    with_sum = privatize_sum(s, **kw)
    noise_only = privatize_sum(torch.zeros_like(s), **kw)
    torch.testing.assert_close(with_sum - noise_only, s / 12.5, rtol=0, atol=1e-12)


def test_privatize_sum_without_noise_is_exact_average():
    s = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.float32)
    out = privatize_sum(s, noise_multiplier=0.0, clip_norm=1.0, denominator=7.0)
    assert torch.equal(out, s.double() / 7.0)


def test_noise_is_reproducible_per_round_and_differs_across_rounds():
    def noise(seed: int, rnd: int) -> torch.Tensor:
        return privatize_sum(
            torch.zeros(20_000),
            noise_multiplier=1.0,
            clip_norm=1.0,
            denominator=1.0,
            seed=seed,
            rnd=rnd,
        )

    a = noise(5, 0)
    assert torch.equal(a, noise(5, 0))
    for other in (noise(5, 1), noise(6, 0)):
        assert not torch.equal(a, other)
        r = float(np.corrcoef(a.numpy(), other.numpy())[0, 1])
        assert abs(r) < 5 / math.sqrt(20_000)


def test_privatize_sum_rejects_meaningless_settings():
    with pytest.raises(ValueError, match="denominator"):
        privatize_sum(torch.zeros(3), noise_multiplier=1.0, clip_norm=1.0, denominator=0)
    with pytest.raises(ValueError, match="infinite clip norm"):
        privatize_sum(torch.zeros(3), noise_multiplier=1.0, clip_norm=math.inf, denominator=1)
    with pytest.raises(ValueError, match="std"):
        gaussian_noise(3, -1.0, rngs.SeededStream(0, (rngs.NOISE, 0)))


# ----------------------------------------------------------- through the Server


Z, C, SERVER_LR, N_CLIENTS, RATE, FEATURES, CLASSES = 1.3, 0.7, 0.5, 20, 0.5, 2000, 3


def make_server(seed: int = 0) -> Server:
    g = np.random.default_rng(0)
    n = 2 * N_CLIENTS
    ds = FederatedDataset(
        name="toy",
        x_train=g.normal(size=(n, FEATURES)).astype(np.float32),
        y_train=g.integers(0, CLASSES, n).astype(np.int64),
        client_train=[np.array([2 * k, 2 * k + 1], np.int64) for k in range(N_CLIENTS)],
        client_test=[np.zeros(0, np.int64) for _ in range(N_CLIENTS)],
        x_test=g.normal(size=(6, FEATURES)).astype(np.float32),
        y_test=g.integers(0, CLASSES, 6).astype(np.int64),
        num_classes=CLASSES,
        input_shape=(FEATURES,),
    )
    spec = ServerSpec(
        seed=seed,
        model_name="logreg",
        pipeline=build_pipeline("dp_fedavg", AlgoConfig(), C, Z, "logreg"),
        server_lr=SERVER_LR,
        delta=N_CLIENTS**-1.1,
        accountant="rdp",
        sampling=SamplingSpec("poisson", N_CLIENTS, rate=RATE),
        eval_every=1000,
        rounds=10,
    )
    return Server(ds, spec)


def test_server_noise_on_empty_cohorts():
    server = make_server()
    d = server.dim()
    assert d == FEATURES * CLASSES + CLASSES
    denom = RATE * N_CLIENTS  # public q·N, never the realised cohort (0 here)
    deltas, eps = [], []
    for rnd in range(5):
        server.begin_round(rnd)
        before = server.get_weights().astype(np.float64)
        row = server.finish_round(rnd, PartialSum(update_sum=np.zeros(d), num_clients=0))
        after = server.get_weights().astype(np.float64)
        assert np.isfinite(after).all()
        assert row["realised_cohort_size_nonprivate"] == 0
        assert row["cohort_size"] == denom
        assert row["epsilon"] == pytest.approx(
            compute_epsilon(Z, server.spec.sampling, rnd + 1, server.spec.delta), rel=1e-9
        )
        assert 0 < row["epsilon"] < math.inf
        assert math.isnan(row["mean_update_norm_nonprivate"])
        eps.append(row["epsilon"])
        deltas.append(after - before)
    assert all(a < b for a, b in zip(eps, eps[1:]))
    x = np.concatenate(deltas)  # 30,015 draws
    expected = SERVER_LR * Z * C / denom
    assert x.std() == pytest.approx(expected, rel=0.02)  # SE of std ≈ 0.4 %
    assert abs(excess_kurtosis(x)) < 0.15  # SE ≈ 0.03
    assert abs(x.mean()) < 5 * expected / math.sqrt(len(x))
    # Every round draws fresh noise.
    r = float(np.corrcoef(deltas[0], deltas[1])[0, 1])
    assert abs(r) < 5 / math.sqrt(d)


def test_server_divides_sum_by_public_denominator_and_is_reproducible():
    a, b, other = make_server(seed=3), make_server(seed=3), make_server(seed=4)
    d = a.dim()
    s = np.random.default_rng(1).normal(size=d) * 0.1
    w0 = a.get_weights().astype(np.float64)
    assert np.array_equal(w0, b.get_weights())
    for srv in (a, b, other):
        srv.begin_round(0)
    a.finish_round(0, PartialSum(update_sum=s, num_clients=3))
    b.finish_round(0, PartialSum(update_sum=np.zeros(d), num_clients=0))
    other.finish_round(0, PartialSum(update_sum=np.zeros(d), num_clients=0))
    # Same seed and round → same noise, so the difference is lr·sum/(q·N) (not /3).
    diff = a.get_weights().astype(np.float64) - b.get_weights().astype(np.float64)
    np.testing.assert_allclose(diff, SERVER_LR * s / (RATE * N_CLIENTS), rtol=0, atol=1e-6)
    # Another seed → other noise.
    assert not np.array_equal(b.get_weights(), other.get_weights())
