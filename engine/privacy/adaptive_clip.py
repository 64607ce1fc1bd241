"""Adaptive (quantile) clipping: Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021.

The clip norm C_t follows a target quantile γ of the clients' update norms:

* every client of round t also reports b_i = 1[‖Δ_i‖ ≤ C_t], computed with the C_t
  that clipped its update in that round;
* the server releases the *centred* count Σ_i (b_i − ½) + N(0, σ_b²): a client's
  term is ±½, so the sensitivity under add/remove-one is ½ and the release is a
  Gaussian mechanism with noise multiplier 2σ_b;
* b̃ = (released centred count)/m + ½ with m the expected (public) cohort size, and
  C_{t+1} = C_t · exp(−η (b̃ − γ)) (geometric update; C_{t+1} is post-processing of
  released values, so it is public and may steer later rounds).

Privacy. One round releases the update sum (sensitivity C_t, noise z_Δ·C_t) and the
count (noise multiplier 2σ_b). Two Gaussian mechanisms on the same sampled cohort
compose into one Gaussian with 1/z² = 1/z_Δ² + 1/(2σ_b)² (their RDP curves add), so
the run is accounted with the configured z exactly as fixed clipping is, and the
update is noised with z_Δ = (z⁻² − (2σ_b)⁻²)^(−½) > z. This needs z < 2σ_b. Calibrating
z from a target ε is unchanged (the accountant sees one Gaussian with z per round).

Known pitfalls the engine avoids (pinned by tests): sizing the round's noise with
C_{t+1} (computed before the noise is drawn) instead of the C_t that bounded the
round's sensitivity, and counting uncentred bits Σ b_i, whose sensitivity is 1, not ½
(and whose mean then depends on the private realised cohort size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.privacy.kernels import gaussian_noise
from engine.privacy.rng import SecureRandom, SeededStream


class AdaptiveClipError(ValueError):
    """Adaptive clipping cannot meet the accounted noise multiplier."""


def update_noise_multiplier(z: float, count_stddev: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−½): the update's share of the accounted z.

    ``z = 0`` (no privacy) gives 0. Raises :class:`AdaptiveClipError` unless z < 2σ_b.
    """
    if z < 0 or not math.isfinite(z):
        raise AdaptiveClipError(f"noise multiplier {z} must be finite and >= 0")
    if z == 0:
        return 0.0
    if not z < 2.0 * count_stddev:
        raise AdaptiveClipError(
            f"privacy.clip_count_stddev={count_stddev:g}: adaptive clipping needs the "
            f"accounted noise multiplier {z:.4g} < 2*clip_count_stddev={2 * count_stddev:g}; "
            "raise privacy.clip_count_stddev (or the privacy budget)"
        )
    return (z**-2 - (2.0 * count_stddev) ** -2) ** -0.5


def composed_noise_multiplier(update_z: float, count_stddev: float) -> float:
    """The single Gaussian equivalent of (update with z_Δ, count with σ_b): the inverse
    of :func:`update_noise_multiplier` (used by tests as an oracle)."""
    return (update_z**-2 + (2.0 * count_stddev) ** -2) ** -0.5


@dataclass(frozen=True)
class AdaptiveClipSpec:
    """Public parameters of quantile clipping for one run."""

    initial_clip: float  # C_0 = privacy.clip_norm
    target_quantile: float  # γ
    lr: float  # η
    count_stddev: float  # σ_b
    expected_cohort: float  # m (public: q·N or the fixed cohort size)
    noise_multiplier: float  # z, accounted
    update_noise_multiplier: float  # z_Δ, added to the update sum

    @classmethod
    def build(
        cls,
        z: float,
        initial_clip: float,
        expected_cohort: float,
        target_quantile: float = 0.5,
        lr: float = 0.2,
        count_stddev: float | None = None,
    ) -> AdaptiveClipSpec:
        """σ_b defaults to m/20 (the paper's choice); z_Δ is derived from z and σ_b."""
        sb = expected_cohort / 20.0 if count_stddev is None else float(count_stddev)
        return cls(
            initial_clip=float(initial_clip),
            target_quantile=float(target_quantile),
            lr=float(lr),
            count_stddev=sb,
            expected_cohort=float(expected_cohort),
            noise_multiplier=float(z),
            update_noise_multiplier=update_noise_multiplier(z, sb),
        )


def centred_count(num_clients: int, num_clipped: int) -> float:
    """Σ_i (b_i − ½) with b_i = 1[‖Δ_i‖ ≤ C_t]: (clients − clipped) − clients/2.

    A non-finite update is zeroed before clipping, so its b_i is 1."""
    return (num_clients - num_clipped) - 0.5 * num_clients


def release_count(
    centred: float, count_stddev: float, generator: SeededStream | SecureRandom
) -> float:
    """The released centred count Σ(b_i − ½) + N(0, σ_b²) (one draw from ``generator``)."""
    return float(centred + gaussian_noise(1, count_stddev, generator)[0])


def next_clip_norm(spec: AdaptiveClipSpec, clip_norm: float, released_centred: float) -> float:
    """C_{t+1} = C_t·exp(−η(b̃ − γ)), b̃ = released/m + ½ (public post-processing)."""
    b_tilde = released_centred / spec.expected_cohort + 0.5
    return float(clip_norm * math.exp(-spec.lr * (b_tilde - spec.target_quantile)))


def adaptive_spec(config, plan) -> AdaptiveClipSpec | None:
    """The run's quantile-clipping parameters (``None`` under ``clip_mode=fixed`` or for
    a non-private recipe); raises ValueError (one line) when z ≥ 2σ_b."""
    p = config.privacy
    if p.clip_mode != "adaptive" or not plan.private:
        return None
    return AdaptiveClipSpec.build(
        plan.noise_multiplier,
        p.clip_norm,
        plan.sampling.denominator,
        p.target_quantile,
        p.clip_lr,
        p.clip_count_stddev,
    )
