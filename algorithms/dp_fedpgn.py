"""DP-FedPGN and DP-FedPGN-LS (Liu, Tian, Shang, Liu, Liu, Zhou, Ding, "DP-FedPGN: Finding
Global Flat Minima for Differentially Private Federated Learning via Penalizing
Gradient Norm", arXiv:2510.27504, 2025), in one module: the local step, the public
drift it brings, the server's direction update and the two recipes (docs/algorithms.md
§7). The local step's arithmetic is :func:`algorithms.pieces.steps.pgn_gradients`.

**Local step** (:class:`PGNStep`, ``recipe.step: pgn``): β∇F(w + ρ g̃/‖g̃‖) + (1 − β) g̃,
with g̃ the server's previous direction. Every client runs exactly K local plain-SGD
steps (K = ``local.steps``, else the public constant of
``engine.simulation.preparation``), so the update carries the deterministic drift
(1 − β)·K·η·g̃.

**Drift** (:class:`PGNDriftRemoval`, :class:`PGNDriftRestore`): each client removes the
drift before clipping, Δ̄ = Δ + (1 − β)·K·η·g̃; the server adds it back to the noisy
mean. Only Δ̄ is clipped and noised.

**Server step** (:class:`PGNDirection`): g̃ ← −mean/(ηK), optionally Laplacian-smoothed
(DP-FedPGN-LS), and x ← x − γ g̃ with γ = ``server.lr``·η·K.

**Privacy.** The recipe is DP-FedAvg's Gaussian mechanism on the clipped Δ̄ (sensitivity
C per client, N(0, (zC)²) on the sum, the participation's subsampled Gaussian per
round): g̃, K, η, β and ρ are public (g̃ is post-processing of earlier releases; K and
η come from the config, never from the data), so the drift removed before clipping and
restored after the noise is public and changes no sensitivity, and the direction update
and smoothing are post-processing. The paper's "median clipping" (C from the client's
own norms) is not private and is replaced by the fixed C.

Torch-free at import (the config reads this module's declarations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from algorithms import piece_specs as keys
from algorithms.server_step import Aggregate, ServerStep, ServerStepPiece, StepContext
from algorithms.spec import Key, PieceSpec

if TYPE_CHECKING:
    import torch

HERE = "algorithms.dp_fedpgn"


@dataclass(frozen=True)
class PGNStep:
    """The local step with the public g̃ (module docstring)."""

    beta: float
    rho: float

    def __post_init__(self) -> None:
        BETA.check(self.beta)
        keys.RHO.check(self.rho)

    def gradients(self, params: list, closure: Any, public: dict[str, Any]) -> tuple[float, list]:
        from algorithms.pieces.steps import pgn_gradients

        return pgn_gradients(
            params, closure, beta=self.beta, rho=self.rho, g_tilde=public.get("g_tilde_list")
        )


@dataclass(frozen=True)
class PGNDriftRemoval:
    """Δ̄ = Δ + (1 − β)·K·η·g̃: remove the public, deterministic drift before clipping."""

    beta: float
    public_mask = False

    def __post_init__(self) -> None:
        BETA.check(self.beta)

    def apply(self, delta: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        g = ctx.get("g_tilde")
        if g is None:
            return delta
        return delta + (1.0 - self.beta) * ctx["steps"] * ctx["lr"] * g


@dataclass(frozen=True)
class PGNDriftRestore:
    """Add the drift back to the noisy mean: Δ = Δ̃ − (1 − β)·K·η·g̃ (post-processing)."""

    beta: float

    def __post_init__(self) -> None:
        BETA.check(self.beta)

    def apply(self, avg: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        g = ctx.get("g_tilde")
        if g is None:
            return avg
        return avg - (1.0 - self.beta) * ctx["steps"] * ctx["lr"] * g.double()


@dataclass(frozen=True)
class PGNDirection(ServerStepPiece):
    """g̃ ← −mean(Δ)/(ηK) (optionally smoothed); x ← x − γ g̃, γ = server.lr·η·K."""

    smoothing: Any = None  # algorithms.pipeline.LaplacianSmoothing (DP-FedPGN-LS)
    name: ClassVar[str] = "pgn_direction"

    def start(self, ctx: StepContext) -> ServerStep:
        return PGNDirectionUpdate(self.smoothing, ctx.server_lr, ctx.steps)

    def report(self) -> dict[str, Any]:
        s = self.smoothing
        return {} if s is None else {"sigma_ls": s.sigma_ls, "ls_scope": s.scope}


class PGNDirectionUpdate(ServerStep):
    """The run's direction g̃ (public: post-processing of the releases) and its step."""

    def __init__(self, smoothing: Any, server_lr: float, steps: int | None) -> None:
        self.smoothing = smoothing
        self.server_lr = float(server_lr)
        self.steps = steps
        self.g_tilde: torch.Tensor | None = None  # the previous noisy direction

    def public(self) -> dict[str, torch.Tensor | None]:
        return {"g_tilde": self.g_tilde}

    def update(self, rnd: int, weights: torch.Tensor, agg: Aggregate) -> torch.Tensor:
        avg = agg.release()  # the noisy mean, drift restored (PGNDriftRestore)
        k_lr = agg.context["lr"] * float(self.steps or 1)
        g_new = -avg / k_lr
        if self.smoothing is not None:
            g_new = self.smoothing.apply(g_new, agg.context)
        self.g_tilde = g_new.to(weights.dtype)
        return weights - (self.server_lr * k_lr * g_new).to(weights.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"g_tilde": None if self.g_tilde is None else self.g_tilde.numpy().copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np
        import torch

        g = state.get("g_tilde")
        self.g_tilde = None if g is None else torch.from_numpy(np.array(g, dtype=np.float32))


def companions(step: PGNStep, parts: dict[str, Any]) -> None:
    """What ``recipe.step: pgn`` brings (algorithms.compose): the drift removal first
    among the client transforms (they see Δ̄), its restoration first among the server
    transforms, the direction update (smoothing g̃ when the recipe names
    ``laplacian_smoothing``: DP-FedPGN-LS), exactly K plain-SGD local steps."""
    if parts["server_step"] is not None:
        raise ValueError(
            "recipe.server_step: step pgn brings its own server step (the direction update)"
        )
    smoothing = [t for t in parts["server_transforms"] if hasattr(t, "sigma_ls")]
    rest = [t for t in parts["server_transforms"] if t not in smoothing]
    parts["client_transforms"].insert(0, PGNDriftRemoval(step.beta))
    parts["server_transforms"] = [PGNDriftRestore(step.beta), *rest]
    parts["server_step"] = PGNDirection(smoothing[0] if smoothing else None)
    parts.update(fixed_steps=True, plain_sgd=True)


BETA = Key(
    "beta",
    float | None,
    None,
    "PGN gradient mixing weight in [0, 1] (null: recipe default)",
    lambda v: 0 <= v <= 1,
    "must be in [0, 1]",
)
#: the registry's line (algorithms.registry)
SPECS = (
    PieceSpec(
        "pgn",
        "step",
        f"{HERE}:PGNStep",
        lambda cls, a, ctx: cls(beta=keys.pick(a.beta, 0.3), rho=keys.pick(a.rho, 0.2)),
        keys=(BETA, keys.RHO),
        space={
            "algo.beta": {"type": "uniform", "low": 0.1, "high": 1.0},
            "algo.rho": {"type": "uniform", "low": 0.0, "high": 0.5},
        },
        report=lambda s, p: {"beta": s.beta, "rho": s.rho},
        extend=companions,
    ),
)
_DEPARTURE = (
    "fixed clip norm C: the paper's \"median clipping\" sets C from the client's own "
    "norms, which is not private; every client runs exactly K local steps (plain "
    "SGD) so the public drift is removed and restored exactly"
)
#: the recipes (algorithms.recipes: the README's rows)
RECIPES: tuple[dict[str, Any], ...] = (
    dict(
        name="dp_fedpgn",
        hyperparameters=("beta", "rho"),
        spelling={"step": "pgn"},
        method="DP-FedPGN (Liu et al. 2025)",
        shares="PGN pieces with `dp_fedpgn_ls`",
        hyperparameter_doc="`beta` (0.3), `rho` (0.2)",
        departure=_DEPARTURE,
    ),
    dict(
        name="dp_fedpgn_ls",
        hyperparameters=("beta", "rho", "sigma_ls", "ls_scope"),
        spelling={"step": "pgn", "server_transforms": ("laplacian_smoothing",)},
        method="DP-FedPGN-LS (Liu et al. 2025)",
        shares="`dp_fedpgn` + smoothing of g̃",
        hyperparameter_doc="`beta`, `rho`, `sigma_ls` (0.01), `ls_scope`",
        departure=(
            "as `dp_fedpgn`; smoothing by the FFT operator (the reference stencil amplifies "
            "high frequencies)"
        ),
        own_space={"algo.sigma_ls": {"type": "loguniform", "low": 0.001, "high": 1.0}},
    ),
)
