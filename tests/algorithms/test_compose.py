"""User-composed recipes (algorithm: custom, algorithms.compose): every built-in recipe
spelled as a recipe: section builds the same pipeline and trains bit-identically; the
privacy guard and config checks apply to composed recipes too."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import algorithms.pipeline as pl
from algorithms import RECIPES, build_pipeline
from algorithms.dp_fedpgn import PGNDriftRemoval
from engine.cli import main
from engine.config import AlgoConfig, ConfigError, RecipeConfig, load_config
from engine.simulation import prepare, simulate
from tests.conftest import TINY as CONFTEST_TINY
from tuning.spaces import space_for

#: The YAML spelling of each built-in recipe (docs/algorithms.md §9).
SPELLINGS: dict[str, dict] = {
    "fedavg": {"private": False},
    "fedsam": {"private": False, "step": "sam"},
    "dp_fedavg": {},
    "dp_fedavg_blur": {"regularizer": "blur"},
    "dp_fedavg_blur_lus": {"regularizer": "blur", "client_transforms": ("lus",)},
    "fedsmp_randk": {"client_transforms": ("randk",), "noise_support": "public_mask"},
    "fedsmp_topk": {"client_transforms": ("topk",)},
    "dp_fed_ls": {"constraint": "ball", "server_transforms": ("laplacian_smoothing",)},
    "dp_fedsam": {"step": "sam"},
    "dp_fedsam_topk": {"step": "sam", "server_transforms": ("server_topk",)},
    "dp2_fedsam": {"step": "sam", "personal": True},
    "dp_fedpgn": {"step": "pgn"},
    "dp_fedpgn_ls": {"step": "pgn", "server_transforms": ("laplacian_smoothing",)},
    "dp_ftrl": {"participation": "epoch_passes", "noise": "tree", "server_step": "ftrl"},
    "dp_bandmf": {
        "participation": "b_min_separation",
        "noise": "banded",
        "server_step": "banded_momentum",
    },
}

TINY = [*CONFTEST_TINY, "privacy.noise_multiplier=1.0"]


def _recipe_overrides(name: str) -> list[str]:
    out = ["algorithm=custom"]
    for key, value in SPELLINGS[name].items():
        if isinstance(value, tuple):
            value = "[" + ",".join(value) + "]"
        out.append(f"recipe.{key}={value}")
    return out


def test_every_built_in_recipe_has_a_spelling() -> None:
    # correlated noise (dp_ftrl, dp_bandmf) names its participation, noise scheme and
    # server step (docs/algorithms.md §9, §11, §12)
    assert set(SPELLINGS) == set(RECIPES)


@pytest.mark.parametrize("name", list(SPELLINGS))
@pytest.mark.parametrize(
    "algo,model",
    [
        (AlgoConfig(), "mlp"),
        (AlgoConfig(), "logreg"),
        (
            AlgoConfig(
                rho=0.1, asam=False, keep_fraction=0.3, zero_fraction=0.3, sigma_ls=0.2, beta=0.6
            ),
            "cnn",
        ),
        (AlgoConfig(blur_lambda=0.8, randk_rescale=True, ls_scope="weights"), None),
    ],
)
def test_spelling_builds_the_built_in_pipeline(name: str, algo: AlgoConfig, model) -> None:
    composed = build_pipeline("custom", algo, 0.7, 1.3, model, RecipeConfig(**SPELLINGS[name]))
    assert composed == build_pipeline(name, algo, 0.7, 1.3, model)


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_trains_bit_identically_to_the_built_in_name(name: str) -> None:
    built_in = simulate(load_config(overrides=[*TINY, f"algorithm={name}"]), write=False)
    composed = simulate(load_config(overrides=[*TINY, *_recipe_overrides(name)]), write=False)
    assert np.array_equal(built_in.weights, composed.weights)
    drop = ["wall_time_s_nonprivate", "algorithm"]  # the name differs, nothing else
    assert built_in.rounds.drop(columns=drop).equals(composed.rounds.drop(columns=drop))
    assert set(composed.rounds["algorithm"]) == {"custom"}
    assert composed.privacy["private"] == RECIPES[name].private
    assert math.isinf(composed.final_epsilon) != RECIPES[name].private


def test_a_new_combination_runs_privately_and_records_its_pieces_parameters() -> None:
    """SAM + Laplacian smoothing, a combination no built-in recipe has."""
    over = [*TINY, "algorithm=custom", "recipe.step=sam"]
    over += ["recipe.server_transforms=[laplacian_smoothing]", "algo.sigma_ls=0.3"]
    res = simulate(load_config(overrides=over), write=False)
    assert (res.rounds["max_clipped_norm_nonprivate"] <= 0.5 * (1 + 1e-12)).all()
    assert res.rounds["sigma_ls"].iloc[-1] == 0.3 and res.rounds["rho"].iloc[-1] == 0.5
    assert res.final_epsilon == pytest.approx(
        simulate(load_config(overrides=[*TINY, "algorithm=dp_fedavg"]), write=False).final_epsilon
    )


@pytest.mark.parametrize("masks", [["topk"], ["lus"], ["randk", "topk"]])
def test_noise_restricted_to_a_data_dependent_mask_is_refused(masks) -> None:
    over = [*TINY, "algorithm=custom", f"recipe.client_transforms=[{','.join(masks)}]"]
    over.append("recipe.noise_support=public_mask")
    with pytest.raises(ConfigError, match="noise restricted to a mask that is not public"):
        prepare(load_config(overrides=over))


@pytest.mark.parametrize(
    "over,match",
    [
        (["algorithm=custom", "recipe.step=adam"], r"^recipe.step='adam': must be one of sgd"),
        (["algorithm=custom", "recipe.client_transforms=[topk,mask]"], r"^recipe.client_trans"),
        (["algorithm=custom", "recipe.server_transforms=[server_topk,server_topk]"], "repeats"),
        (["recipe.step=sam"], r"^recipe.step='sam': a recipe: section is read only with"),
        (
            ["algorithm=custom", "recipe.private=false", "recipe.noise_support=public_mask"],
            r"^recipe.noise_support='public_mask': needs recipe.private=true",
        ),
    ],
)
def test_bad_recipe_sections_name_the_key(over, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=over)


def test_a_non_private_composed_recipe_refuses_a_budget(capsys) -> None:
    args = ["run", "--set", "algorithm=custom", "--set", "recipe.private=false"]
    assert main([*args, "--set", "privacy.epsilon=2"]) == 2
    assert "algorithm=custom is not private" in capsys.readouterr().err


def test_tune_space_of_a_composed_recipe_comes_from_its_pieces() -> None:
    recipe = RecipeConfig(step="sam", server_transforms=("laplacian_smoothing",))
    space = space_for("custom", None, recipe)
    assert {"algo.rho", "algo.sigma_ls", "privacy.clip_norm", "local.lr"} <= set(space)
    assert "algo.beta" not in space
    with pytest.raises(ConfigError, match=r"tune.space.algo.beta: unknown hyperparameter"):
        space_for(
            "custom", {"custom": {"algo.beta": {"type": "uniform", "low": 0, "high": 1}}}, recipe
        )
    # not private: nothing to clip, so C is not searched
    assert "privacy.clip_norm" not in space_for("custom", None, RecipeConfig(private=False))


def test_compare_rows_of_built_in_recipes_drop_the_configs_composed_recipe(tmp_path) -> None:
    """One config (algorithm: custom + recipe:) compared with built-in recipes: the
    recipe section travels with the custom row only, so every row's config is valid."""
    from engine.simulation.compare import plan

    config = load_config(overrides=[*TINY, "algorithm=custom", "recipe.step=sam"])
    runs = plan(config, ["dp_fedavg", "custom", "fedsam"], tmp_path)
    by = {r.label: r.config for r in runs}
    assert by["custom"].recipe == RecipeConfig(step="sam")
    assert by["dp_fedavg"].recipe == by["fedsam"].recipe == RecipeConfig()
    assert [c.is_private for c in by.values()] == [True, True, False]
    # the custom row is the composed SAM pipeline; the built-in rows are their own
    pipes = {k: prepare(c).pipeline for k, c in by.items()}
    assert pipes["custom"] == build_pipeline("dp_fedsam", AlgoConfig(), 0.5, 1.0, "mlp")
    assert pipes["dp_fedavg"].step != pipes["custom"].step


