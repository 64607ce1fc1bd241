"""Piece defaults used by :func:`algorithms.compose.build`, which builds the pieces of
every recipe (built-in ones through their spellings in :mod:`algorithms.recipes`)."""

from __future__ import annotations

from typing import Any

from algorithms.pipeline import GaussianPrivatizer, SAMStep


def sam_step(a) -> SAMStep:
    asam = True if a.asam is None else a.asam
    rho = a.rho if a.rho is not None else (0.5 if asam else 0.05)
    return SAMStep(rho=rho, asam=asam)


def privatizer(C: float, z: float, a, support: str = "all") -> GaussianPrivatizer:
    return GaussianPrivatizer(C, z, site=a.noise_site, noise_support=support)


def pick(value: Any, default: Any) -> Any:
    return default if value is None else value


#: DP-Fed-LS's σ_ls when ``algo.sigma_ls`` is null, by ``model.name``. The paper smooths
#: logistic-regression and CNN weights, whose storage order runs over image pixels, so
#: that neighbouring coordinates are related, with σ_ls = 1. It gives no value for other
#: models; an MLP on tabular features (the default synthetic data) has coordinates in no
#: meaningful order, and σ_ls = 1 there removes as much signal as noise. For every model
#: the paper does not cover dpfl uses FED_LS_SIGMA_OTHER, measured on the default data
#: (docs/algorithms.md §4, "σ_ls by model kind").
FED_LS_SIGMA_BY_MODEL: dict[str, float] = {"logreg": 1.0, "cnn": 1.0}
FED_LS_SIGMA_OTHER = 0.01


def fed_ls_default_sigma(model_name: str | None) -> float:
    """DP-Fed-LS's default σ_ls for ``model_name`` (None: the paper's 1.0)."""
    if model_name is None:
        return 1.0
    return FED_LS_SIGMA_BY_MODEL.get(model_name, FED_LS_SIGMA_OTHER)
