"""Recipes run 2 rounds through the Ray executor and equal the same runs in process.

One recipe per kind of state or machinery that crosses the actor boundary differently
(the CI budget does not hold all fifteen at ~12 s each; every recipe runs in process in
the golden and reference tests, and the client pieces run the same code in an actor):
the plain private and non-private paths, a personal head kept in the workers, a server
step with state (PGN's g̃, with smoothing), correlated noise (tree and banded), a
public per-round mask and a server-side top-k."""

from __future__ import annotations

import numpy as np
import pytest

from algorithms import RECIPES
from engine.config import load_config
from engine.simulation import simulate

pytestmark = pytest.mark.ray

TINY = [
    "dataset.num_clients=24",
    "dataset.synthetic_mean_samples=12",
    "dataset.synthetic_dim=8",
    "sampling.rate=0.4",
    "rounds=2",
    "eval.every=1",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.noise_multiplier=1.0",
    "ray.num_workers=2",
    "ray.num_cpus_per_worker=1",
]


ON_RAY = [
    "fedavg",
    "dp_fedavg",
    "dp2_fedsam",
    "dp_fedpgn_ls",
    "dp_ftrl",
    "dp_bandmf",
    "fedsmp_randk",
    "dp_fedsam_topk",
]


def test_the_chosen_recipes_exist() -> None:
    assert set(ON_RAY) <= set(RECIPES)


@pytest.mark.parametrize("name", ON_RAY)
def test_recipe_runs_on_ray_like_in_process(ray_session, name: str) -> None:
    on_ray = simulate(load_config(overrides=[*TINY, f"algorithm={name}"]), write=False)
    local = simulate(
        load_config(overrides=[*TINY, f"algorithm={name}", "ray.executor=local"]), write=False
    )
    assert len(on_ray.rounds) == 2
    assert np.array_equal(on_ray.weights, local.weights)
    if "personal_accuracy_nonprivate" in local.rounds:
        assert on_ray.rounds["personal_accuracy_nonprivate"].equals(
            local.rounds["personal_accuracy_nonprivate"]
        )
