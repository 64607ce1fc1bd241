"""One recipe per method: a few lines naming its pieces (docs/algorithms.md §1-§7).

``build_pipeline(name, algo, clip_norm, noise_multiplier, ...)`` returns the
:class:`~algorithms.pipeline.Pipeline` and the resolved hyperparameters (recorded as
columns of ``rounds.parquet``). Defaults are the papers' (docs/algorithms.md §1-§7);
where a published recipe is not private as written, the private form is built and the
``departure`` text says what differs. Summaries, privacy flags and citations come from
:mod:`algorithms.catalog` (the papers' titles, authors, venues and arXiv ids).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from algorithms.builders import (  # noqa: F401 (the FED_LS_* constants are re-exported)
    FED_LS_SIGMA_BY_MODEL,
    FED_LS_SIGMA_OTHER,
    fed_ls_default_sigma,
)
from algorithms.builders import pick as _pick
from algorithms.builders import privatizer as _priv
from algorithms.builders import sam_step as _sam
from algorithms.catalog import CATALOG
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
    SAMStep,
    ServerTopK,
    TopK,
)


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    paper: str
    private: bool
    hyperparameters: tuple[str, ...]
    shares: str
    departure: str
    build: Callable[..., Pipeline]


def _fedavg(a, C, z):
    return Pipeline()


def _fedsam(a, C, z):
    return Pipeline(step=_sam(a))


def _dp_fedavg(a, C, z):
    return Pipeline(privatizer=_priv(C, z, a))


def _blur(a, C, z):
    return Pipeline(regularizer=BLUR(_pick(a.blur_lambda, 0.4), C), privatizer=_priv(C, z, a))


def _blur_lus(a, C, z):
    return Pipeline(
        regularizer=BLUR(_pick(a.blur_lambda, 0.4), C),
        client_transforms=(LUS(_pick(a.sparsity, 0.7)),),
        privatizer=_priv(C, z, a),
    )


def _smp_randk(a, C, z):
    return Pipeline(
        client_transforms=(RandK(_pick(a.sparsity, 0.5), rescale=a.randk_rescale),),
        privatizer=_priv(C, z, a, support="public_mask"),
    )


def _smp_topk(a, C, z):
    return Pipeline(client_transforms=(TopK(_pick(a.sparsity, 0.5)),), privatizer=_priv(C, z, a))


def _fed_ls(a, C, z):
    # algo.ls_local: "project" (the paper: w projected onto the ball ||w - x^t|| <= C after
    # every local step) or "clip_once" (no projection; the privatizer's clip of the final
    # update to C is the only bound). Both give ||update|| <= C, so the same accounting.
    ls_local = getattr(a, "ls_local", "project")
    return Pipeline(
        constraint=BallProjection(C) if ls_local == "project" else None,
        privatizer=_priv(C, z, a),
        # build_pipeline fills a null σ_ls from the model kind (MODEL_KIND_DEFAULTS)
        server_transforms=(
            LaplacianSmoothing(_pick(a.sigma_ls, fed_ls_default_sigma(None)), a.ls_scope),
        ),
    )


def _dp_fedsam(a, C, z):
    return Pipeline(step=_sam(a), privatizer=_priv(C, z, a))


def _dp_fedsam_topk(a, C, z):
    p = _pick(a.sparsity, 0.4)
    if a.topk_site == "client":  # option (a): local top-k before clipping, noise on all d
        return Pipeline(step=_sam(a), client_transforms=(TopK(p),), privatizer=_priv(C, z, a))
    return Pipeline(step=_sam(a), privatizer=_priv(C, z, a), server_transforms=(ServerTopK(p),))


def _dp2_fedsam(a, C, z):
    return Pipeline(
        step=_sam(a),
        privatizer=_priv(C, z, a),
        personal=PersonalSplit(a.personal_layers, a.head_steps, a.body_steps),
    )


def _pgn(a, C, z, ls: bool):
    beta, rho = _pick(a.beta, 0.3), _pick(a.rho, 0.2)
    smoothing = LaplacianSmoothing(_pick(a.sigma_ls, 0.01), a.ls_scope) if ls else None
    return Pipeline(
        step=PGNStep(beta=beta, rho=rho),
        client_transforms=(PGNDriftRemoval(beta),),
        privatizer=_priv(C, z, a),
        server_transforms=(PGNDriftRestore(beta),),
        server_update=PGNDirection(smoothing),
        fixed_steps=True,
        plain_sgd=True,
    )


def _recipe(
    name: str,
    hyperparameters: tuple[str, ...],
    shares: str,
    departure: str,
    build: Callable[..., Pipeline],
) -> Recipe:
    """A recipe whose summary, privacy flag and citation are the catalog's."""
    entry = CATALOG[name]
    return Recipe(
        name,
        entry.summary,
        entry.citation(),
        entry.private,
        hyperparameters,
        shares,
        departure,
        build,
    )


