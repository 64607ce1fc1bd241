"""The Gaussian mechanism's pure functions: sanitise, clip, draw Gaussian noise.

:class:`engine.privacy.mechanism.GaussianMechanism` calls them with the run's C_t,
noise std and randomness; nothing else in dpfl sizes noise.

Privacy assumptions (docs/algorithms.md §0):

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

from engine.privacy.rng import SecureRandom, SeededStream


@dataclass(frozen=True)
class ClipResult:
    update: torch.Tensor  # clipped flat update, same dtype as input
    norm: float  # L2 norm before clipping (non-private diagnostic)
    clipped: bool  # whether the update was scaled down (non-private diagnostic)
    nonfinite: bool  # whether the update was zeroed for being non-finite
    out_norm: float = math.nan  # L2 norm of ``update`` in float64 (≤ clip_norm)


# Input dtypes whose float64 norm can be computed without overflow: for a finite x,
# ‖x‖² ≤ n·(3.4e38)² < 1.8e308 for any n < 1e231, so the norm is finite exactly when
# every entry is, and one float64 reduction both measures and checks the update.
_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _norm64(x: torch.Tensor) -> float:
    """‖x‖ accumulated in float64 (x is cast element-wise inside the reduction; equal
    to ``vector_norm(x.double())`` without materialising the float64 copy)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


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


#: Elements per chunk of the CPU loops below: 64 Ki float64 (512 KiB) stay in cache.
_CHUNK = 1 << 16


def add_float64_(total: torch.Tensor, x: torch.Tensor) -> None:
    """``total.add_(x)`` for a float64 ``total`` and a narrower ``x``: the same values
    bit for bit (x converted exactly, one float64 addition per element), in
    cache-sized chunks on the CPU (about 3x faster than the mixed-dtype kernel)."""
    if total.device.type != "cpu" or x.dtype == total.dtype or x.numel() <= _CHUNK:
        total.add_(x)
        return
    src, dst = x.reshape(-1), total.view(-1)
    buf = torch.empty(_CHUNK, dtype=torch.float64)
    for start in range(0, src.numel(), _CHUNK):
        stop = min(start + _CHUNK, src.numel())
        b = buf[: stop - start]
        b.copy_(src[start:stop])
        dst[start:stop].add_(b)


def noisy_mean_step(
    weights: torch.Tensor,
    clipped_sum: torch.Tensor,
    noise: torch.Tensor,
    denominator: float,
    server_lr: float,
) -> torch.Tensor:
    """DP-FedAvg's server step ``weights + (server_lr * ((clipped_sum + noise) /
    denominator)).to(torch.float32)``, a new tensor with the same values bit for bit
    (each element goes through the same float64 add, divide and multiply, one rounding
    to float32 and the same addition), in cache-sized chunks on the CPU instead of
    through four model-sized temporaries: the noisy sum never exists as a whole, only
    the update made from it. ``clipped_sum`` and ``noise`` are float64 vectors of the
    weights' length; ``denominator`` is the public one (never the realised cohort)."""
    if denominator <= 0:
        raise ValueError(f"denominator={denominator} must be > 0")
    simple = weights.dtype != torch.float32 or noise.dtype != torch.float64
    if simple or weights.device.type != "cpu" or weights.numel() <= _CHUNK:
        avg = (clipped_sum.double() + noise) / denominator
        return weights + (server_lr * avg).to(torch.float32)
    src, eps, w = clipped_sum.reshape(-1), noise.reshape(-1), weights.reshape(-1)
    out = torch.empty_like(w)
    wide = torch.empty(_CHUNK, dtype=torch.float64)
    narrow = torch.empty(_CHUNK, dtype=torch.float32)
    for start in range(0, w.numel(), _CHUNK):
        stop = min(start + _CHUNK, w.numel())
        b, n = wide[: stop - start], narrow[: stop - start]
        torch.add(src[start:stop], eps[start:stop], out=b)
        b.div_(denominator)
        b.mul_(server_lr)
        n.copy_(b)
        torch.add(w[start:stop], n, out=out[start:stop])
    return out.view(weights.shape)


def _shrink(dtype: torch.dtype) -> float:
    """The factor a cast that landed above C is shrunk by before it is cast again:
    1 − 1e-6 for float32 (and float64), 1 − 4·eps for the narrower float16 and bfloat16,
    whose rounding (eps 1e-3 and 8e-3) a 1e-6 shrink cannot undo (measured: a bfloat16
    update left at 1.000008·C after the eight tries)."""
    return 1.0 - max(1e-6, 4.0 * torch.finfo(dtype).eps)


