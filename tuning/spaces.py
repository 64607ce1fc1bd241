"""Search spaces per recipe, as data, overridable from YAML (``tune.space``).

A space maps a config key (``privacy.clip_norm``, ``local.lr``, ``algo.rho``, …) to
a distribution spec: ``{"type": "uniform"|"loguniform", "low": a, "high": b}``,
``{"type": "choice", "values": [...]}`` or ``{"type": "randint", "low": a,
"high": b}``. ε is never searched: it is fixed per trial and σ is calibrated from it.

A YAML override is ``tune: {space: {all: {...}, <recipe>: {...}}}``: entries under
``all`` apply to every recipe, entries under a recipe's name to that recipe; a key
mapped to ``null`` is removed from the space. A composed recipe (``algorithm: custom``,
algorithms.compose) starts from the ranges of the pieces it names, under ``custom``.
"""

from __future__ import annotations

import copy
from typing import Any

from algorithms import RECIPES
from engine.config import CUSTOM, ConfigError, RecipeConfig, load_config

COMMON: dict[str, dict[str, Any]] = {
    "privacy.clip_norm": {"type": "loguniform", "low": 0.1, "high": 3.0},
    "local.lr": {"type": "loguniform", "low": 0.01, "high": 0.5},
    "local.epochs": {"type": "choice", "values": [1, 2]},
}

#: Each recipe's own ranges live with the recipe (``Recipe.search_space``).
PER_RECIPE: dict[str, dict[str, dict[str, Any]]] = {
    name: recipe.search_space for name, recipe in RECIPES.items() if recipe.search_space
}

FORBIDDEN = ("privacy.epsilon", "privacy.noise_multiplier", "algorithm", "seed")


def _sample_value(key: str, spec: dict[str, Any]) -> Any:
    kind = spec.get("type")
    if kind in ("uniform", "loguniform", "randint"):
        low, high = spec.get("low"), spec.get("high")
        if not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or low >= high:
            raise ConfigError(f"tune.space.{key}={spec!r}: needs numbers low < high")
        if kind == "loguniform" and low <= 0:
            raise ConfigError(f"tune.space.{key}={spec!r}: loguniform needs low > 0")
        return low
    if kind == "choice":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"tune.space.{key}={spec!r}: choice needs a non-empty values list")
        return values[0]
    raise ConfigError(
        f"tune.space.{key}={spec!r}: type must be uniform, loguniform, randint or choice"
    )


def _hyperparameters(algorithm: str, recipe: Any = None) -> tuple[str, ...]:
    """The ``algo.*`` keys ``algorithm`` reads (a composed recipe's from its pieces)."""
    if algorithm == CUSTOM:
        from algorithms import compose

        return compose.hyperparameters(recipe if recipe is not None else RecipeConfig())
    return RECIPES[algorithm].hyperparameters


def validate_space(algorithm: str, space: dict[str, dict[str, Any]], recipe: Any = None) -> None:
    """Reject unknown or meaningless hyperparameter names with a clear error.
    ``recipe``: the ``recipe:`` section (engine.config.RecipeConfig) of ``custom``."""
    names = _hyperparameters(algorithm, recipe)
    for key, spec in space.items():
        if key in FORBIDDEN:
            raise ConfigError(
                f"tune.space.{key}: not searchable (epsilon is fixed per trial and sigma is "
                "calibrated from it; seed and algorithm are set by dpfl tune)"
            )
        if key.startswith("algo.") and key.split(".", 1)[1] not in (
            *names,
            "noise_site",
            "client_state",
        ):
            raise ConfigError(
                f"tune.space.{key}: unknown hyperparameter for algorithm={algorithm} "
                f"(its algo keys: {', '.join(names) or 'none'})"
            )
        if not isinstance(spec, dict):
            raise ConfigError(f"tune.space.{key}={spec!r}: expected a distribution mapping")
        sample = _sample_value(key, spec)
        try:  # the key must exist in the config tree, and a sample must type-check
            load_config(overrides=[f"{key}={sample}"])
        except ConfigError as e:
            msg = str(e)
            if "unknown config key" in msg:
                raise ConfigError(f"tune.space.{key}: unknown hyperparameter ({msg})") from None
            if not msg.startswith("privacy.epsilon"):
                raise ConfigError(f"tune.space.{key}: {msg}") from None


def space_for(
    algorithm: str, overrides: dict[str, Any] | None = None, recipe: Any = None
) -> dict[str, Any]:
    """The validated search space of ``algorithm`` (defaults + YAML overrides). For
    ``custom``, the defaults are the ranges of the pieces its ``recipe`` names."""
    if algorithm not in (*RECIPES, CUSTOM):
        raise ConfigError(f"--algorithms: unknown algorithm {algorithm!r}")
    space = copy.deepcopy(COMMON)
    if algorithm == CUSTOM:
        from algorithms import compose

        recipe = recipe if recipe is not None else RecipeConfig()
        space.update(copy.deepcopy(compose.default_space(recipe)))
        private = recipe.private
    else:
        space.update(copy.deepcopy(PER_RECIPE.get(algorithm, {})))
        private = RECIPES[algorithm].private
    if not private:
        space.pop("privacy.clip_norm", None)
    overrides = overrides or {}
    unknown_sections = set(overrides) - {"all", CUSTOM, *RECIPES}
    if unknown_sections:
        raise ConfigError(
            f"tune.space: unknown section(s) {sorted(unknown_sections)}; use 'all' or a recipe name"
        )
    for section in ("all", algorithm):
        for key, spec in (overrides.get(section) or {}).items():
            if spec is None:
                space.pop(key, None)
            else:
                space[key] = spec
    validate_space(algorithm, space, recipe)
    return space


def sample(space: dict[str, Any], rng) -> dict[str, Any]:
    """One draw from a validated space with a ``numpy.random.Generator`` (random search
    without a searcher: trial k's values are a function of (seed, algorithm, ε, k))."""
    import math

    out: dict[str, Any] = {}
    for key in sorted(space):
        spec = space[key]
        kind = spec["type"]
        if kind == "uniform":
            out[key] = float(rng.uniform(spec["low"], spec["high"]))
        elif kind == "loguniform":
            out[key] = float(math.exp(rng.uniform(math.log(spec["low"]), math.log(spec["high"]))))
        elif kind == "randint":
            out[key] = int(rng.integers(spec["low"], spec["high"]))
        else:
            out[key] = spec["values"][int(rng.integers(len(spec["values"])))]
    return out


def to_tune(space: dict[str, Any]) -> dict[str, Any]:
    """Ray Tune distributions for a validated space."""
    from ray import tune

    out: dict[str, Any] = {}
    for key, spec in space.items():
        kind = spec["type"]
        if kind == "uniform":
            out[key] = tune.uniform(spec["low"], spec["high"])
        elif kind == "loguniform":
            out[key] = tune.loguniform(spec["low"], spec["high"])
        elif kind == "randint":
            out[key] = tune.randint(spec["low"], spec["high"])
        else:
            out[key] = tune.choice(spec["values"])
    return out
