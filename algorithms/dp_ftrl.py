"""DP-FTRL (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep)
Learning without Sampling or Shuffling", ICML 2021, arXiv:2103.00039), in one module:
its participation, its noise scheme, its server step and its recipe (docs/algorithms.md
§11). The tree's arithmetic is :mod:`engine.privacy.tree_aggregation`'s.

**Participation** (:class:`EpochPasses`, ``sampling=epoch_passes``). No sampling: every
epoch the N clients are permuted from the seed and cut into R = ⌊N/m⌋ disjoint cohorts
of m (the N − R·m left over sit the epoch out), one per round. So a client is in at
most one round of an epoch. The argument uses only that, not the permutation's
randomness (any data-independent order is covered).

**Noise** (:class:`TreeAggregation`, ``recipe.noise: tree``). Clients clip Δ to C; the
server keeps the epoch's prefix sum X_t = Σ_{i ≤ t} x_i of the clipped sums and releases
X̃_t = X_t + the online tree estimator's noise: one binary tree per epoch, node (k, j)
covering rounds [j·2^k + 1, (j + 1)·2^k] with its own N(0, (zC)² I); after round t the
nodes of the dyadic decomposition of [1, t]. Each round's fresh draw (the round's
stream, as every recipe's) is the node of level v₂(t) ending at t.

**Privacy.** Under replace-special adjacency (a client's clipped update replaced by
zero) each node has sensitivity C and a client's leaf lies in at most
D(R) = ⌈log₂(R + 1)⌉ nodes of its epoch's tree, so an epoch is a Gaussian mechanism of
sensitivity √D·C and noise zC: dp-accounting's ``SingleEpochTreeAggregationDpEvent(z,
R)`` (RDP α·D/(2z²)). Epochs compose (a client is in every epoch's tree); a partial last
epoch of r rounds is the same event with r steps. Everything released — X̃_t, the model,
the rows — is computed from nodes only (post-processing). The tree's nodes are
server-internal state kept in checkpoints, so release mode (``privacy.secure_noise``)
is refused, and so are what the event does not cover: client-side noise, a noise
support short of all d coordinates, adaptive clipping, any other participation.

**Server step** (:class:`FTRLStep`, ``recipe.server_step: ftrl``; its arithmetic is
:class:`algorithms.pieces.correlated_noise.TreeFTRL`'s): DP-FTRL with momentum
(DP-FTRLM) on the noisy prefix sums, M_t = γ·M_{t−1} + X̃_t / m and
x^{t+1} = x^{(e)} + η_s·M_t, x^{(e)} the model when epoch e began (Δ points downhill,
so + replaces the paper's −). Tree, prefix sum and momentum restart every epoch (the
paper's Appendix D). With γ = 0 and no noise: FedAvg's x^{t+1} = x^t + η_s·x_t/m.

Torch-free at import (the config reads this module's declarations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from algorithms.pieces.correlated_noise import FTRL_MOMENTUM, TreeFTRL
from algorithms.server_step import ServerStep, ServerStepPiece, StepContext
from algorithms.spec import Key, PieceSpec
from engine.privacy import tree_aggregation as tree
from engine.privacy.noise import NoiseScheme, check_correlated
from engine.privacy.participation import CohortLaw, Participation, tested_draw

if TYPE_CHECKING:
    import dp_accounting

HERE = "algorithms.dp_ftrl"


@dataclass(frozen=True)
class EpochPasses(Participation):
    """Passes over the population in R = ⌊N/m⌋ disjoint cohorts of m (module docstring)."""

    num_clients: int
    cohort_size: int
    mode: ClassVar[str] = "epochs"
    row_names: ClassVar[tuple[str, ...]] = (tree.PARTICIPATION_NAME,)
    adjacency: ClassVar[str] = tree.ADJACENCY
    accountants: ClassVar[tuple[str, ...]] = ("rdp",)
    secure_ok: ClassVar[bool] = False

    def __post_init__(self) -> None:
        tree.rounds_per_epoch(self.num_clients, self.cohort_size)  # checks m in [1, N]

    @property
    def name(self) -> str:
        return tree.PARTICIPATION_NAME

    def check_accountant(self, accountant: str) -> None:
        if accountant != "rdp":
            raise ValueError(
                f"privacy.accountant={accountant!r}: tree aggregation (epoch participation) "
                "is accounted by the RDP accountant only"
            )

    @property
    def denominator(self) -> float:
        return float(self.cohort_size)

    @property
    def rounds_per_epoch(self) -> int:
        return tree.rounds_per_epoch(self.num_clients, self.cohort_size)

    def columns(self) -> dict[str, Any]:
        return {"rounds_per_epoch": self.rounds_per_epoch}

    def law(self) -> CohortLaw:
        return CohortLaw(float(self.cohort_size), 0.0, self.cohort_size / self.num_clients, None)

    @tested_draw
    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        assert not secure  # refused by the plan (secure_ok)
        return tree.epoch_cohort(seed, rnd, self.num_clients, self.cohort_size)


def epoch_passes(cls: type, algo: Any, ctx: Any) -> EpochPasses:
    """The run's passes: cohorts of ``sampling.cohort_size`` (mode fixed) or round(q·N)."""
    s, n = ctx.sampling, ctx.num_clients
    if s.max_cohort is not None:
        raise ValueError(
            f"sampling.max_cohort={s.max_cohort}: epoch passes take cohorts of one fixed "
            "size (set sampling.cohort_size with sampling.mode=fixed, or sampling.rate)"
        )
    m = s.cohort_size if s.mode == "fixed" else max(1, round(s.rate * n))
    return EpochPasses(n, min(m, n))


