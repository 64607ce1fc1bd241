"""Pieces as frozen dataclasses, and the :class:`Pipeline` a recipe assembles.

The engine, not the recipe, fixes the order in which pieces act (see
``engine.federated.client`` and ``engine.federated.server``)::

    local steps (step rule + regularizer + constraint) → Δ → client transforms
    → clip to C → sum → noise σC on the noise support → ÷ public denominator
    → server transforms → server step → accountant composes the round's event

(a server step made for correlated noise takes the sum and the round's draw through its
noise scheme's own release instead: algorithms.server_step).

so no recipe can clip after noising, and the σ that is accounted is the σ used.

Privacy guard (docs/algorithms.md §0 rule 4): noise always covers every released
coordinate unless the only mask restricting it is *public* (drawn from the run's
seed, identical for all clients: rand-k). A pipeline whose noise support would be
decided by a data-dependent mask (top-k, LUS) is rejected at construction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from algorithms import piece_specs as keys
from algorithms.dp_fedpgn import PGNStep  # noqa: F401 - the vectorised trainer's name
from algorithms.pieces.regularizers import blur_loss
from algorithms.pieces.smoothing import smooth_flat
from algorithms.pieces.sparsify import apply_mask, keep_topk, lus_sparsify, randk_mask
from algorithms.pieces.steps import gradients, sam_gradients
from algorithms.server_step import FedAvgStep
from engine.privacy.mechanism import GaussianMechanism
from engine.privacy.noise import GAUSSIAN

Grads = list[torch.Tensor]


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    """A piece's check of a field that is not an ``algo.*`` key: ValueError naming the
    config key and its value. An ``algo.*`` field is checked by its key's declaration
    (:mod:`algorithms.piece_specs`), the rule the config applies too."""
    if not ok:
        raise ValueError(f"{key}={value!r} {rule}")


# ----------------------------------------------------------------------- step rules


@dataclass(frozen=True)
class SGDStep:
    """One plain gradient (the base optimizer applies it)."""

    def gradients(self, params: Grads, closure, public: dict[str, Any]) -> tuple[float, Grads]:
        return gradients(params, closure)


@dataclass(frozen=True)
class SAMStep:
    """Sharpness-aware step: gradient at w + e, e = ρ g/‖g‖ (or the ASAM ball)."""

    rho: float
    asam: bool

    def __post_init__(self) -> None:
        keys.RHO.check(self.rho)

    def gradients(self, params: Grads, closure, public: dict[str, Any]) -> tuple[float, Grads]:
        return sam_gradients(params, closure, self.rho, self.asam)


# ------------------------------------------------------- regularizer and constraint


@dataclass(frozen=True)
class BLUR:
    """(λ/2)·max(0, ‖w − x^t‖² − C²) added to the local loss (reaches autograd)."""

    lam: float
    clip_norm: float

    def __post_init__(self) -> None:
        keys.BLUR_LAMBDA.check(self.lam)
        _require(self.clip_norm > 0, "privacy.clip_norm", self.clip_norm, "must be > 0")

    def loss(self, params: Grads, anchor: Grads) -> torch.Tensor:
        return blur_loss(params, anchor, self.lam, self.clip_norm)


@dataclass(frozen=True)
class BallProjection:
    """DP-Fed-LS: after every local step project w onto the ball ‖w − x^t‖ ≤ radius."""

    radius: float

    def __post_init__(self) -> None:
        _require(
            self.radius > 0, "privacy.clip_norm (the ball's radius)", self.radius, "must be > 0"
        )

    @torch.no_grad()
    def project_(self, params: Grads, anchor: Grads) -> None:
        """One client: ‖w − x^t‖ in float64; outside the ball, w is scaled back onto
        it (just inside, by the factor 1 − 1e-7, so rounding never leaves it)."""
        sq = sum(float(((p.double() - a.double()) ** 2).sum()) for p, a in zip(params, anchor))
        norm = sq**0.5
        if norm > self.radius:
            scale = self.radius / norm * (1.0 - 1e-7)
            for p, a in zip(params, anchor):
                p.copy_(a + (p - a) * scale)

    @torch.no_grad()
    def project_rows_(self, params: Grads, anchor: Grads) -> None:
        """:meth:`project_` for a group of clients (the vectorised trainer): each
        tensor of ``params`` stacks the clients along its first axis, ``anchor`` is
        shared; each client's row is projected on its own, with the same rule."""
        radius = float(self.radius)
        g = params[0].shape[0]
        sq = torch.zeros(g, dtype=torch.float64, device=anchor[0].device)
        for p, a in zip(params, anchor):
            sq += ((p.double() - a.double()) ** 2).reshape(g, -1).sum(1)
        norm = sq**0.5
        rows = torch.nonzero(norm > radius).flatten()
        if rows.numel() == 0:
            return
        scale = (radius / norm[rows] * (1.0 - 1e-7)).to(params[0].dtype)
        for p, a in zip(params, anchor):
            view = (rows.numel(),) + (1,) * (p.dim() - 1)
            p[rows] = a + (p[rows] - a) * scale.view(view)