def _first_factor(clip_norm: float, norm: float, dtype: torch.dtype) -> float:
    """The factor a clipped update of ``dtype`` (float32 or narrower) is first scaled by:
    C/‖x‖ less two units of ``dtype``'s eps, so that rounding the scaled update to
    ``dtype`` (each element moves by at most eps/2 of itself, round to nearest) leaves
    its norm at most (1 − 2·eps)(1 + eps/2)·C < C and the cast needs no second try
    (before this margin about half of all clipped float32 updates needed one). The
    clipped norm is then within 2.4e-7 (float32) of C below it; the retry loop stays
    for what the bound does not cover (subnormal entries round by an absolute amount)."""
    return (clip_norm / norm) * (1.0 - 2.0 * torch.finfo(dtype).eps)


def _cast_within(scaled: torch.Tensor, dtype: torch.dtype, clip_norm: float) -> tuple:
    """``scaled`` (float64, norm ≈ C) cast to ``dtype`` with its float64 norm ≤ C: the
    rounding of the cast can leave it a few ulps above C, then it is shrunk by
    :func:`_shrink` (1e-6 for float32)."""
    out = scaled.to(dtype)
    after = _norm64(out)
    for _ in range(8):
        if after <= clip_norm:
            break
        scaled = scaled * (clip_norm / after) * _shrink(dtype)
        out = scaled.to(dtype)
        after = _norm64(out)
    return out, after


def clip_update(update: torch.Tensor, clip_norm: float) -> ClipResult:
    """Sanitise then scale ``update`` to L2 norm at most ``clip_norm``.

    float32 (and narrower) updates: one float64 reduction gives the norm, and a
    non-finite norm means a non-finite entry (see ``_NARROW``), which zeroes the update;
    a clipped update is scaled in float64 and re-measured after the cast back. float64
    updates, whose norm can overflow, are scaled by their largest entry first (no
    overflow or subnormal scale factors). Either way ‖result‖ ≤ C holds exactly in
    float64, even for huge updates, and ``clip_norm = inf`` leaves every finite
    update bit-for-bit unchanged.
    """
    if update.dtype in _NARROW and update.device.type == "cpu":
        return _clip_narrow(update, clip_norm, ClipScratch())[0]  # fresh buffers: owned
    if update.dtype in _NARROW:
        norm = _norm64(update)
        if not math.isfinite(norm):
            return ClipResult(torch.zeros_like(update), 0.0, False, True, 0.0)
        if not (math.isfinite(clip_norm) and norm > clip_norm):
            return ClipResult(update, norm, False, False, norm)
        first = _first_factor(clip_norm, norm, update.dtype)
        out, after = _cast_within(update.double() * first, update.dtype, clip_norm)
        return ClipResult(out, norm, True, False, after)
    update, nonfinite = sanitize_nonfinite(update)
    peak, unit_norm = _peak_and_unit_norm(update)
    norm = peak * unit_norm  # may be inf for float64 updates near the range limit
    if not (math.isfinite(clip_norm) and norm > clip_norm):
        return ClipResult(update, norm, False, nonfinite, norm)
    scaled = (update.double() / peak) * (clip_norm / unit_norm)
    out, after = _cast_within(scaled, update.dtype, clip_norm)
    return ClipResult(out, norm, True, nonfinite, after)