@dataclass(frozen=True)
class TreeAggregation(NoiseScheme):
    """Tree-aggregated noise on the epoch's prefix sums (module docstring)."""

    name: ClassVar[str] = "tree"
    linear: ClassVar[bool] = False
    secure_ok: ClassVar[bool] = False
    server_step: ClassVar[str | None] = "ftrl"
    audit_statistic: ClassVar[str | None] = "whitened_tree_nodes"

    def accepts(self, sampling: Participation) -> None:
        if not isinstance(sampling.statement, EpochPasses):
            raise ValueError(
                f"tree aggregation needs epoch participation, not {sampling.name} sampling"
            )

    def check(self, privatizer: Any) -> None:
        check_correlated(privatizer)

    def unit_event(self, z: float, sampling: Participation) -> dp_accounting.DpEvent:
        """One epoch's tree: ``SingleEpochTreeAggregationDpEvent(z, R)``."""
        self.accepts(sampling)
        return tree.epoch_event(z, sampling.rounds_per_epoch)  # type: ignore[attr-defined]

    def run_event(self, z: float, sampling: Participation, rounds: int) -> dp_accounting.DpEvent:
        """The trees of the epochs run, the last one partial."""
        per_epoch = sampling.rounds_per_epoch  # type: ignore[attr-defined]
        return tree.rounds_event(self.unit_event(z, sampling), per_epoch, rounds)

    def audit_model(self, sampling: Participation, step: Any, rounds: int) -> Any:
        """The canary audit's view of the tree: canaries at leaf 1 of every epoch (the
        accountant's worst case), W's row t the node ending at t, the accounted
        sensitivity after t rounds, and the inversion of DP-FTRLM's public step."""
        import math

        from engine.privacy.audit_correlated import AuditModel

        per_epoch = sampling.rounds_per_epoch  # type: ignore[attr-defined]
        return AuditModel(
            period=per_epoch,
            w=tree.tree_observation(rounds, per_epoch),
            sensitivity=lambda t: math.sqrt(tree.tree_sensitivity_sq(t, per_epoch)),
            decode=lambda q: tree.decode_tree(q, per_epoch, step.momentum),
        )


EpochPasses.default_noise = TreeAggregation()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FTRLStep(ServerStepPiece):
    """DP-FTRLM's server step with momentum γ (module docstring)."""

    momentum: float = FTRL_MOMENTUM
    name: ClassVar[str] = "ftrl"
    noise: ClassVar[str | None] = "tree"

    def __post_init__(self) -> None:
        SERVER_MOMENTUM.check(self.momentum)

    def start(self, ctx: StepContext) -> ServerStep:
        rounds = ctx.sampling.rounds_per_epoch  # type: ignore[attr-defined]
        step = TreeFTRL(self, rounds, ctx.sampling.denominator, ctx.server_lr)
        return cast(ServerStep, step)  # a ServerStep by its methods


SERVER_MOMENTUM = Key(
    "server_momentum",
    float | None,
    None,
    "DP-FTRL, DP-BandMF: momentum of the server step (null: 0.9)",
    lambda v: 0 <= v < 1,
    "must be in [0, 1)",
)
#: the registry's lines (algorithms.registry)


def momentum_step_spec(name: str, path: str) -> PieceSpec:
    """The server step of a correlated-noise method with server momentum
    (``algo.server_momentum``, default :data:`FTRL_MOMENTUM`): DP-FTRL's and DP-BandMF's."""
    return PieceSpec(
        name,
        "server_step",
        path,
        lambda cls, a, ctx: cls(FTRL_MOMENTUM if a.server_momentum is None else a.server_momentum),
        keys=(SERVER_MOMENTUM,),
        space={"algo.server_momentum": {"type": "choice", "values": [0.0, 0.5, 0.9]}},
        report=lambda s, p: {"server_momentum": s.momentum},
    )


SPECS = (
    PieceSpec("epoch_passes", "participation", f"{HERE}:EpochPasses", epoch_passes),
    PieceSpec("tree", "noise", f"{HERE}:TreeAggregation", lambda cls, a, ctx: cls()),
    momentum_step_spec("ftrl", f"{HERE}:FTRLStep"),
)
#: the recipe (algorithms.recipes: the README's row)
RECIPE: dict[str, Any] = dict(
    name="dp_ftrl",
    hyperparameters=("server_momentum",),
    spelling={"participation": "epoch_passes", "noise": "tree", "server_step": "ftrl"},
    method="DP-FTRL (Kairouz et al., ICML 2021)",
    shares="clipping of `dp_fedavg`; its own noise and server step",
    hyperparameter_doc=(
        "`server_momentum` (0.9); cohorts of `sampling.cohort_size` (or q·N) in "
        "passes over the population"
    ),
    departure=(
        "online tree estimator (not the honest one); the tree, prefix sum and momentum "
        "restart every epoch; clients send model deltas, so x = x_epoch + η·M"
    ),
    own_space={"server.lr": {"type": "loguniform", "low": 0.03, "high": 3.0}},
)
