"""O(cohort) Poisson sampling for on-demand populations (``dataset.materialize=false``).

``sample_cohort(..., on_demand=True)`` draws m ~ Binomial(N, q) and a uniform m-subset
(seeded) or the Geometric(q) gaps between members (secure); both are Poisson sampling,
so the accountant is unchanged. Checked here: each client's inclusion frequency is q,
cohort sizes are Binomial(N, q), ``max_cohort`` truncates as before, materialised runs
keep their cohorts, a run on an on-demand population uses the new sampler, and the
draw's memory and time do not grow with N. Every seeded check is deterministic.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
from scipy import stats

from engine.config import load_config
from engine.federated.server import poisson_by_gaps, sample_cohort
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec
from engine.privacy.rng import SecureRandom

N, Q, ROUNDS = 200, 0.1, 4000


def old_poisson(spec: SamplingSpec, seed: int, rnd: int) -> np.ndarray:
    """The materialised draw as written before the on-demand sampler existed."""
    g = rngs.numpy_rng(seed, rngs.SAMPLING, rnd)
    cohort = np.flatnonzero(g.random(spec.num_clients) < spec.rate).astype(np.int64)
    if spec.max_cohort is not None and len(cohort) > spec.max_cohort:
        cohort = np.sort(g.choice(cohort, spec.max_cohort, replace=False)).astype(np.int64)
    return cohort


def seeded_uniform(seed: int):
    """Uniforms on SecureRandom's grid, (k + ½)·2⁻⁵³, from a seeded stream."""
    g = np.random.default_rng(seed)
    return lambda n: (g.integers(0, 2**53, n).astype(np.float64) + 0.5) * 2.0**-53


def check_poisson(cohorts: list[np.ndarray], n: int, q: float) -> None:
    """Inclusion counts per client ~ Binomial(R, q) (chi-square over clients), cohort
    sizes ~ Binomial(n, q) (mean and variance), ids distinct, sorted, in range."""
    rounds = len(cohorts)
    counts = np.zeros(n)
    for c in cohorts:
        assert c.dtype == np.int64 and (np.diff(c) > 0).all()
        assert len(c) == 0 or (0 <= c[0] and c[-1] < n)
        counts[c] += 1
    # Σ (count − Rq)² / (Rq(1 − q)) over independent clients is ≈ χ²(n).
    chi2 = float(((counts - rounds * q) ** 2).sum() / (rounds * q * (1 - q)))
    assert stats.chi2.sf(chi2, n) > 1e-3 and stats.chi2.cdf(chi2, n) > 1e-3, chi2
    # Every client, not just on average: a 5-sigma binomial bound per client.
    assert np.abs(counts - rounds * q).max() < 5 * np.sqrt(rounds * q * (1 - q))
    sizes = np.array([len(c) for c in cohorts], dtype=np.float64)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * np.sqrt(var / rounds)
    # Sample variance of R draws: its standard error is ≈ var·√(2/(R − 1)).
    assert abs(sizes.var(ddof=1) - var) < 5 * var * np.sqrt(2 / (rounds - 1))


def test_seeded_on_demand_sampler_is_poisson_sampling() -> None:
    spec = SamplingSpec("poisson", N, rate=Q)
    check_poisson([sample_cohort(spec, 7, r, on_demand=True) for r in range(ROUNDS)], N, Q)


def test_gap_sampler_is_poisson_sampling() -> None:
    uniform = seeded_uniform(3)  # deterministic; the secure path feeds SecureRandom's
    check_poisson([poisson_by_gaps(N, Q, uniform) for _ in range(ROUNDS)], N, Q)
    # several chunks in one draw (chunk ≈ mean + 6σ + 16 uniforms)
    tiny_chunks = [poisson_by_gaps(5000, 0.5, uniform) for _ in range(200)]
    check_poisson(tiny_chunks, 5000, 0.5)
    assert poisson_by_gaps(0, Q, uniform).size == poisson_by_gaps(10, 0.0, uniform).size == 0
    assert np.array_equal(poisson_by_gaps(10, 1.0, uniform), np.arange(10))


def test_secure_on_demand_sampler() -> None:
    """Release mode: O(cohort) draws from SecureRandom (not reproducible, so only the
    laws are checked, with loose bounds)."""
    spec = SamplingSpec("poisson", 1000, rate=0.1)
    sizes = [len(sample_cohort(spec, 0, r, secure=True, on_demand=True)) for r in range(300)]
    assert abs(np.mean(sizes) - 100) < 6 * np.sqrt(90 / 300)
    capped = SamplingSpec("poisson", 200, rate=0.5, max_cohort=20)
    for r in range(20):
        c = sample_cohort(capped, 0, r, secure=True, on_demand=True)
        assert len(c) == 20 and (np.diff(c) > 0).all() and c[-1] < 200
    fixed = SamplingSpec("fixed", 50, cohort_size=10)
    counts = np.zeros(50)
    for r in range(2000):
        c = sample_cohort(fixed, 0, r, secure=True, on_demand=True)
        assert len(set(c.tolist())) == 10 and (np.diff(c) > 0).all() and c.max() < 50
        counts[c] += 1
    assert stats.chisquare(counts).pvalue > 1e-4
    big = SamplingSpec("poisson", 10**9, rate=1e-7)
    assert 40 < len(sample_cohort(big, 0, 0, secure=True, on_demand=True)) < 200


