"""Smoke: every recipe runs 2 rounds through the Ray executor and equals in-process."""

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


@pytest.mark.parametrize("name", list(RECIPES))
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
