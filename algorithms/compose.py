"""User-composed recipes: ``algorithm: custom`` with a ``recipe:`` section naming pieces.

A composed recipe is assembled from the same pieces as the built-in ones and goes
through the same engine order and privacy guard (docs/algorithms.md §0, §9)::

    algorithm: custom
    recipe:
      private: true                      # false: no clipping, no noise, epsilon = inf
      step: sam                          # sgd | sam | pgn
      regularizer: blur                  # optional: blur
      constraint: ball                   # optional: project onto the C-ball every step
      client_transforms: [topk]          # before clipping: topk | randk | lus
      noise_support: all                 # all | public_mask (rand-k only)
      server_transforms: [laplacian_smoothing, server_topk]   # after the noise
      personal: false                    # true: DP²-FedSAM's personal heads
    algo: {rho: 0.05, asam: false, sigma_ls: 0.1}             # the pieces' parameters

The pieces' parameters are the ``algo.*`` keys the built-in recipes use, with the same
defaults (so ``dpfl tune`` searches them the same way). ``step: pgn`` brings DP-FedPGN's
public drift removal/restore and its server update (every client runs exactly K local
plain-SGD steps); ``laplacian_smoothing`` with ``step: pgn`` smooths the direction g̃ as
DP-FedPGN-LS does. Privacy: whatever the combination, updates are clipped to C and
noised once with z·C on the noise support, and a noise support restricted to a mask
that depends on the data (top-k, LUS) is refused when the pipeline is built.

This module imports no torch: :mod:`engine.config` checks names with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import check as _check

STEPS = ("sgd", "sam", "pgn")
REGULARIZERS = ("blur",)
CONSTRAINTS = ("ball",)
CLIENT_TRANSFORMS = ("topk", "randk", "lus")
SERVER_TRANSFORMS = ("laplacian_smoothing", "server_topk")
NOISE_SUPPORTS = ("all", "public_mask")

#: algo.* keys each piece reads (the composed recipe's hyperparameters).
PIECE_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "sam": ("rho", "asam"),
    "pgn": ("beta", "rho"),
    "blur": ("blur_lambda",),
    "topk": ("keep_fraction",),
    "randk": ("keep_fraction", "randk_rescale"),
    "lus": ("zero_fraction",),
    "laplacian_smoothing": ("sigma_ls", "ls_scope"),
    "server_topk": ("keep_fraction",),
    "personal": ("head_steps", "body_steps", "personal_layers"),
}

#: Default Tune ranges per piece (tuning.spaces); the built-in recipes' ranges.
PIECE_SPACES: dict[str, dict[str, dict[str, Any]]] = {
    "sam": {"algo.rho": {"type": "uniform", "low": 0.01, "high": 1.0}},
    "pgn": {
        "algo.beta": {"type": "uniform", "low": 0.1, "high": 1.0},
        "algo.rho": {"type": "uniform", "low": 0.0, "high": 0.5},
    },
    "blur": {"algo.blur_lambda": {"type": "choice", "values": [0.05, 0.1, 0.2, 0.4, 0.8]}},
    "topk": {"algo.keep_fraction": {"type": "uniform", "low": 0.1, "high": 1.0}},
    "randk": {"algo.keep_fraction": {"type": "uniform", "low": 0.1, "high": 1.0}},
    "server_topk": {"algo.keep_fraction": {"type": "uniform", "low": 0.1, "high": 1.0}},
    "laplacian_smoothing": {"algo.sigma_ls": {"type": "loguniform", "low": 0.001, "high": 3.0}},
}


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

    def __post_init__(self) -> None:
        def one_of(key: str, value: Any, names: tuple[str, ...]) -> None:
            _check(value in names, f"recipe.{key}", value, f"must be one of {', '.join(names)}")

        one_of("step", self.step, STEPS)
        if self.regularizer is not None:
            one_of("regularizer", self.regularizer, REGULARIZERS)
        if self.constraint is not None:
            one_of("constraint", self.constraint, CONSTRAINTS)
        for name in self.client_transforms:
            one_of("client_transforms", name, CLIENT_TRANSFORMS)
        for name in self.server_transforms:
            one_of("server_transforms", name, SERVER_TRANSFORMS)
        one_of("noise_support", self.noise_support, NOISE_SUPPORTS)
        for key in ("client_transforms", "server_transforms"):
            names = getattr(self, key)
            _check(len(set(names)) == len(names), f"recipe.{key}", list(names), "repeats a piece")
        _check(
            self.private or self.noise_support == "all",
            "recipe.noise_support",
            self.noise_support,
            "needs recipe.private=true (a non-private recipe adds no noise)",
        )


def pieces(recipe: Any) -> list[str]:
    """The named pieces of a :class:`RecipeConfig`, in engine order."""
    out = [recipe.step]
    out += [p for p in (recipe.regularizer, recipe.constraint) if p]
    out += list(recipe.client_transforms) + list(recipe.server_transforms)
    if recipe.personal:
        out.append("personal")
    return out


def hyperparameters(recipe: Any) -> tuple[str, ...]:
    """The ``algo.*`` keys a composed recipe reads."""
    names = [h for p in pieces(recipe) for h in PIECE_HYPERPARAMETERS.get(p, ())]
    return tuple(dict.fromkeys(names))


def default_space(recipe: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for p in pieces(recipe):
        out.update(PIECE_SPACES.get(p, {}))
    return out


def build(recipe: Any, algo: Any, clip_norm: float, noise_multiplier: float, model_name=None):
    """The :class:`~algorithms.pipeline.Pipeline` of a recipe's pieces: the one place
    pieces are constructed, for ``algorithm: custom`` and for every built-in recipe
    (whose spelling :func:`algorithms.recipes.build_pipeline` passes here)."""
    import math

    from algorithms.builders import fed_ls_default_sigma
    from algorithms.builders import pick as _pick
    from algorithms.builders import privatizer as _priv
    from algorithms.builders import sam_step as _sam
    from algorithms.pipeline import (
        BLUR,
        LUS,
        BallProjection,
        LaplacianSmoothing,
        PersonalSplit,
        PGNDirection,
        PGNDriftRemoval,
        PGNDriftRestore,
        PGNStep,
        Pipeline,
        RandK,
        ServerTopK,
        TopK,
    )

    a = algo
    C = clip_norm if recipe.private else math.inf
    pgn = recipe.step == "pgn"
    kw: dict[str, Any] = {}
    if recipe.step == "sam":
        kw["step"] = _sam(a)
    if recipe.regularizer == "blur":
        kw["regularizer"] = BLUR(_pick(a.blur_lambda, 0.4), C)
    if recipe.constraint == "ball":
        kw["constraint"] = BallProjection(C)
    client = {
        "topk": lambda: TopK(_pick(a.keep_fraction, 0.5)),
        "randk": lambda: RandK(_pick(a.keep_fraction, 0.5), rescale=a.randk_rescale),
        "lus": lambda: LUS(_pick(a.zero_fraction, 0.7)),
    }
    client_transforms = [client[name]() for name in recipe.client_transforms]
    smoothing_sigma = 0.01 if pgn else fed_ls_default_sigma(model_name)
    server = {
        "laplacian_smoothing": lambda: LaplacianSmoothing(
            _pick(a.sigma_ls, smoothing_sigma), a.ls_scope
        ),
        "server_topk": lambda: ServerTopK(_pick(a.keep_fraction, 0.4)),
    }
    server_transforms = [server[name]() for name in recipe.server_transforms]
    if pgn:  # DP-FedPGN's public drift and server update come with its step
        beta, rho = _pick(a.beta, 0.3), _pick(a.rho, 0.2)
        kw["step"] = PGNStep(beta=beta, rho=rho)
        client_transforms.insert(0, PGNDriftRemoval(beta))  # transforms see Δ̄
        smoothing = [t for t in server_transforms if isinstance(t, LaplacianSmoothing)]
        server_transforms = [t for t in server_transforms if t not in smoothing]
        server_transforms.insert(0, PGNDriftRestore(beta))
        kw.update(
            server_update=PGNDirection(smoothing[0] if smoothing else None),
            fixed_steps=True,
            plain_sgd=True,
        )
    if recipe.private:
        kw["privatizer"] = _priv(C, noise_multiplier, a, support=recipe.noise_support)
    if recipe.personal:
        kw["personal"] = PersonalSplit(a.personal_layers, a.head_steps, a.body_steps)
    return Pipeline(
        client_transforms=tuple(client_transforms),
        server_transforms=tuple(server_transforms),
        **kw,
    )
