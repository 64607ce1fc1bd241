"""The privacy mechanism of a run: one object owns clipping, the noise std, the
randomness the noise comes from, the clip norm C_t and the DpEvent they imply.

:class:`GaussianMechanism` is the Gaussian mechanism on a sum of clipped client
updates (docs/algorithms.md §0):

* **Clipping.** Every update is clipped to the round's clip norm C_t (``clip_t``):
  C_0 = ``privacy.clip_norm`` under fixed clipping, or the adaptive (quantile) clip
  norm, which moves only by post-processing of released counts
  (:mod:`engine.privacy.adaptive_clip`), so it is public. Adding or removing one
  client changes the clipped sum by at most C_t (2C_t under replace-one, which the
  event accounts for).
* **Noise.** :meth:`GaussianMechanism.noise_std` is the one z·C formula of dpfl: the sum's
  noise is N(0, (z_Δ·C_t)² I), with z_Δ = z under fixed clipping and the update's share
  of the accounted z under adaptive clipping. ``site="server"`` draws it once
  centrally; ``site="client"`` has each of the m (public) cohort members add
  N(0, (z_Δ·C_t)²/m), which gives the sum the same distribution when the cohort has
  exactly m members (fixed-size sampling).
* **Randomness.** Every draw comes from :class:`engine.privacy.rng.Randomness`: the
  seeded stream of (seed, what, round[, client]) in simulation, or the OS CSPRNG in
  release mode (``privacy.secure_noise``). A template mechanism (the one a recipe's
  privatizer holds) has no randomness; the server and every worker :meth:`bind` their
  own copy, each starting at C_0.
* **Accounting.** :meth:`GaussianMechanism.dp_event` is the event the accountant
  composes, from the accounted z (never z_Δ), the participation actually used and the
  mechanism's noise scheme (:mod:`engine.privacy.noise`: independent noise, or the
  correlated schemes of the methods' modules in ``algorithms``, which say what a round's draw is and
  refuse a participation their event does not hold under).

Norms and clipped counts computed while clipping are non-private diagnostics; only the
noised sum and, under adaptive clipping, the noised count are releases.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.privacy import rng as rngs
from engine.privacy.adaptive_clip import (
    AdaptiveClipSpec,
    centred_count,
    next_clip_norm,
    release_count,
)
from engine.privacy.kernels import (
    ClipResult,
    ClipScratch,
    clip_and_add_,
    clip_update,
    gaussian_noise,
    noisy_mean_step,
)
from engine.privacy.noise import GAUSSIAN, NoiseScheme

if TYPE_CHECKING:  # dp-accounting loads only where an event is built (dp_event)
    import dp_accounting

    from engine.privacy.participation import Participation


@dataclass(eq=False)
class GaussianMechanism:
    """Clip to C_t, noise z_Δ·C_t on the sum, account z (module docstring)."""

    clip_norm: float  # C_0 (privacy.clip_norm): public
    noise_multiplier: float  # z, the accounted noise multiplier
    site: str = "server"  # who adds the noise: "server" (central) or "client"
    #: what a round's draw is and what the rounds cost: independent noise, or a node of
    #: correlated noise (engine.privacy.noise)
    scheme: NoiseScheme = GAUSSIAN
    #: quantile clipping's public parameters (privacy.clip_mode=adaptive), else None
    adaptive: AdaptiveClipSpec | None = None
    #: where draws come from; None for a template (a recipe's), which draws nothing
    randomness: rngs.Randomness | None = None
    #: C_t, the clip norm of the current round (C_0 until adaptive clipping moves it)
    clip_t: float = field(init=False)

    def __post_init__(self) -> None:
        ad = self.adaptive
        if ad is not None and (
            ad.noise_multiplier != self.noise_multiplier or ad.initial_clip != self.clip_norm
        ):
            raise ValueError(
                f"adaptive clipping accounted for z={ad.noise_multiplier}, C0={ad.initial_clip}"
                f" but the privatizer holds z={self.noise_multiplier}, C={self.clip_norm}"
            )
        self.clip_t = self.clip_norm

    def bind(self, randomness: rngs.Randomness) -> GaussianMechanism:
        """A fresh mechanism with these parameters drawing from ``randomness``, at C_0
        (each site of a run binds its own: the server's is the one that moves C_t)."""
        return dataclasses.replace(self, randomness=randomness)

    @property
    def update_noise_multiplier(self) -> float:
        """z_Δ, the z that sizes the noise on the update sum: z itself, or under adaptive
        clipping the update's share (the clipped-count release spends the rest)."""
        return self.adaptive.update_noise_multiplier if self.adaptive else self.noise_multiplier

    # ------------------------------------------------------------------- C_t

    def public_state(self) -> dict[str, Any]:
        """What clients need to clip round t: C_t under adaptive clipping (public: it is
        post-processing of released counts), else nothing (they use C_0)."""
        return {"clip_norm": self.clip_t} if self.adaptive is not None else {}

    def follow(self, public: dict[str, Any] | None) -> None:
        """A worker's mechanism takes the round's C_t from the server's public state."""
        self.clip_t = float((public or {}).get("clip_norm", self.clip_norm))

    def state_dict(self) -> dict[str, float]:
        return {"clip_norm": self.clip_t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_t = float(state.get("clip_norm", self.clip_t))

    # -------------------------------------------------------- clip and noise

    def clip(self, update: torch.Tensor) -> ClipResult:
        """Sanitise and clip ``update`` to C_t (:func:`engine.privacy.kernels.clip_update`)."""
        return clip_update(update, self.clip_t)

    def clip_and_add_(
        self, update: torch.Tensor, total: torch.Tensor, scratch: ClipScratch
    ) -> ClipResult:
        """:meth:`clip` and add the clipped update to the float64 ``total`` in one pass
        (:func:`engine.privacy.kernels.clip_and_add_`: the same values bit for bit)."""
        return clip_and_add_(total, update, self.clip_t, scratch)

    def noise_std(self, shares: float = 1.0) -> float:
        """z_Δ·C_t/√shares: the std of the noise on the clipped sum (``shares=1``), or of
        one of ``shares`` equal parts of it (client-side noise: ``shares`` is the public
        cohort size m). The one place dpfl multiplies a noise multiplier by a clip norm."""
        z = self.update_noise_multiplier
        if z <= 0:
            return 0.0
        if not math.isfinite(self.clip_t):
            raise ValueError("noise with an infinite clip norm has no privacy meaning")
        return z * self.clip_t / math.sqrt(shares)

    def _stream(self, *key: int) -> rngs.SeededStream | rngs.SecureRandom:
        if self.randomness is None:
            raise RuntimeError("a template mechanism draws no noise: bind it to a Randomness")
        return self.randomness.stream(*key)

    def server_noise(self, size: int, rnd: int, support: torch.Tensor | None) -> torch.Tensor:
        """Round ``rnd``'s central noise in float64, times the public ``support``: std
        z_Δ·C_t under ``site="server"``; under ``site="client"`` std 0, drawn anyway so
        the round's stream position is the same for every site and z. It depends on no
        data (z, C_t, the round's stream and support), so it may be drawn while the
        round's clients train."""
        std = self.noise_std() if self.site == "server" else 0.0
        noise = gaussian_noise(size, std, self._stream(rngs.NOISE, rnd))
        if support is not None:
            noise = noise * support.to(noise.dtype)
        return noise

    def client_noise(self, size: int, rnd: int, client: int, shares: float) -> torch.Tensor:
        """Client ``client``'s share of round ``rnd``'s noise (``site="client"``): float64
        N(0, (z_Δ·C_t)²/shares) from the client's own stream, on the CPU."""
        stream = self._stream(rngs.NOISE, rnd, client + 1)
        return gaussian_noise(size, self.noise_std(shares), stream)

    @staticmethod
    def privatize(
        clipped_sum: torch.Tensor, noise: torch.Tensor, denominator: float
    ) -> torch.Tensor:
        """(Σ clipped Δ_i + noise) / denominator in float64; ``denominator`` is public (m,
        or q·N under Poisson sampling), never the realised cohort size."""
        if denominator <= 0:
            raise ValueError(f"denominator={denominator} must be > 0")
        total = clipped_sum.double()
        total = total + noise
        return total / denominator

    @staticmethod
    def privatized_step(
        weights: torch.Tensor,
        clipped_sum: torch.Tensor,
        noise: torch.Tensor,
        denominator: float,
        server_lr: float,
    ) -> torch.Tensor:
        """DP-FedAvg's server step on :meth:`privatize`'s release:
        ``weights + (server_lr * privatize(clipped_sum, noise, denominator)).to(float32)``,
        the same values bit for bit, in one chunked pass without the model-sized float64
        temporaries (:func:`engine.privacy.kernels.noisy_mean_step`)."""
        return noisy_mean_step(weights, clipped_sum, noise, denominator, server_lr)

    def release_count(self, rnd: int, num_clients: int, num_clipped: int) -> dict[str, float]:
        """Adaptive clipping after round ``rnd``: release the centred count of clients
        clipped with C_t (noise σ_b from the round's CLIP_COUNT stream) and move to
        C_{t+1}. Returns the row's public columns: the C_t used and b̃."""
        ad = self.adaptive
        assert ad is not None  # called only under adaptive clipping
        released = release_count(
            centred_count(num_clients, num_clipped),
            ad.count_stddev,
            self._stream(rngs.CLIP_COUNT, rnd),
        )
        used = self.clip_t
        self.clip_t = next_clip_norm(ad, used, released)
        return {
            "clip_norm": used,
            "unclipped_fraction_released": released / ad.expected_cohort + 0.5,
        }

    # ---------------------------------------------------------------- events

    def dp_event(self, sampling: Participation, rounds: int | None = None) -> dp_accounting.DpEvent:
        """The accounted event of the accounted z under ``sampling``: the unit the
        tracker composes (one round, or the noise scheme's unit), or with
        ``rounds`` the whole run of that many rounds. Adaptive clipping is accounted
        with z as fixed clipping is (its two releases compose into one Gaussian). The
        scheme refuses a participation its event does not hold under."""
        self.scheme.accepts(sampling)
        if rounds is None:
            return self.scheme.unit_event(self.noise_multiplier, sampling)
        return self.scheme.run_event(self.noise_multiplier, sampling, rounds)
