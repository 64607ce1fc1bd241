"""A piece declares itself once (issue 27): a toy client transform registered from this
test module, with one key, shows up in the config tree, ``dpfl config``, the Tune space
of a recipe naming it, the README key-table check and the resolved hyperparameters, and
a run with it changes the update as the toy says. It is removed again after each test."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from algorithms import registry
from algorithms.spec import Key, PieceSpec
from engine.cli import main
from engine.config import ConfigError, load_config
from engine.config.doc import commented_yaml, undocumented_keys
from engine.simulation import simulate
from tests.conftest import TINY
from tuning.spaces import space_for

DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass(frozen=True)
class ToyScale:
    """Scales each client's update by ``factor`` before clipping."""

    factor: float
    public_mask = False

    def apply(self, delta: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return delta * self.factor


TOY_FACTOR = Key(
    "toy_factor",
    float | None,
    None,
    "toy: scale of each client's update (null: 1)",
    lambda v: v >= 0,
    "must be >= 0",
)
TOY = PieceSpec(
    "toy_scale",
    "client_transform",
    f"{__name__}:ToyScale",
    lambda cls, a, ctx: cls(1.0 if a.toy_factor is None else a.toy_factor),
    keys=(TOY_FACTOR,),
    space={"algo.toy_factor": {"type": "uniform", "low": 0.1, "high": 2.0}},
    report=lambda t, pipeline: {"toy_factor": t.factor},
)
CUSTOM = ["algorithm=custom", "recipe.client_transforms=[toy_scale]"]


@pytest.fixture
def toy() -> Iterator[PieceSpec]:
    with registry.registered(TOY) as spec:
        yield spec
    assert "toy_scale" not in registry.names("client_transform")


def test_the_toy_key_is_in_the_config_tree_and_checked(toy) -> None:
    config = load_config(overrides=[*CUSTOM, "algo.toy_factor=0.5"])
    assert config.algo.toy_factor == 0.5 and config.recipe.client_transforms == ("toy_scale",)
    with pytest.raises(ConfigError, match=r"^algo\.toy_factor=-1\.0: must be >= 0$"):
        load_config(overrides=[*CUSTOM, "algo.toy_factor=-1"])
    assert "toy_factor" in config.to_dict()["algo"]


def test_without_the_toy_its_name_and_key_are_unknown() -> None:
    with pytest.raises(ConfigError, match="recipe.client_transforms"):
        load_config(overrides=CUSTOM)
    with pytest.raises(ConfigError, match="algo.toy_factor: unknown config key"):
        load_config(overrides=["algo.toy_factor=0.5"])


def test_dpfl_config_lists_the_toy_key_with_its_help(toy, capsys) -> None:
    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert "  toy_factor: null  # toy: scale of each client's update (null: 1)" in text
    assert "before clipping, any of topk, randk, lus, toy_scale" in text  # recipe: help
    assert text == commented_yaml()


def test_the_tune_space_of_a_recipe_naming_the_toy_holds_its_range(toy) -> None:
    recipe = load_config(overrides=CUSTOM).recipe
    space = space_for("custom", recipe=recipe)
    assert space["algo.toy_factor"] == {"type": "uniform", "low": 0.1, "high": 2.0}


def test_the_generated_reference_documents_the_toy_key(toy) -> None:
    """A registered piece's key reaches the configuration reference with its help."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = gen.config_page()
    assert "| `algo.toy_factor` | `null` | toy: scale of each client's update (null: 1) |" in page
    assert undocumented_keys() == []


def test_a_run_with_the_toy_scales_the_update(toy) -> None:
    """Non-private (no clipping), one round, server lr 1: x1 - x0 = factor * mean(Δ)."""
    base = [*TINY, *CUSTOM, "recipe.private=false", "rounds=1"]

    def weights(factor: float) -> tuple[np.ndarray, Any]:
        res = simulate(load_config(overrides=[*base, f"algo.toy_factor={factor}"]), write=False)
        return np.asarray(res.weights, dtype=np.float64), res.rounds

    start, _ = weights(0.0)  # Δ scaled to 0: the initial model
    full, _ = weights(1.0)
    half, rounds = weights(0.5)
    assert not np.allclose(full, start)
    np.testing.assert_allclose(half - start, 0.5 * (full - start), rtol=1e-5, atol=1e-6)
    assert rounds["toy_factor"].iloc[-1] == 0.5  # its resolved hyperparameter column
