"""Defaults a paper reader expects (issue 28), and independent seeds.

* ``dataset.client_test_fraction`` null resolves to 0 for a recipe that trains one global
  model (its clients train on all their data, as in the papers) and to 0.2 where a metric
  needs a held-out split (personalised recipes, membership inference); ``config.json``
  holds the resolved value.
* Different seeds give independent random streams: a ``seed + round`` scheme would make
  seed s's round r the same draw as seed s+1's round r-1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from algorithms.catalog import CATALOG
from algorithms.recipes import build_pipeline
from engine.config import HELD_OUT_FRACTION, config_from_dict, load_config
from engine.federated.server import sample_cohort
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec


@pytest.mark.parametrize("algorithm", sorted(CATALOG))
def test_client_test_fraction_resolves_per_recipe(algorithm: str) -> None:
    cfg = load_config(overrides=[f"algorithm={algorithm}"])
    want = HELD_OUT_FRACTION if CATALOG[algorithm].personal else 0.0
    assert cfg.dataset.client_test_fraction == want
    # the resolved value is what config.json holds, and it survives the round trip
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["dataset"]["client_test_fraction"] == want
    assert config_from_dict(data) == cfg


def test_personal_flag_matches_the_recipes() -> None:
    """The catalog's ``personal`` (plain data, read by engine.config) is what the recipe
    does: a personal split of the model that stays on the client."""
    for name, entry in CATALOG.items():
        algo = load_config(overrides=[f"algorithm={name}"]).algo
        pipeline = build_pipeline(name, algo, 1.0, 1.0, "mlp")
        assert entry.personal == (pipeline.personal is not None), name
    assert any(e.personal for e in CATALOG.values())  # dp2_fedsam


def test_held_out_split_kept_where_a_metric_needs_it() -> None:
    mia = load_config(overrides=["eval.membership_inference=true"])
    assert mia.dataset.client_test_fraction == HELD_OUT_FRACTION
    custom = load_config(overrides=["algorithm=custom", "recipe.personal=true", "recipe.step=sam"])
    assert custom.dataset.client_test_fraction == HELD_OUT_FRACTION
    plain = load_config(overrides=["algorithm=custom"])
    assert plain.dataset.client_test_fraction == 0.0
    # an explicit value is kept, 0.2 for a global recipe and 0 for a personal one
    for algorithm, value in (("dp_fedavg", 0.2), ("dp2_fedsam", 0.0), ("fedavg", 0.35)):
        cfg = load_config(
            overrides=[f"algorithm={algorithm}", f"dataset.client_test_fraction={value}"]
        )
        assert cfg.dataset.client_test_fraction == value


def test_dp_fedavg_clients_train_on_all_their_data() -> None:
    from engine.simulation import prepare

    cfg = load_config(overrides=["dataset.num_clients=50", "rounds=1"])
    ds = prepare(cfg).dataset
    assert all(len(t) == 0 for t in ds.client_test)
    assert sum(len(t) for t in ds.client_train) == len(ds.y_train)
    personal = prepare(load_config(overrides=["dataset.num_clients=50", "algorithm=dp2_fedsam"]))
    held = sum(len(t) for t in personal.dataset.client_test)
    assert 0.15 * len(personal.dataset.y_train) < held < 0.25 * len(personal.dataset.y_train)


NOT_STREAMS = {"NORMAL_BLOCK", "NOISE_THREADS"}  # sizes, not stream ids
STREAMS = [
    v
    for k, v in vars(rngs).items()
    if k.isupper() and k not in NOT_STREAMS and isinstance(v, int) and v > 0
]


def test_seed_and_round_do_not_alias() -> None:
    """No two (seed, stream, round) keys share a derived seed; in particular seed s
    round r is not seed s+1 round r-1 (or any other shift)."""
    seen: dict[int, tuple[int, int, int]] = {}
    for s in range(6):
        for stream in STREAMS:
            for r in range(12):
                k = rngs.derive_seed(s, stream, r)
                assert k not in seen, ((s, stream, r), seen.get(k))
                seen[k] = (s, stream, r)
    assert len(STREAMS) >= 8


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
def test_cohorts_of_neighbouring_seeds_are_independent(mode: str) -> None:
    n, q = 2000, 0.05
    spec = SamplingSpec(mode=mode, num_clients=n, rate=q, cohort_size=100)
    same = 0
    overlaps = []
    for s in range(5):
        for r in range(1, 20):
            a, b = sample_cohort(spec, s, r), sample_cohort(spec, s + 1, r - 1)
            same += int(np.array_equal(a, b))
            overlaps.append(len(np.intersect1d(a, b)) / max(len(a), 1))
    assert same == 0
    # independent cohorts overlap by ~q of their members (aliased ones by 1)
    assert np.mean(overlaps) < 2 * q


def test_noise_of_neighbouring_seeds_is_uncorrelated() -> None:

    d = 200_000
    for s, r in ((0, 1), (1, 7), (3, 2)):
        a = rngs.Randomness(s).stream(rngs.NOISE, r).standard_normal(d)
        b = rngs.Randomness(s + 1).stream(rngs.NOISE, r - 1).standard_normal(d)
        corr = float(np.corrcoef(a, b)[0, 1])
        assert abs(corr) < 5 / np.sqrt(d), corr  # 1.0 under seed + round aliasing
