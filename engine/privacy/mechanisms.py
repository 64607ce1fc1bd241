"""The Gaussian mechanism on client updates: sanitise, clip, noise — pure functions.

Privacy assumptions (ALGORITHMS.md §0):

* Unit of privacy: a client. Its whole flattened update Δ_i (all trainable tensors
  together) is clipped to L2 norm C, so adding or removing one client changes the
  sum of clipped updates by at most C (add/remove adjacency; 2C under replace-one).
* A non-finite update is replaced by zeros *before* clipping (and counted as a
  diagnostic), so NaN/Inf can never carry a client's data past the clip.
* Noise N(0, (zC)^2 I) is added once, centrally, to the sum; the average divides by
  a fixed public denominator, never by the realised cohort size.
* Norms and clipped counts are computed from raw updates: they are non-private
  diagnostics and must never be released as part of a private result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClipResult:
    update: torch.Tensor  # clipped flat update, same dtype as input
    norm: float  # L2 norm before clipping (non-private diagnostic)
    clipped: bool  # whether the update was scaled down (non-private diagnostic)
    nonfinite: bool  # whether the update was zeroed for being non-finite


def sanitize_nonfinite(update: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Zero an update that contains NaN or ±Inf; returns (update, was_zeroed)."""
    if bool(torch.isfinite(update).all()):
        return update, False
    return torch.zeros_like(update), True


def _peak_and_unit_norm(update: torch.Tensor) -> tuple[float, float]:
    """(max |x|, ‖x / max |x|‖) in float64: the norm is their product, and neither
    factor overflows even when the norm itself exceeds the float64 range."""
    x = update.double()
    peak = float(x.abs().max()) if x.numel() else 0.0
    if peak == 0.0:
        return 0.0, 0.0
    return peak, float(torch.linalg.vector_norm(x / peak))


def clip_update(update: torch.Tensor, clip_norm: float) -> ClipResult:
    """Sanitise then scale ``update`` to L2 norm at most ``clip_norm``.

    The scaling is computed in float64 from the update divided by its largest entry
    (no overflow or subnormal scale factors), and re-checked after the cast back to
    the input dtype, so ‖result‖ ≤ C holds exactly even for huge float32 updates.
    ``clip_norm = inf`` leaves every finite update bit-for-bit unchanged.
    """
    update, nonfinite = sanitize_nonfinite(update)
    peak, unit_norm = _peak_and_unit_norm(update)
    norm = peak * unit_norm  # may be inf for float64 updates near the range limit
    if not (math.isfinite(clip_norm) and norm > clip_norm):
        return ClipResult(update, norm, False, nonfinite)
    scaled = (update.double() / peak) * (clip_norm / unit_norm)
    out = scaled.to(update.dtype)
    for _ in range(8):  # rounding of the cast can leave the norm a few ulps above C
        after = float(torch.linalg.vector_norm(out.double()))
        if after <= clip_norm:
            break
        scaled = scaled * (clip_norm / after) * (1.0 - 1e-6)
        out = scaled.to(update.dtype)
    return ClipResult(out, norm, True, nonfinite)


def gaussian_noise(
    size: int, std: float, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``size`` i.i.d. N(0, std²) draws from ``generator`` (never the global RNG)."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise std={std} must be finite and >= 0")
    return torch.randn(size, generator=generator, dtype=dtype) * std


def privatize_sum(
    clipped_sum: torch.Tensor,
    *,
    noise_multiplier: float,
    clip_norm: float,
    denominator: float,
    generator: torch.Generator,
    support: torch.Tensor | None = None,
) -> torch.Tensor:
    """(Σ clipped Δ_i + N(0, (zC)² I)) / denominator, computed in float64.

    Args:
        clipped_sum: Sum of updates each clipped to ``clip_norm`` (sensitivity C).
        noise_multiplier: z; the noise std is z·C.
        clip_norm: C. Must be finite when z > 0.
        denominator: A public constant (m, or q·N for Poisson sampling).
        generator: The round's noise stream.
        support: Optional 0/1 multiplier restricting where noise lands. It must be
            public (a rand-k mask from the run's seed, or the shared/personal split):
            a data-dependent support would reveal the data (ALGORITHMS.md §0 rule 4).
    """
    if denominator <= 0:
        raise ValueError(f"denominator={denominator} must be > 0")
    total = clipped_sum.double()
    if noise_multiplier > 0:
        if not math.isfinite(clip_norm):
            raise ValueError("noise with an infinite clip norm has no privacy meaning")
        noise = gaussian_noise(total.numel(), noise_multiplier * clip_norm, generator)
    else:
        # Draw anyway so the noise stream position is the same for every z.
        noise = gaussian_noise(total.numel(), 0.0, generator)
    if support is not None:
        noise = noise * support.to(noise.dtype)
    total = total + noise
    return total / denominator
