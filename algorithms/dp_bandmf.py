"""DP-BandMF: banded matrix factorization (Choquette-Choo, Ganesh, McKenna, McMahan, Rush,
Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified approach to private
training", NeurIPS 2023, arXiv:2306.08153), in one module: its participation, its noise
scheme, its server step and its recipe (docs/algorithms.md §12). The strategy's
optimisation, its sensitivity and the forward substitution are
:mod:`engine.privacy.banded_mf`'s.

**Participation** (:class:`MinSeparation`, ``sampling=b_min_separation``). The clients,
permuted once from the seed, are dealt into b groups; round t draws its m clients from
group t mod b (the next m of that group, in a cycle). So each client is in at most one
of any b consecutive rounds. Needs m ≤ ⌊N/b⌋. No sampling, hence no amplification (the
paper's amplified variant samples within the groups).

**Noise** (:class:`BandedMF`, ``recipe.noise: banded``). The workload is the prefix sums
of the rounds' clipped sums; the strategy C is lower triangular and b-banded with unit
columns, optimised for that workload. The mechanism releases C·X + Z with Z's rows
i.i.d. N(0, (zC_clip)² I) — row t is round t's draw from its stream, as every recipe's —
and the server uses C⁻¹(C·X + Z) = X + C⁻¹Z: round t's update carries (C⁻¹Z)_t,
correlated with the b − 1 rounds before it.

**Privacy.** Under b-min-separation, columns of C at least b apart have disjoint row
supports, so a client in rounds π moves C·X by at most C_clip·√(Σ_{i∈π} ‖C[:, i]‖²)
(replace-special adjacency: its clipped update replaced by zero); the largest such sum
over b-separated π, from the first t rows actually released, is found exactly
(:func:`engine.privacy.banded_mf.sensitivity`). The t rounds are then one Gaussian
mechanism with multiplier z / sens (RDP or PLD). Everything released is
post-processing of C·X + Z. The noise state (the last b − 1 outputs) is kept in
checkpoints, so release mode is refused, and so are client noise, a restricted
support, adaptive clipping and any other participation.

**Server step** (:class:`BandedServer`, ``recipe.server_step: banded_momentum``):
M_t = γ M_{t−1} + (x_t + (C⁻¹Z)_t)/m, x ← x + η_s M_t.

Torch-free at import (the config reads this module's declarations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from algorithms.dp_ftrl import SERVER_MOMENTUM, momentum_step_spec
from algorithms.pieces.correlated_noise import FTRL_MOMENTUM
from algorithms.server_step import ServerStep, ServerStepPiece, StepContext
from algorithms.spec import Key, PieceSpec
from engine.privacy import banded_mf
from engine.privacy.noise import NoiseScheme, check_correlated
from engine.privacy.participation import CohortLaw, Participation, tested_draw

if TYPE_CHECKING:
    import dp_accounting
    import torch

HERE = "algorithms.dp_bandmf"
#: ``algo.bands`` when null (fewer when the b groups of N/b clients are smaller than m)
BANDMF_BANDS = 4


@dataclass(frozen=True)
class MinSeparation(Participation):
    """b groups from one permutation; round t draws from group t mod b."""

    num_clients: int
    cohort_size: int
    bands: int
    horizon: int  # the rounds the strategy is built for
    mode: ClassVar[str] = "bands"
    row_names: ClassVar[tuple[str, ...]] = (banded_mf.PARTICIPATION_NAME,)
    adjacency: ClassVar[str] = "replace_special"
    secure_ok: ClassVar[bool] = False

    def __post_init__(self) -> None:
        b, n = self.bands, self.num_clients
        if not (b is not None and b >= 1 and self.horizon is not None and self.horizon >= 1):
            raise ValueError(f"algo.bands={b!r} must be >= 1 (and the rounds known)")
        if not (self.cohort_size is not None and 1 <= self.cohort_size <= n // b):
            raise ValueError(
                f"cohort size {self.cohort_size!r} must be in [1, N/bands = {n // b}] "
                f"(b-min-separation deals the {n} clients into {b} groups)"
            )

    @property
    def name(self) -> str:
        return banded_mf.PARTICIPATION_NAME

    @property
    def denominator(self) -> float:
        return float(self.cohort_size)

    def algo_keys(self) -> dict[str, Any]:
        return {"bands": self.bands}  # the bands the participation was built with

    def law(self) -> CohortLaw:
        return CohortLaw(float(self.cohort_size), 0.0, self.cohort_size / self.num_clients, None)

    @tested_draw
    def draw(
        self, seed: int, rnd: int, secure: bool = False, on_demand: bool = False
    ) -> np.ndarray:
        assert not secure  # refused by the plan (secure_ok)
        return banded_mf.group_cohort(seed, rnd, self.num_clients, self.cohort_size, self.bands)

    @classmethod
    def from_columns(cls, row: Any, num_clients: int, horizon: int) -> MinSeparation:
        """The statement of a run from its rows (tuning.report)."""
        m = int(round(float(row["sampling_rate"]) * num_clients))
        return cls(num_clients, m, int(row["bands"]), horizon)


def min_separation(cls: type, algo: Any, ctx: Any) -> MinSeparation:
    """The run's groups: m = ``sampling.cohort_size`` (mode fixed) or round(q·N), b =
    ``algo.bands`` or min(4, ⌊N/m⌋), for the run's rounds."""
    s, n = ctx.sampling, ctx.num_clients
    if s.max_cohort is not None:
        raise ValueError(
            f"sampling.max_cohort={s.max_cohort}: b-min-separation takes cohorts of one "
            "fixed size (sampling.cohort_size or sampling.rate)"
        )
    m = s.cohort_size if s.mode == "fixed" else max(1, round(s.rate * n))
    b = algo.bands or max(1, min(BANDMF_BANDS, n // m))
    return MinSeparation(n, m, b, ctx.rounds)


@dataclass(frozen=True)
class BandedMF(NoiseScheme):
    """C⁻¹Z noise of the run's b-banded strategy (module docstring)."""

    bands: int = BANDMF_BANDS
    name: ClassVar[str] = "banded"
    linear: ClassVar[bool] = False
    secure_ok: ClassVar[bool] = False
    server_step: ClassVar[str | None] = "banded_momentum"
    audit_statistic: ClassVar[str | None] = "whitened_banded_strategy"

    def __post_init__(self) -> None:
        BANDS.check(self.bands)

    def accepts(self, sampling: Participation) -> None:
        s = sampling.statement
        if not isinstance(s, MinSeparation) or s.bands != self.bands:
            raise ValueError(
                f"banded noise with {self.bands} bands needs b-min-separation with the same "
                f"bands, not {sampling.name} sampling"
            )

    def check(self, privatizer: Any) -> None:
        check_correlated(privatizer)

    def unit_event(self, z: float, sampling: Participation) -> dp_accounting.DpEvent:
        """The whole planned run."""
        return self.run_event(z, sampling, int(sampling.horizon or 0))

    def run_event(self, z: float, sampling: Participation, rounds: int) -> dp_accounting.DpEvent:
        """The first ``rounds`` rows of C·X + Z: one Gaussian, multiplier z / sens."""
        self.accepts(sampling)
        horizon, bands = int(sampling.horizon or 0), int(sampling.bands or 0)
        if not 0 <= rounds <= horizon:
            raise ValueError(f"rounds={rounds} beyond the strategy's {horizon} rounds")
        c = banded_mf.strategy(horizon, bands)
        sens = banded_mf.sensitivity(c, rounds, min(bands, horizon))
        return banded_mf.gaussian_event(z, sens)

    def audit_model(self, sampling: Participation, step: Any, rounds: int) -> Any:
        """Canaries in rounds 0, b, 2b, … (b-separated), W = C, the strategy's
        sensitivity, and the inversion of the server's momentum."""
        from engine.privacy.audit_correlated import AuditModel, decode_momentum

        horizon, bands = int(sampling.horizon or 0), int(sampling.bands or 0)
        c = banded_mf.strategy(horizon, bands)  # the server's C
        b = min(bands, horizon)
        return AuditModel(
            period=b,
            w=np.array(c[:rounds, :rounds]),
            sensitivity=lambda t: banded_mf.sensitivity(c, t, b),
            decode=lambda q: decode_momentum(q, step.momentum),
        )

    def report(self) -> dict[str, Any]:
        return {"bands": self.bands}


MinSeparation.default_noise = property(lambda self: BandedMF(self.bands))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class BandedStep(ServerStepPiece):
    """Server momentum γ on the de-correlated noisy means (module docstring)."""

    momentum: float = FTRL_MOMENTUM
    name: ClassVar[str] = "banded_momentum"
    noise: ClassVar[str | None] = "banded"

    def __post_init__(self) -> None:
        SERVER_MOMENTUM.check(self.momentum)

    def start(self, ctx: StepContext) -> ServerStep:
        s = ctx.sampling
        horizon, bands = int(s.horizon or 0), int(s.bands or 0)
        c = banded_mf.strategy(horizon, bands)
        return BandedServer(self, c, min(bands, horizon), s.denominator, ctx.server_lr)


class BandedServer(ServerStep):
    """M_t = γ M_{t−1} + (x_t + (C⁻¹Z)_t)/m, x ← x + η_s M_t; ``piece`` holds γ."""

    def __init__(
        self, piece: Any, c: np.ndarray, bands: int, denominator: float, server_lr: float
    ) -> None:
        self.momentum = float(piece.momentum)
        self.noise = banded_mf.BandedNoise(c, bands)
        self.denominator = float(denominator)
        self.server_lr = float(server_lr)
        self.buffer: torch.Tensor | None = None

    def update(self, rnd: int, weights: torch.Tensor, agg: Any) -> torch.Tensor:
        return self.step(rnd, agg.clipped_sum, weights, agg.noise)

    def step(
        self, rnd: int, clipped_sum: torch.Tensor, weights: torch.Tensor, node: torch.Tensor
    ) -> torch.Tensor:
        """Round ``rnd``'s model from its clipped sum and Z's row (``node``)."""
        import torch

        if rnd != self.noise.rounds:
            raise RuntimeError(f"round {rnd} after {self.noise.rounds} banded rounds")
        noise = self.noise.advance(node.double())
        avg = (clipped_sum.double() + noise) / self.denominator
        self.buffer = avg if self.buffer is None else self.momentum * self.buffer + avg
        return weights + (self.server_lr * self.buffer).to(torch.float32)

    def state_dict(self) -> dict:
        return {
            "noise": self.noise.state_dict(),
            "buffer": None if self.buffer is None else self.buffer.numpy().copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        import torch

        self.noise.load_state_dict(state["noise"])
        b = state["buffer"]
        self.buffer = None if b is None else torch.from_numpy(np.array(b, dtype=np.float64))


BANDS = Key(
    "bands",
    int | None,
    None,
    "DP-BandMF: bands b of the strategy; clients join one of any b rounds (null: min(4, N/m))",
    lambda v: v >= 1,
    "must be >= 1",
)
#: the registry's lines (algorithms.registry)
SPECS = (
    PieceSpec(
        "b_min_separation",
        "participation",
        f"{HERE}:MinSeparation",
        min_separation,
        keys=(BANDS,),
        space={"algo.bands": {"type": "choice", "values": [1, 2, 4, 8]}},
    ),
    PieceSpec(
        "banded",
        "noise",
        f"{HERE}:BandedMF",
        lambda cls, a, ctx: cls(BANDMF_BANDS if a.bands is None else a.bands),
        keys=(BANDS,),
        report=lambda s, p: s.report(),
    ),
    momentum_step_spec("banded_momentum", f"{HERE}:BandedStep"),
)
#: the recipe (algorithms.recipes: the README's row)
RECIPE: dict[str, Any] = dict(
    name="dp_bandmf",
    hyperparameters=("server_momentum", "bands"),
    spelling={
        "participation": "b_min_separation",
        "noise": "banded",
        "server_step": "banded_momentum",
    },
    method="DP-BandMF (Choquette-Choo et al., NeurIPS 2023)",
    shares="clipping of `dp_fedavg`; server momentum of `dp_ftrl`",
    hyperparameter_doc=(
        "`server_momentum` (0.9), `bands` (min(4, ⌊N/m⌋)); cohorts of "
        "`sampling.cohort_size` (or q·N) from one of b groups of clients per round"
    ),
    departure=(
        "no amplification (the paper's amplified variant samples within the groups); "
        "strategy optimised for the prefix-sum workload only; model deltas, not gradients"
    ),
    own_space={"server.lr": {"type": "loguniform", "low": 0.03, "high": 3.0}},
)