def test_structural_knobs_of_built_in_recipes_change_their_spelling() -> None:
    """dp_fed_ls's ls_local and dp_fedsam_topk's topk_site pick pieces; the recipe's
    own default (top-k keeps 0.4 at either site) fills a null algo key."""
    from algorithms.pipeline import BallProjection, ServerTopK, TopK

    project = build_pipeline("dp_fed_ls", AlgoConfig(), 0.7, 1.0, "mlp")
    once = build_pipeline("dp_fed_ls", AlgoConfig(ls_local="clip_once"), 0.7, 1.0, "mlp")
    assert project.constraint == BallProjection(0.7) and once.constraint is None
    server = build_pipeline("dp_fedsam_topk", AlgoConfig(), 0.7, 1.0)
    client = build_pipeline("dp_fedsam_topk", AlgoConfig(topk_site="client"), 0.7, 1.0)
    assert server.server_transforms == (ServerTopK(0.4),) and server.client_transforms == ()
    assert client.client_transforms == (TopK(0.4),) and client.server_transforms == ()
    # the same pieces spelled by hand take the piece's own default (top-k 0.5)
    hand = build_pipeline(
        "custom",
        AlgoConfig(),
        0.7,
        1.0,
        None,
        RecipeConfig(step="sam", client_transforms=("topk",)),
    )
    assert hand.client_transforms == (TopK(0.5),)


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: pl.SAMStep(rho=-0.1, asam=False), "algo.rho"),
        (lambda: pl.PGNStep(beta=1.5, rho=0.1), "algo.beta"),
        (lambda: pl.BLUR(lam=-1.0, clip_norm=1.0), "algo.blur_lambda"),
        (lambda: pl.BallProjection(radius=0.0), "privacy.clip_norm"),
        (lambda: pl.TopK(0.0), "algo.keep_fraction"),
        (lambda: pl.RandK(1.5), "algo.keep_fraction"),
        (lambda: pl.ServerTopK(float("nan")), "algo.keep_fraction"),
        (lambda: pl.LUS(1.0), "algo.zero_fraction"),
        (lambda: pl.LaplacianSmoothing(sigma_ls=-1.0), "algo.sigma_ls"),
        (lambda: pl.LaplacianSmoothing(sigma_ls=1.0, scope="rows"), "algo.ls_scope"),
        (lambda: pl.PersonalSplit(layers=0), "algo.personal_layers"),
        (lambda: pl.PersonalSplit(head_steps=0), "algo.head_steps"),
        (lambda: PGNDriftRemoval(beta=-0.5), "algo.beta"),
    ],
)
def test_pieces_validate_their_fields(make, key) -> None:
    """A piece built from Python (not only from a config) refuses a bad field, naming
    the config key it comes from."""
    with pytest.raises(ValueError, match=f"^{re.escape(key)}"):
        make()
