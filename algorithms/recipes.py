"""One recipe per method: a few lines naming its pieces (ALGORITHMS.md).

``build_pipeline(name, algo, clip_norm, noise_multiplier, ...)`` returns the
:class:`~algorithms.pipeline.Pipeline` and the resolved hyperparameters (recorded as
columns of ``rounds.parquet``). Defaults are the papers' (ALGORITHMS.md); where a
published recipe is not private as written, the private form is built and the
``departure`` text says what differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from algorithms.pipeline import (
    BLUR,
    LUS,
    BallProjection,
    GaussianPrivatizer,
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


def _sam(a) -> SAMStep:
    asam = True if a.asam is None else a.asam
    rho = a.rho if a.rho is not None else (0.5 if asam else 0.05)
    return SAMStep(rho=rho, asam=asam)


def _priv(C: float, z: float, a, support: str = "all") -> GaussianPrivatizer:
    return GaussianPrivatizer(C, z, site=a.noise_site, noise_support=support)


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


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
    return Pipeline(
        constraint=BallProjection(C),
        privatizer=_priv(C, z, a),
        server_transforms=(LaplacianSmoothing(_pick(a.sigma_ls, 1.0), a.ls_scope),),
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


_SAM_HP = ("rho", "asam")
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "fedavg",
            "FedAvg: local SGD, server averages the updates",
            "McMahan et al., AISTATS 2017",
            False,
            (),
            "baseline",
            "none",
            _fedavg,
        ),
        Recipe(
            "fedsam",
            "FedSAM: FedAvg with SAM/ASAM local steps (not private)",
            "Qu et al., ICML 2022",
            False,
            _SAM_HP,
            "SAM step of dp_fedsam",
            "none",
            _fedsam,
        ),
        Recipe(
            "dp_fedavg",
            "DP-FedAvg: whole-update clip, central Gaussian noise",
            "McMahan et al., ICLR 2018",
            True,
            (),
            "privatizer of every private recipe",
            "none",
            _dp_fedavg,
        ),
        Recipe(
            "dp_fedavg_blur",
            "DP-FedAvg + BLUR: penalise local updates longer than C",
            "Cheng et al., CVPR 2022",
            True,
            ("blur_lambda",),
            "dp_fedavg + BLUR",
            "none",
            _blur,
        ),
        Recipe(
            "dp_fedavg_blur_lus",
            "DP-FedAvg + BLUR + LUS: zero unimportant coordinates",
            "Cheng et al., CVPR 2022",
            True,
            ("blur_lambda", "sparsity"),
            "dp_fedavg_blur + LUS",
            "noise on all d coordinates (LUS mask is private)",
            _blur_lus,
        ),
        Recipe(
            "fedsmp_randk",
            "Fed-SMP rand-k: public random mask, noise on k coords",
            "Hu, Gong, Guo 2022",
            True,
            ("sparsity", "randk_rescale"),
            "dp_fedavg + public rand-k",
            "none",
            _smp_randk,
        ),
        Recipe(
            "fedsmp_topk",
            "Fed-SMP top-k: local top-k before clipping",
            "Hu, Gong, Guo 2022",
            True,
            ("sparsity",),
            "dp_fedavg + TopK",
            "noise on all d coordinates (top-k support is private)",
            _smp_topk,
        ),
        Recipe(
            "dp_fed_ls",
            "DP-Fed-LS: ball-projected local SGD, Laplacian-smoothed aggregate",
            "Liang et al. (seed 002)",
            True,
            ("sigma_ls", "ls_scope"),
            "LaplacianSmoothing with dp_fedpgn_ls",
            "none",
            _fed_ls,
        ),
        Recipe(
            "dp_fedsam",
            "DP-FedSAM: SAM/ASAM local steps, whole-update clip + noise",
            "Shi et al., CVPR 2023",
            True,
            _SAM_HP,
            "SAM step with fedsam, dp2_fedsam",
            "whole-update clipping (reference code clips per tensor with noise for C)",
            _dp_fedsam,
        ),
        Recipe(
            "dp_fedsam_topk",
            "DP-FedSAM-top_k: top-k of the noisy aggregate",
            "Shi et al., CVPR 2023",
            True,
            (*_SAM_HP, "sparsity", "topk_site"),
            "dp_fedsam + ServerTopK",
            "top-k on the noisy aggregate (paper: per client after noise)",
            _dp_fedsam_topk,
        ),
        Recipe(
            "dp2_fedsam",
            "DP²-FedSAM: personal heads stay local, SAM on the shared body",
            "seed 001",
            True,
            (*_SAM_HP, "head_steps", "body_steps", "personal_layers"),
            "SAM step of dp_fedsam + PersonalSplit",
            "none",
            _dp2_fedsam,
        ),
        Recipe(
            "dp_fedpgn",
            "DP-FedPGN: global-gradient-aware perturbation and mixing",
            "Liu et al. (seed 003)",
            True,
            ("beta", "rho"),
            "PGN pieces with dp_fedpgn_ls",
            "fixed C (paper's median clipping is not private)",
            lambda a, C, z: _pgn(a, C, z, False),
        ),
        Recipe(
            "dp_fedpgn_ls",
            "DP-FedPGN-LS: DP-FedPGN with a smoothed direction g̃",
            "Liu et al. (seed 003)",
            True,
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


def build_pipeline(name: str, algo, clip_norm: float, noise_multiplier: float) -> Pipeline:
    """The pipeline of ``name`` with hyperparameters from ``algo`` (None → default)."""
    recipe = get_recipe(name)
    C = clip_norm if recipe.private else math.inf
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
    if pipeline.server_update is not None and pipeline.server_update.smoothing is not None:
        s = pipeline.server_update.smoothing
        out.update(sigma_ls=s.sigma_ls, ls_scope=s.scope)
    if pipeline.personal is not None:
        p = pipeline.personal
        out.update(personal_layers=p.layers, head_steps=p.head_steps, body_steps=p.body_steps)
    return out