# ------------------------------------------------- client transforms (before clip)


@dataclass(frozen=True)
class TopK:
    """Per-client top-k of |Δ| before clipping (data-dependent: noise stays on all d)."""

    fraction: float
    public_mask = False

    def __post_init__(self) -> None:
        keys.KEEP_FRACTION.check(self.fraction)

    def apply(self, delta: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return keep_topk(delta, self.fraction)


@dataclass(frozen=True)
class RandK:
    """Fed-SMP rand-k: keep the round's public random mask (same for all clients)."""

    fraction: float
    rescale: bool = False
    public_mask = True

    def __post_init__(self) -> None:
        keys.KEEP_FRACTION.check(self.fraction)

    def mask(self, d: int, generator: torch.Generator) -> torch.Tensor:
        return randk_mask(d, self.fraction, generator)

    def apply(self, delta: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return apply_mask(delta, ctx["randk_mask"], rescale=self.rescale)


@dataclass(frozen=True)
class LUS:
    """Zero the fraction ``zero_fraction`` (c) of Δ least important by |∂f/∂w · Δ|
    (before clip)."""

    zero_fraction: float
    public_mask = False

    def __post_init__(self) -> None:
        keys.ZERO_FRACTION.check(self.zero_fraction)

    def apply(self, delta: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return lus_sparsify(delta, ctx["local_gradient"](), self.zero_fraction)


# ------------------------------------------------------------------- privatizer


@dataclass(frozen=True)
class GaussianPrivatizer:
    """Clip each update to C; add N(0, (zC)²) to the sum on the noise support.

    ``site="server"`` draws the noise once centrally; ``site="client"`` has each of
    the m (fixed) clients add N(0, (zC)²/m), which gives the same distribution of
    the sum. ``noise_support`` is ``"all"`` or ``"public_mask"`` (rand-k only).
    ``noise`` is the noise scheme (engine.privacy.noise: independent, or correlated
    across rounds), which refuses the settings it cannot noise. Clipping, the noise
    std, its randomness, C_t and the DpEvent are the :attr:`mechanism`'s
    (:class:`engine.privacy.mechanism.GaussianMechanism`).
    """

    clip_norm: float
    noise_multiplier: float
    site: str = "server"
    noise_support: str = "all"
    #: engine.privacy.adaptive_clip.AdaptiveClipSpec under privacy.clip_mode=adaptive:
    #: ``clip_norm`` is then C_0 and the accounted z splits between the update sum
    #: (z_Δ, :attr:`update_noise_multiplier`) and the clipped-count release.
    adaptive: Any = None
    #: what a round's draw is and costs (engine.privacy.noise.NoiseScheme)
    noise: Any = GAUSSIAN
    #: the template mechanism of (C_0, z, site, adaptive); server and workers bind copies
    mechanism: GaussianMechanism = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.noise.check(self)
        mechanism = GaussianMechanism(
            self.clip_norm,
            self.noise_multiplier,
            self.site,
            scheme=self.noise,
            adaptive=self.adaptive,
        )
        object.__setattr__(self, "mechanism", mechanism)

    @property
    def update_noise_multiplier(self) -> float:
        """The z that sizes the noise on the update sum: z_Δ under adaptive clipping
        (the clipped-count release spends the rest of the budget), else z itself."""
        return self.mechanism.update_noise_multiplier

    def dp_event(self, sampling):
        """The DpEvent the tracker composes under ``sampling`` (a Participation): for
        independent noise one round, whose clipped sum has sensitivity C (add/remove;
        2C under replace-one, which the event accounts for), a sampled Gaussian with z."""
        return self.mechanism.dp_event(sampling)


# ------------------------------------------------------------ server transforms


@dataclass(frozen=True)
class LaplacianSmoothing:
    """ṽ = (I + σ_ls L)⁻¹ v per tensor (or whole model) by FFT; post-processing."""

    sigma_ls: float
    scope: str = "tensor"

    def __post_init__(self) -> None:
        keys.SIGMA_LS.check(self.sigma_ls)
        keys.LS_SCOPE.check(self.scope)

    def apply(self, avg: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return smooth_flat(avg, ctx["shapes"], self.sigma_ls, self.scope)


@dataclass(frozen=True)
class ServerTopK:
    """Keep the p·d largest coordinates of the noisy aggregate (post-processing)."""

    fraction: float

    def __post_init__(self) -> None:
        keys.KEEP_FRACTION.check(self.fraction)

    def apply(self, avg: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return keep_topk(avg, self.fraction)


# --------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class PersonalSplit:
    """DP²-FedSAM: the last ``layers`` Linear modules are a personal head that stays
    on its client; ``head_steps`` SGD steps on the head, then ``body_steps`` steps of
    the step rule on the shared body. Only the body's update is clipped and noised."""

    layers: int = 1
    head_steps: int | None = None
    body_steps: int | None = None

    def __post_init__(self) -> None:
        keys.PERSONAL_LAYERS.check(self.layers)
        keys.HEAD_STEPS.check(self.head_steps)
        keys.BODY_STEPS.check(self.body_steps)


@dataclass(frozen=True)
class Pipeline:
    """The pieces of one method. The engine applies them in its fixed order."""

    step: Any = field(default_factory=SGDStep)
    regularizer: BLUR | None = None
    constraint: BallProjection | None = None
    client_transforms: tuple[Any, ...] = ()
    privatizer: GaussianPrivatizer | None = None
    server_transforms: tuple[Any, ...] = ()
    #: how the aggregate moves the model (algorithms.server_step)
    server_step: Any = field(default_factory=FedAvgStep)
    personal: PersonalSplit | None = None
    fixed_steps: bool = False  # every client runs exactly K local steps (K public)
    plain_sgd: bool = False  # ignore momentum/weight decay (a public drift assumes plain steps)

    def __post_init__(self) -> None:
        p = self.privatizer
        step, scheme = self.server_step, (p.noise if p is not None else None)
        if step.noise is not None:  # it steps on its correlated noise's own release
            if scheme is None or scheme.name != step.noise:
                raise ValueError(
                    f"invalid recipe: server step {step.name} steps on {step.noise} noise's "
                    f"release and needs recipe.noise={step.noise}"
                )
            for key, present in (
                ("server transforms", bool(self.server_transforms)),
                ("personal heads", self.personal is not None),
            ):
                if present:
                    raise ValueError(
                        f"invalid recipe: server step {step.name} steps on its correlated "
                        f"noise's own release and takes no {key}"
                    )
        if scheme is not None and scheme.server_step not in (None, step.name):
            raise ValueError(
                f"invalid recipe: {scheme.name} noise is accounted for the release of server "
                f"step {scheme.server_step}; recipe.server_step must be {scheme.server_step}"
            )
        if p is None:
            return
        if p.noise_support not in ("all", "public_mask"):
            raise ValueError(f"noise_support={p.noise_support!r} must be all or public_mask")
        if p.noise_support == "public_mask":
            masks = [t for t in self.client_transforms if isinstance(t, (RandK, TopK, LUS))]
            if not masks or not all(t.public_mask for t in masks):
                raise ValueError(
                    "invalid recipe: noise restricted to a mask that is not public; a "
                    "data-dependent mask (top-k, LUS) deciding where noise is added would "
                    "reveal the mask's support. Add noise on all coordinates, or use a "
                    "public rand-k mask."
                )

    @property
    def private(self) -> bool:
        return self.privatizer is not None

    @property
    def clip_norm(self) -> float:
        """C (C_0 under adaptive clipping); ``inf`` for a non-private recipe."""
        return self.privatizer.mechanism.clip_norm if self.privatizer is not None else math.inf

    def with_adaptive(self, adaptive: Any) -> Pipeline:
        """This pipeline with adaptive clipping's parameters on its privatizer (one
        object then holds C_0, the accounted z and the update's z_Δ)."""
        if adaptive is None:
            return self
        if self.privatizer is None:
            raise ValueError("adaptive clipping needs a private recipe")
        return dataclasses.replace(
            self, privatizer=dataclasses.replace(self.privatizer, adaptive=adaptive)
        )

    def noise_support(
        self, head_mask: torch.Tensor | None, randk_mask: Callable[[], torch.Tensor]
    ) -> torch.Tensor | None:
        """Where noise goes (float64 0/1, or ``None`` for every coordinate): every
        released coordinate, i.e. not the personal heads (``head_mask``), and under
        ``noise_support="public_mask"`` only the round's public rand-k mask (from
        ``randk_mask()``, called only then). The one rule both noise sites use."""
        support = None
        if head_mask is not None:
            support = (~head_mask).double()
        if self.privatizer is not None and self.privatizer.noise_support == "public_mask":
            mask = randk_mask().double()
            support = mask if support is None else support * mask
        return support

    @property
    def randk(self) -> RandK | None:
        for t in self.client_transforms:
            if isinstance(t, RandK):
                return t
        return None
