"""The ``algo:`` section: the recipes' hyperparameters (``None``: the recipe's default)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import check as _check


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """Recipe hyperparameters; ``None`` means the recipe's (paper's) default."""

    rho: float | None = None
    asam: bool | None = None
    beta: float | None = None
    sigma_ls: float | None = None
    ls_scope: str = "tensor"
    ls_local: str = "project"  # DP-Fed-LS local bounding: project (paper) or clip_once
    keep_fraction: float | None = None  # top-k, rand-k, server top-k: kept fraction p
    zero_fraction: float | None = None  # LUS: zeroed fraction c
    topk_site: str = "server"
    randk_rescale: bool = False
    blur_lambda: float | None = None
    server_momentum: float | None = None  # DP-FTRL: momentum γ on noisy prefix sums
    bands: int | None = None  # DP-BandMF: bands b of the strategy (b-min-separation)
    head_steps: int | None = None
    body_steps: int | None = None
    personal_layers: int = 1
    noise_site: str = "server"
    client_state: str = "memory"

    def __post_init__(self) -> None:
        for key in ("rho", "sigma_ls", "blur_lambda"):
            v = getattr(self, key)
            _check(v is None or v >= 0, f"algo.{key}", v, "must be >= 0")
        _check(
            self.beta is None or 0 <= self.beta <= 1, "algo.beta", self.beta, "must be in [0, 1]"
        )
        _check(
            self.keep_fraction is None or 0 < self.keep_fraction <= 1,
            "algo.keep_fraction",
            self.keep_fraction,
            "(kept fraction) must be in (0, 1]",
        )
        _check(
            self.zero_fraction is None or 0 <= self.zero_fraction < 1,
            "algo.zero_fraction",
            self.zero_fraction,
            "(zeroed fraction) must be in [0, 1)",
        )
        _check(
            self.ls_scope in ("tensor", "model", "weights"),
            "algo.ls_scope",
            self.ls_scope,
            "must be tensor, model or weights",
        )
        _check(
            self.ls_local in ("project", "clip_once"),
            "algo.ls_local",
            self.ls_local,
            "must be project (per-step ball projection) or clip_once",
        )
        _check(
            self.topk_site in ("server", "client"),
            "algo.topk_site",
            self.topk_site,
            "must be server (top-k of the noisy aggregate) or client (before clipping)",
        )
        for key in ("head_steps", "body_steps"):
            v = getattr(self, key)
            _check(v is None or v >= 1, f"algo.{key}", v, "must be >= 1")
        m = self.server_momentum
        _check(m is None or 0 <= m < 1, "algo.server_momentum", m, "must be in [0, 1)")
        _check(self.bands is None or self.bands >= 1, "algo.bands", self.bands, "must be >= 1")
        _check(
            self.personal_layers >= 1, "algo.personal_layers", self.personal_layers, "must be >= 1"
        )
        _check(
            self.noise_site in ("server", "client"),
            "algo.noise_site",
            self.noise_site,
            "must be server or client",
        )
        _check(
            self.client_state in ("memory", "disk"),
            "algo.client_state",
            self.client_state,
            "must be memory or disk",
        )
