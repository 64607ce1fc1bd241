"""Server steps: how the privatized aggregate moves the global model.

The engine's round is one code path for every recipe (``engine.federated.server``): it
sums the clipped updates, takes the mechanism's noise draw for the round, hands both to
the recipe's server step as an :class:`Aggregate`, and records the row. What the step
does with them is the step's own:

* :class:`FedAvgStep` (``fedavg``, the default): x ← x + η_s · release, the release
  being the noisy mean (:meth:`Aggregate.release`: noise added, divided by the public
  denominator, then the recipe's server transforms). With nothing between the noise and
  the step it takes the mechanism's fused pass (``GaussianMechanism.privatized_step``),
  equal bit for bit and without model-sized float64 temporaries;
* the other built-in steps are declared in their methods' modules (``algorithms``),
  each with the privacy argument of what it uses.

A step is declared by a frozen *piece* (registry kind ``server_step``, named by
``recipe.server_step``) whose :meth:`ServerStepPiece.start` makes the run's
:class:`ServerStep` on the server from the public :class:`StepContext`.

Privacy: a step sees the clipped sum and the noise only inside the server, and may use
them only through what the mechanism releases — :meth:`Aggregate.release`, or, for a
step made for a correlated noise scheme (:attr:`ServerStepPiece.noise`), that scheme's
own release, which its method's privacy argument covers; the pipeline refuses such a
step with any other noise (and a correlated scheme with any other step). Everything a
step returns (the model, its :meth:`ServerStep.public` state, its row
columns) is post-processing of releases, hence public.

Torch-free at import: the config lists the registry's names without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from engine.privacy.mechanism import GaussianMechanism
    from engine.privacy.participation import Participation


@dataclass(frozen=True)
class StepContext:
    """What a server step may read when it starts (public, fixed for the run)."""

    server_lr: float  # server.lr
    local_lr: float  # local.lr (its decay below)
    lr_decay: float
    steps: int | None  # the public number of local steps K, when fixed
    sampling: Participation  # the run's participation (its public denominator)
    shapes: list[tuple[int, ...]]  # the trained tensors' shapes (flat order)
    dim: int  # d


@dataclass
class Aggregate:
    """One round's aggregate as the server step receives it (server-internal)."""

    clipped_sum: torch.Tensor  # Σ clipped Δ_i in float64 (canaries included)
    noise: torch.Tensor | None  # the mechanism's draw for the round (None: not private)
    mechanism: GaussianMechanism | None
    denominator: float  # public: m, or q·N
    num_clients: int  # realised; only a non-private recipe divides by it
    transforms: tuple[Any, ...] = ()  # the recipe's server transforms (post-processing)
    #: what transforms read: ``shapes``, ``steps``, ``lr`` and the step's public state
    context: dict[str, Any] = field(default_factory=dict)

    def release(self) -> torch.Tensor:
        """The noisy mean (Σ + noise) / denominator in float64, then the server
        transforms; without privacy the realised mean."""
        if self.mechanism is not None:
            assert self.noise is not None
            avg = self.mechanism.privatize(self.clipped_sum, self.noise, self.denominator)
        elif self.num_clients:
            avg = self.clipped_sum / self.num_clients
        else:
            import torch

            avg = torch.zeros_like(self.clipped_sum)
        for transform in self.transforms:
            avg = transform.apply(avg, self.context)
        return avg

    @property
    def fusable(self) -> bool:
        """Whether x + η·release can be the mechanism's fused pass (no transform)."""
        return self.mechanism is not None and not self.transforms


class ServerStep:
    """A run's server step on the server: moves the weights, keeps its state."""

    def public(self) -> dict[str, torch.Tensor | None]:
        """Public state the next round's clients and the server transforms read, by name
        (model-sized float32 vectors). Post-processing only."""
        return {}

    def update(self, rnd: int, weights: torch.Tensor, agg: Aggregate) -> torch.Tensor:
        """Round ``rnd``'s new weights (float32) from the current ones and the aggregate."""
        raise NotImplementedError

    def row(self, rnd: int) -> dict[str, Any]:
        """Public columns of round ``rnd``'s row."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything that evolves across rounds (the server's checkpoint holds it)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ServerStepPiece:
    """A server step's declaration: a frozen piece the pipeline holds."""

    #: its registry name (a correlated noise scheme names the step it is made for)
    name: ClassVar[str] = ""
    #: None: the step uses the mechanism's release. A noise scheme's name: the step
    #: uses the clipped sum and the round's draw through that scheme's own release, so
    #: it needs that scheme, and server transforms (which act on the noisy mean) and
    #: personal heads are refused with it
    noise: ClassVar[str | None] = None

    def start(self, ctx: StepContext) -> ServerStep:
        raise NotImplementedError


@dataclass(frozen=True)
class FedAvgStep(ServerStepPiece):
    """x ← x + η_s · release (module docstring)."""

    name: ClassVar[str] = "fedavg"

    def start(self, ctx: StepContext) -> ServerStep:
        return FedAvgUpdate(ctx.server_lr)


class FedAvgUpdate(ServerStep):
    def __init__(self, server_lr: float) -> None:
        self.server_lr = float(server_lr)

    def update(self, rnd: int, weights: torch.Tensor, agg: Aggregate) -> torch.Tensor:
        if agg.fusable:  # w + η_s·(Σ + noise)/m in one chunked pass, the same bits
            assert agg.mechanism is not None and agg.noise is not None
            return agg.mechanism.privatized_step(
                weights, agg.clipped_sum, agg.noise, agg.denominator, self.server_lr
            )
        return weights + (self.server_lr * agg.release()).to(weights.dtype)
