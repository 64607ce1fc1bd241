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
from tests.cross_process import CROSS_PROCESS_RECIPES, TINY

pytestmark = pytest.mark.ray

ON_RAY = CROSS_PROCESS_RECIPES


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