class ClipScratch:
    """Two update-sized buffers that :func:`clip_and_add_` reuses from one client to the
    next (a worker keeps one per shard): the float64 image of an update and a clipped
    update in the update's dtype. Holding them costs what one clip allocated anyway
    (the float64 norm and the scaled cast each made an update-sized temporary), but no
    longer once per client."""

    def __init__(self) -> None:
        self._wide: torch.Tensor | None = None
        self._narrow: torch.Tensor | None = None

    def buffers(self, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, dtype = update.numel(), update.dtype
        if self._wide is None or self._wide.numel() != n or self._wide.device != update.device:
            self._wide = torch.empty(n, dtype=torch.float64, device=update.device)
        if self._narrow is None or self._narrow.numel() != n or self._narrow.dtype != dtype:
            self._narrow = torch.empty(n, dtype=dtype, device=update.device)
        return self._wide, self._narrow


def _scale_round_trip(
    wide: torch.Tensor, narrow: torch.Tensor, source: torch.Tensor | None, factors: tuple
) -> None:
    """In cache-sized chunks: ``wide`` (float64; first set from ``source`` when given)
    multiplied by each factor in turn, rounded into ``narrow`` (the update's dtype) and
    converted back exactly, so that ``wide`` is the exact float64 image of ``narrow``;
    element by element ``((x.double() * f0) * f1 ...).to(dtype)``: each element is
    converted exactly, multiplied in float64 and rounded once, alone, without
    update-sized float64 temporaries."""
    for start in range(0, wide.numel(), _CHUNK):
        stop = min(start + _CHUNK, wide.numel())
        w, n = wide[start:stop], narrow[start:stop]
        if source is not None:
            w.copy_(source[start:stop])
        for f in factors:
            w.mul_(f)
        n.copy_(w)
        w.copy_(n)


def _clip_narrow(
    update: torch.Tensor, clip_norm: float, scratch: ClipScratch
) -> tuple[ClipResult, torch.Tensor | None]:
    """:func:`clip_update` of a float32 (or narrower) update on the CPU, and the exact
    float64 image of the result (``scratch``'s float64 buffer; None when the update
    was non-finite and zeroed).

    The update is converted to float64 once, into ``scratch``: its norm is the float64
    reduction over that image (what ``vector_norm(x, dtype=torch.float64)`` computes,
    without a fresh temporary), and a clipped update is scaled there in place, rounded
    to the update's dtype, converted back exactly and measured again. The first factor
    (:func:`_first_factor`) leaves room for the cast's rounding; should the cast still
    land above C it is shrunk by :func:`_shrink` and cast again from the input (at most
    8 tries). The same values bit for bit as the whole-vector expressions
    ``(x.double() * f).to(dtype)`` and :func:`_cast_within`
    (tests/engine/test_round_critical_path.py). A clipped
    result is ``scratch``'s narrow buffer."""
    wide, narrow = scratch.buffers(update)
    flat = update.reshape(-1)
    wide.copy_(flat)
    norm = float(torch.linalg.vector_norm(wide))
    if not math.isfinite(norm):  # a non-finite entry (see _NARROW): zeroed
        return ClipResult(torch.zeros_like(update), 0.0, False, True, 0.0), None
    if not (math.isfinite(clip_norm) and norm > clip_norm):
        return ClipResult(update, norm, False, False, norm), wide
    factors: tuple[float, ...] = (_first_factor(clip_norm, norm, update.dtype),)
    _scale_round_trip(wide, narrow, None, factors)
    after = float(torch.linalg.vector_norm(wide))
    for _ in range(8):
        if after <= clip_norm:
            break
        factors = (*factors, clip_norm / after, _shrink(update.dtype))
        _scale_round_trip(wide, narrow, flat, factors)
        after = float(torch.linalg.vector_norm(wide))
    return ClipResult(narrow.view(update.shape), norm, True, False, after), wide


def clip_and_add_(
    total: torch.Tensor, update: torch.Tensor, clip_norm: float, scratch: ClipScratch
) -> ClipResult:
    """``res = clip_update(update, clip_norm); add_float64_(total, res.update)``, returning
    ``res``: the same clipped values, norms and float64 sum bit for bit, in 0.37–0.64x
    the CPU time for a float32 update of 1.7M–11M coordinates
    (``python -m benchmarks.round_phases --kernels``). The clip runs in ``scratch``
    (reused from one client to the next) and the sum is added from the float64 image
    the clip already made, so what is added is exactly the clipped update, whose
    float64 norm is ≤ C. A clipped ``res.update`` is a view of ``scratch``, valid until
    its next use. Other devices and dtypes take :func:`clip_update` and
    :func:`add_float64_` themselves."""
    cpu = update.device.type == "cpu" and total.device.type == "cpu"
    if update.dtype in _NARROW and total.dtype == torch.float64 and cpu:
        res, image = _clip_narrow(update, clip_norm, scratch)
        if image is not None:
            total.view(-1).add_(image)
            return res
    else:
        res = clip_update(update, clip_norm)
    add_float64_(total, res.update)  # also zeros: they map a -0.0 total to +0.0
    return res


def gaussian_noise(
    size: int,
    std: float,
    generator: SeededStream | SecureRandom,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``size`` i.i.d. N(0, std²) draws from ``generator`` (never the global RNG): a
    :class:`engine.privacy.rng.SeededStream` (simulation: blocks drawn in parallel) or
    :class:`engine.privacy.rng.SecureRandom` (release mode: OS entropy, nothing recorded;
    see its docstring for the floating-point caveat). Both give float64 N(0, 1) values,
    scaled here in float64."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise std={std} must be finite and >= 0")
    values = generator.standard_normal(size)
    values *= std  # in place: no second model-sized vector
    return torch.from_numpy(values).to(dtype)