_SAM_HP = ("rho", "asam")
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        _recipe(
            "fedavg",
            (),
            "baseline",
            "none",
            _fedavg,
        ),
        _recipe(
            "fedsam",
            _SAM_HP,
            "SAM step of dp_fedsam",
            "none",
            _fedsam,
        ),
        _recipe(
            "dp_fedavg",
            (),
            "privatizer of every private recipe",
            "none",
            _dp_fedavg,
        ),
        _recipe(
            "dp_fedavg_blur",
            ("blur_lambda",),
            "dp_fedavg + BLUR",
            "none",
            _blur,
        ),
        _recipe(
            "dp_fedavg_blur_lus",
            ("blur_lambda", "sparsity"),
            "dp_fedavg_blur + LUS",
            "noise on all d coordinates (LUS mask is private)",
            _blur_lus,
        ),
        _recipe(
            "fedsmp_randk",
            ("sparsity", "randk_rescale"),
            "dp_fedavg + public rand-k",
            "none",
            _smp_randk,
        ),
        _recipe(
            "fedsmp_topk",
            ("sparsity",),
            "dp_fedavg + TopK",
            "noise on all d coordinates (top-k support is private)",
            _smp_topk,
        ),
        _recipe(
            "dp_fed_ls",
            ("sigma_ls", "ls_scope", "ls_local"),
            "LaplacianSmoothing with dp_fedpgn_ls",
            "none",
            _fed_ls,
        ),
        _recipe(
            "dp_fedsam",
            _SAM_HP,
            "SAM step with fedsam, dp2_fedsam",
            "whole-update clipping (reference code clips per tensor with noise for C)",
            _dp_fedsam,
        ),
        _recipe(
            "dp_fedsam_topk",
            (*_SAM_HP, "sparsity", "topk_site"),
            "dp_fedsam + ServerTopK",
            "top-k on the noisy aggregate (paper: per client after noise)",
            _dp_fedsam_topk,
        ),
        _recipe(
            "dp2_fedsam",
            (*_SAM_HP, "head_steps", "body_steps", "personal_layers"),
            "SAM step of dp_fedsam + PersonalSplit",
            "none",
            _dp2_fedsam,
        ),
        _recipe(
            "dp_fedpgn",
            ("beta", "rho"),
            "PGN pieces with dp_fedpgn_ls",
            "fixed C (paper's median clipping is not private)",
            lambda a, C, z: _pgn(a, C, z, False),
        ),
        _recipe(
            "dp_fedpgn_ls",
            ("beta", "rho", "sigma_ls", "ls_scope"),
            "dp_fedpgn + LaplacianSmoothing",
            "fixed C; FFT smoothing (reference stencil amplifies high frequencies)",
            lambda a, C, z: _pgn(a, C, z, True),
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"algorithm={name!r} is not one of {', '.join(RECIPES)}")
    return RECIPES[name]


#: Hyperparameter defaults that depend on ``model.name``, per recipe: for each ``algo``
#: key left null, a function of the model name (public config) giving its value.
MODEL_KIND_DEFAULTS: dict[str, dict[str, Callable[[str | None], float]]] = {
    "dp_fed_ls": {"sigma_ls": fed_ls_default_sigma},
}


def build_pipeline(
    name: str,
    algo,
    clip_norm: float,
    noise_multiplier: float,
    model_name: str | None = None,
    recipe: Any = None,
) -> Pipeline:
    """The pipeline of ``name`` with hyperparameters from ``algo`` (None → default).

    ``model_name`` (``model.name``) selects the defaults that depend on the model kind
    (:data:`MODEL_KIND_DEFAULTS`) for keys ``algo`` leaves null. ``name="custom"``
    composes the pieces named by ``recipe`` (engine.config.RecipeConfig; see
    :mod:`algorithms.compose`). Public config only."""
    if name == "custom":
        from algorithms.compose import build as build_composed

        if recipe is None:
            raise ValueError("algorithm=custom needs a recipe: section naming its pieces")
        return build_composed(recipe, algo, clip_norm, noise_multiplier, model_name)
    recipe = get_recipe(name)
    C = clip_norm if recipe.private else math.inf
    unset = {
        key: default(model_name)
        for key, default in MODEL_KIND_DEFAULTS.get(name, {}).items()
        if getattr(algo, key) is None
    }
    if unset:
        algo = dataclasses.replace(algo, **unset)
    return recipe.build(algo, C, noise_multiplier)


def resolved_hyperparameters(pipeline: Pipeline) -> dict[str, Any]:
    """Hyperparameters actually used, keyed by the last part of their config key."""
    out: dict[str, Any] = {}
    step = pipeline.step
    if isinstance(step, SAMStep):
        out.update(rho=step.rho, asam=step.asam)
    if isinstance(step, PGNStep):
        out.update(beta=step.beta, rho=step.rho)
    if pipeline.regularizer is not None:
        out["blur_lambda"] = pipeline.regularizer.lam
    for t in (*pipeline.client_transforms, *pipeline.server_transforms):
        if isinstance(t, LUS):
            out["sparsity"] = t.sparsity
        elif isinstance(t, (TopK, RandK, ServerTopK)):
            out["sparsity"] = t.fraction
            if isinstance(t, RandK):
                out["randk_rescale"] = t.rescale
        elif isinstance(t, LaplacianSmoothing):
            out.update(sigma_ls=t.sigma_ls, ls_scope=t.scope)
            out["ls_local"] = "project" if pipeline.constraint is not None else "clip_once"
    if pipeline.server_update is not None and pipeline.server_update.smoothing is not None:
        s = pipeline.server_update.smoothing
        out.update(sigma_ls=s.sigma_ls, ls_scope=s.scope)
    if pipeline.personal is not None:
        p = pipeline.personal
        out.update(personal_layers=p.layers, head_steps=p.head_steps, body_steps=p.body_steps)
    return out