def test_max_cohort_truncates_a_uniform_subset_as_before() -> None:
    spec = SamplingSpec("poisson", 300, rate=0.2, max_cohort=40)
    for r in range(50):
        c = sample_cohort(spec, 1, r, on_demand=True)
        # what the materialised path does after its draw, from the same stream state
        g = rngs.numpy_rng(1, rngs.SAMPLING, r)
        full = np.sort(g.choice(300, int(g.binomial(300, 0.2)), replace=False))
        want = np.sort(g.choice(full, 40, replace=False)) if len(full) > 40 else full
        assert np.array_equal(c, want)
    check_poisson(
        [sample_cohort(SamplingSpec("poisson", 60, rate=0.2, max_cohort=1000), 2, r,
                       on_demand=True) for r in range(ROUNDS)], 60, 0.2,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        SamplingSpec("poisson", 500, rate=0.1),
        SamplingSpec("poisson", 500, rate=0.3, max_cohort=60),
        SamplingSpec("poisson", 10_000, rate=0.001),
    ],
)
def test_materialised_cohorts_are_unchanged(spec) -> None:
    for seed in (0, 11):
        for r in range(30):
            assert np.array_equal(sample_cohort(spec, seed, r), old_poisson(spec, seed, r))


SMALL = [
    "dataset.num_clients=60",
    "dataset.synthetic_mean_samples=10",
    "dataset.synthetic_dim=8",
    "dataset.partition=natural",
    "dataset.public_eval_clients=5",
    "sampling.rate=0.2",
    "rounds=4",
    "eval.every=4",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
]


@pytest.mark.parametrize("materialize", [True, False])
def test_a_run_samples_with_the_sampler_of_its_population(materialize) -> None:
    """The server picks the sampler from dataset.meta: a materialised run realises the
    old cohorts, an on-demand run the O(cohort) ones."""
    from engine.simulation import prepare, simulate

    cfg = load_config(overrides=[*SMALL, f"dataset.materialize={str(materialize).lower()}"])
    res = simulate(cfg, write=False)
    spec = prepare(cfg).plan.sampling
    want = [
        old_poisson(spec, cfg.seed, r) if materialize
        else sample_cohort(spec, cfg.seed, r, on_demand=True)
        for r in range(4)
    ]  # fmt: skip
    assert res.rounds["realised_cohort_size_nonprivate"].tolist() == [len(c) for c in want]
    other = [sample_cohort(spec, cfg.seed, r, on_demand=materialize) for r in range(4)]
    assert [len(c) for c in want] != [len(c) for c in other]  # the check can tell them apart


def test_on_demand_sampling_memory_and_time_do_not_grow_with_n() -> None:
    """At N = 10^7 the O(N) draw held 80 MB (and ~40 ms); the O(cohort) draw holds a
    few kB whatever N, even at N = 10^9 where the O(N) draw would need 8 GB."""
    peaks, times = {}, {}
    for n in (10**4, 10**7, 10**9):
        spec = SamplingSpec("poisson", n, rate=100 / n)
        sample_cohort(spec, 0, 0, on_demand=True)  # warm up
        tracemalloc.start()
        t0 = time.perf_counter()
        sizes = [len(sample_cohort(spec, 0, r, on_demand=True)) for r in range(1, 21)]
        times[n] = (time.perf_counter() - t0) / 20
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert 50 < np.mean(sizes) < 150
    assert peaks[10**7] < 64 * 1024 and peaks[10**9] < 64 * 1024, peaks  # O(m), not 8N bytes
    assert peaks[10**9] < 4 * peaks[10**4] + 16 * 1024, peaks
    assert times[10**9] < 0.02, times  # O(N) would be seconds; O(m) is ~0.1 ms
    # secure mode too (SecureRandom uniforms, gaps)
    tracemalloc.start()
    sample_cohort(SamplingSpec("poisson", 10**9, rate=1e-7), 0, 0, secure=True, on_demand=True)
    assert tracemalloc.get_traced_memory()[1] < 64 * 1024
    tracemalloc.stop()
    uniform = SecureRandom().uniform
    assert len(poisson_by_gaps(10**9, 0.0, uniform)) == 0
