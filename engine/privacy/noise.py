"""Noise schemes: how a run's Gaussian draws become the noise of its releases, and the
DpEvent that follows, with the participation's statement.

Every round the mechanism (:class:`engine.privacy.mechanism.GaussianMechanism`) draws
N(0, (z_Δ·C_t)² I) from the round's stream, the same draw for every scheme. A *noise
scheme* says what that draw is and what it costs:

* :class:`GaussianNoise` (``gaussian``, every recipe but two): the draw is the round's
  noise, independent of other rounds; with a sampled participation (Poisson or fixed)
  one round is the participation's subsampled Gaussian
  (:meth:`engine.privacy.participation.Participation.sampled_gaussian`), and rounds
  compose (the accountant's RDP is then ``t · rdp₁``: :attr:`NoiseScheme.linear`);
* correlated schemes (declared in their methods' modules, ``algorithms``) make the
  draw a node of noise correlated across rounds; their
  event is the whole run's, valid only under the participation they were built for
  (:meth:`NoiseScheme.accepts` refuses any other, so a recipe that pairs them wrongly is
  refused when it is built).

A scheme is torch-free plain data: it is declared in the piece registry (kind ``noise``)
and named by a recipe (``recipe.noise``). dp-accounting is imported only where an event
is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import dp_accounting

    from engine.privacy.participation import Participation


class NoiseScheme:
    """What a round's Gaussian draw is and what the rounds cost (module docstring)."""

    #: the registry name (``recipe.noise``)
    name: ClassVar[str] = ""
    #: ε after t rounds is the t-fold composition of :meth:`unit_event` (the
    #: accountant's fast path); False: :meth:`run_event` is composed for every t
    linear: ClassVar[bool] = True
    #: whether release mode (``privacy.secure_noise``) can run it (False: the noise
    #: state is server-internal and kept in checkpoints)
    secure_ok: ClassVar[bool] = True
    #: the canary audit's every-round statistic (``audit_statistic``), None: the base one
    audit_statistic: ClassVar[str | None] = None
    #: the server step (registry name) whose release this scheme's event covers; None:
    #: any step that uses the mechanism's release (the noisy mean is what is accounted)
    server_step: ClassVar[str | None] = None

    def accepts(self, sampling: Participation) -> None:
        """Raise ValueError unless this scheme's event holds under ``sampling``."""

    def check(self, privatizer: Any) -> None:
        """Raise ValueError for a privatizer setting the scheme cannot noise (a noise
        site, a restricted support, adaptive clipping)."""

    def unit_event(self, z: float, sampling: Participation) -> dp_accounting.DpEvent:
        """The event the tracker composes (one round, or the scheme's unit)."""
        raise NotImplementedError

    def run_event(self, z: float, sampling: Participation, rounds: int) -> dp_accounting.DpEvent:
        """The event of ``rounds`` rounds at noise multiplier z."""
        raise NotImplementedError

    def audit_model(self, sampling: Participation, step: Any, rounds: int) -> Any:
        """The correlated canary audit's model of this scheme (None: the base audit)."""
        return None

    def report(self) -> dict[str, Any]:
        """Resolved hyperparameters (``rounds.parquet`` columns)."""
        return {}


@dataclass(frozen=True)
class GaussianNoise(NoiseScheme):
    """Independent noise every round: one round is the participation's subsampled
    Gaussian, the rounds compose."""

    name: ClassVar[str] = "gaussian"

    def accepts(self, sampling: Participation) -> None:
        sampling.statement.sampled_gaussian(1.0)  # raises where the rounds are not sampled

    def unit_event(self, z: float, sampling: Participation) -> dp_accounting.DpEvent:
        return sampling.statement.sampled_gaussian(z)

    def run_event(self, z: float, sampling: Participation, rounds: int) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.SelfComposedDpEvent(self.unit_event(z, sampling), rounds)


#: The default scheme (a recipe that names none).
GAUSSIAN = GaussianNoise()


def check_correlated(privatizer: Any) -> None:
    """What a correlated scheme refuses: client noise, a restricted support and adaptive
    clipping (its clipped-count release is not accounted with it)."""
    if privatizer.site != "server":
        raise ValueError(
            f"algo.noise_site={privatizer.site!r}: correlated noise is added by the server"
        )
    if privatizer.noise_support != "all":
        raise ValueError(
            f"noise_support={privatizer.noise_support!r}: correlated noise covers all d"
        )
    if privatizer.adaptive is not None:
        raise ValueError(
            "privacy.clip_mode='adaptive' is not available with correlated noise (its "
            "count release is not accounted with it); use privacy.clip_mode=fixed"
        )
