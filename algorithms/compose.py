"""User-composed recipes: ``algorithm: custom`` with a ``recipe:`` section naming pieces.

A composed recipe is assembled from the same pieces as the built-in ones and goes
through the same engine order and privacy guard (docs/algorithms.md §0, §9)::

    algorithm: custom
    recipe:
      private: true                      # false: no clipping, no noise, epsilon = inf
      step: sam                          # sgd | sam | any registered step rule
      regularizer: blur                  # optional: blur
      constraint: ball                   # optional: project onto the C-ball every step
      client_transforms: [topk]          # before clipping: topk | randk | lus
      noise_support: all                 # all | public_mask (rand-k only)
      server_transforms: [laplacian_smoothing, server_topk]   # after the noise
      personal: false                    # true: DP²-FedSAM's personal heads
      server_step: null                  # null: fedavg (or the step rule's own)
      noise: null                        # null: gaussian (independent every round)
      participation: null                # null: sampled (the sampling: section)
    algo: {rho: 0.05, asam: false, sigma_ls: 0.1}             # the pieces' parameters

The pieces are those of :mod:`algorithms.registry`; their parameters are the ``algo.*``
keys the built-in recipes use, with the same defaults (so ``dpfl tune`` searches them
the same way). A step rule may bring pieces with it (its spec's ``extend``: a method's
client and server transforms and its own server step, declared in the method's
module). ``server_step``, ``noise`` and ``participation`` name a round's extension
points (the registry's kinds of those names). Privacy: whatever the
combination, updates are clipped to C and noised once with z·C on the noise support; a
noise support restricted to a mask that depends on the data (top-k, LUS) is refused
when the pipeline is built, and a noise scheme refuses a participation its event does
not hold under when the run is planned.

This module imports no torch: :mod:`engine.config` checks names with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from algorithms import registry
from algorithms.spec import BuildContext
from engine.base.errors import check as _check

#: ``recipe.noise_support`` (not a piece: where the privatizer's noise goes).
NOISE_SUPPORTS = ("all", "public_mask")


@dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """A user-composed recipe, read only with ``algorithm: custom`` (this module):
    the pieces by name; their parameters are the ``algo.*`` keys."""

    private: bool = True
    step: str = "sgd"
    regularizer: str | None = None
    constraint: str | None = None
    client_transforms: tuple[str, ...] = ()
    noise_support: str = "all"
    server_transforms: tuple[str, ...] = ()
    personal: bool = False
    server_step: str | None = None  # null: fedavg, or the one the step rule brings
    noise: str | None = None  # null: gaussian
    participation: str | None = None  # null: sampled

    def __post_init__(self) -> None:
        def one_of(key: str, value: Any, names: tuple[str, ...]) -> None:
            _check(value in names, f"recipe.{key}", value, f"must be one of {', '.join(names)}")

        one_of("step", self.step, registry.names("step"))
        if self.regularizer is not None:
            one_of("regularizer", self.regularizer, registry.names("regularizer"))
        if self.constraint is not None:
            one_of("constraint", self.constraint, registry.names("constraint"))
        for name in self.client_transforms:
            one_of("client_transforms", name, registry.names("client_transform"))
        for name in self.server_transforms:
            one_of("server_transforms", name, registry.names("server_transform"))
        one_of("noise_support", self.noise_support, NOISE_SUPPORTS)
        for key in ("server_step", "noise", "participation"):
            if getattr(self, key) is not None:
                one_of(key, getattr(self, key), registry.names(key))
        for key in ("client_transforms", "server_transforms"):
            names = getattr(self, key)
            _check(len(set(names)) == len(names), f"recipe.{key}", list(names), "repeats a piece")
        _check(
            self.private or self.noise_support == "all",
            "recipe.noise_support",
            self.noise_support,
            "needs recipe.private=true (a non-private recipe adds no noise)",
        )
        _check(
            self.private or self.noise in (None, "gaussian"),
            "recipe.noise",
            self.noise,
            "needs recipe.private=true (a non-private recipe adds no noise)",
        )


def pieces(recipe: Any) -> list[str]:
    """The named pieces of a :class:`RecipeConfig`, in engine order."""
    out = [recipe.step]
    out += [p for p in (recipe.regularizer, recipe.constraint) if p]
    out += list(recipe.client_transforms) + list(recipe.server_transforms)
    if recipe.personal:
        out.append("personal")
    for key in ("participation", "noise", "server_step"):
        if getattr(recipe, key, None) is not None:
            out.append(getattr(recipe, key))
    return out


def hyperparameters(recipe: Any) -> tuple[str, ...]:
    """The ``algo.*`` keys a composed recipe reads."""
    names = [h for p in pieces(recipe) for h in registry.piece_keys(p)]
    return tuple(dict.fromkeys(names))


def default_space(recipe: Any) -> dict[str, dict[str, Any]]:
    """Tune's default ranges for a composed recipe: those its pieces declare."""
    return registry.space(pieces(recipe))


def build(recipe: Any, algo: Any, clip_norm: float, noise_multiplier: float, model_name=None):
    """The :class:`~algorithms.pipeline.Pipeline` of a recipe's pieces: the one place
    pieces are constructed, for ``algorithm: custom`` and for every built-in recipe
    (whose spelling :func:`algorithms.recipes.build_pipeline` passes here). Each piece
    is made by its registered builder (:mod:`algorithms.registry`); a step rule that
    brings pieces with it adds them (its spec's ``extend``)."""
    import math

    from algorithms.pipeline import GaussianPrivatizer, Pipeline

    C = clip_norm if recipe.private else math.inf
    ctx = BuildContext(clip_norm=C, model_name=model_name, recipe=recipe)

    def make(name: str) -> Any:
        spec = registry.spec(name)
        return spec.build(spec.piece_class(), algo, ctx)

    parts: dict[str, Any] = {
        "client_transforms": [make(name) for name in recipe.client_transforms],
        "server_transforms": [make(name) for name in recipe.server_transforms],
        "server_step": make(recipe.server_step) if recipe.server_step else None,
    }
    if recipe.step != "sgd":
        parts["step"] = make(recipe.step)
        extend = registry.spec(recipe.step).extend
        if extend is not None:  # what the step rule brings with it (its method's pieces)
            extend(parts["step"], parts)
    if recipe.regularizer is not None:
        parts["regularizer"] = make(recipe.regularizer)
    if recipe.constraint is not None:
        parts["constraint"] = make(recipe.constraint)
    if recipe.private:
        parts["privatizer"] = GaussianPrivatizer(
            C,
            noise_multiplier,
            site=algo.noise_site,
            noise_support=recipe.noise_support,
            noise=make(recipe.noise or "gaussian"),
        )
    if recipe.personal:
        parts["personal"] = make("personal")
    if parts["server_step"] is None:
        parts["server_step"] = make("fedavg")
    parts["client_transforms"] = tuple(parts["client_transforms"])
    parts["server_transforms"] = tuple(parts["server_transforms"])
    return Pipeline(**parts)
