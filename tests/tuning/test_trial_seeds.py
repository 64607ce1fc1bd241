"""Each tune trial has randomness of its own (issue 13, item 1a)."""

from __future__ import annotations

import numpy as np

from engine.federated.server import sample_cohort
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec
from tuning.trial import trial_index, trial_seed


def test_trial_seeds_are_distinct_and_not_the_experiment_seed() -> None:
    seeds = {
        (a, e, k): trial_seed(0, a, e, k)
        for a in ("dp_fedavg", "dp_fedsam")
        for e in (2.0, 8.0)
        for k in range(16)
    }
    assert len(set(seeds.values())) == len(seeds)
    assert 0 not in seeds.values()
    # a function of (experiment seed, algorithm, ε, k): reproducible, and the
    # experiment seed changes every trial's seed
    assert trial_seed(0, "dp_fedavg", 2.0, 3) == seeds[("dp_fedavg", 2.0, 3)]
    assert trial_seed(1, "dp_fedavg", 2.0, 3) != seeds[("dp_fedavg", 2.0, 3)]


def test_two_trials_draw_different_cohorts_and_noise() -> None:
    spec = SamplingSpec("poisson", 1000, rate=0.1)
    s0, s1 = trial_seed(7, "dp_fedavg", 4.0, 0), trial_seed(7, "dp_fedavg", 4.0, 1)
    c0, c1 = sample_cohort(spec, s0, 0), sample_cohort(spec, s1, 0)
    assert not np.array_equal(c0, c1)
    # the same trial seed reproduces its cohort (seeded simulation)
    assert np.array_equal(c0, sample_cohort(spec, s0, 0))
    # the noise streams the mechanism draws from (engine.privacy.rng.Randomness)
    a = rngs.Randomness(s0).stream(rngs.NOISE, 0).standard_normal(1000)
    b = rngs.Randomness(s1).stream(rngs.NOISE, 0).standard_normal(1000)
    # independent N(0,1) vectors: their difference has variance 2, never ~0
    assert float((a - b).std()) > 1.0


def test_trial_index_from_sample_or_tune_counter() -> None:
    assert trial_index({"sample": 5}, "abc_00000") == 5
    assert trial_index({}, "3f2a1_00007") == 7
    assert trial_index({}, "odd-id") != trial_index({}, "other-id")
