"""Laplacian smoothing of the noisy aggregate (DP-Fed-LS, docs/algorithms.md §4).

The server replaces the noisy average update ``v`` by ``ṽ = A⁻¹ v`` with
``A = I + σ_ls·L``, where ``L`` is the Laplacian of the 1-D cycle graph on the ``n``
coordinates (2 on the diagonal, −1 on the two neighbours, with wrap-around). ``A`` is
circulant, so it is diagonalised by the discrete Fourier transform and

    ṽ = real(ifft(fft(v) / (1 + 2σ_ls − 2σ_ls·cos(2πk/n)))),   k = 0..n−1.

Properties relied on by the recipes and checked by the tests:

* **No privacy cost.** Smoothing is post-processing of the already-noised aggregate
  (docs/algorithms.md §0 rule 4); it never touches un-noised client data.
* **The mean is preserved.** The k = 0 Fourier coefficient is divided by 1, so
  ``ṽ.sum() == v.sum()`` up to rounding.
* ``σ_ls = 0`` is the identity; for ``n ≥ 3`` the FFT result equals solving
  ``(I + σ_ls L) x = v``; tensors of 1–2 elements are left unsmoothed.
* High frequencies are damped most: the alternating vector (±1, even ``n``) is
  scaled by exactly ``1 / (1 + 4σ_ls)``.

The per-tensor scope (default) follows the DP-Fed-LS reference code: each parameter
tensor is flattened in PyTorch's natural (row-major) order and smoothed on its own, so
for a ``Linear`` weight of shape (out, in) neighbours are adjacent inputs of one output
unit.

``scope="weights"`` smooths only the weight tensors (those with two or more
dimensions: ``Linear``/``Conv`` weights, each flattened row-major on its own) and leaves
every 1-D tensor (biases, GroupNorm affine parameters) exactly as it was: the
independent MNIST loop of issue 14 smooths the (10, 784) logistic-regression weight and
not its bias. ``scope="model"`` smooths the whole concatenated vector at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["SCOPES", "laplacian_smooth", "smooth_flat"]

SCOPES: tuple[str, ...] = ("tensor", "model", "weights")


def _check_sigma(sigma_ls: float) -> float:
    sigma = float(sigma_ls)
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"algo.sigma_ls={sigma_ls!r} must be a finite number >= 0")
    return sigma


def laplacian_smooth(v: torch.Tensor, sigma_ls: float) -> torch.Tensor:
    """Apply ``(I + σ_ls·L)⁻¹`` (L the cycle Laplacian) to a 1-D vector by FFT.

    The division is done in float64 and the result is cast back to ``v``'s dtype and
    device. Because the denominator is symmetric (``k`` and ``n − k`` share it) the
    inverse transform is real, so ``irfft(rfft(v) / denom)`` is used; it equals
    ``real(ifft(fft(v) / denom))`` at half the cost.

    Args:
        v: 1-D tensor of ``n`` entries.
        sigma_ls: Smoothing strength ``σ_ls >= 0``.

    Returns:
        A new tensor of ``v``'s shape and dtype. For ``σ_ls = 0`` or ``n <= 2`` it is a
        copy of ``v`` (bit-identical values).

    Raises:
        ValueError: If ``σ_ls`` is negative or not finite (names ``algo.sigma_ls``), or
            ``v`` is not 1-D.
    """
    sigma = _check_sigma(sigma_ls)
    if v.dim() != 1:
        raise ValueError(f"laplacian_smooth needs a 1-D tensor, got shape {tuple(v.shape)}")
    n = v.numel()
    if sigma == 0.0 or n <= 2:
        return v.clone()
    x = v.detach().to(torch.float64)
    k = torch.arange(n // 2 + 1, dtype=torch.float64, device=x.device)
    denom = 1.0 + 2.0 * sigma - 2.0 * sigma * torch.cos(2.0 * math.pi * k / n)
    out = torch.fft.irfft(torch.fft.rfft(x) / denom, n=n)
    return out.to(dtype=v.dtype)


def smooth_flat(
    flat: torch.Tensor,
    shapes: Sequence[tuple[int, ...]],
    sigma_ls: float,
    scope: str = "tensor",
) -> torch.Tensor:
    """Smooth a flattened model update, per parameter tensor or as one vector.

    Args:
        flat: 1-D concatenation of the parameter tensors, each flattened row-major.
        shapes: Shapes of those tensors, in the order of concatenation.
        sigma_ls: Smoothing strength ``σ_ls >= 0``.
        scope: ``"tensor"`` smooths each tensor's own segment separately (the DP-Fed-LS
            reference code); ``"model"`` smooths the whole vector at once;
            ``"weights"`` smooths each tensor of >= 2 dims and copies 1-D ones (biases).

    Returns:
        A new 1-D tensor of ``flat``'s shape and dtype.

    Raises:
        ValueError: If ``scope`` is unknown (names ``algo.ls_scope``), ``σ_ls`` is
            invalid (names ``algo.sigma_ls``), ``flat`` is not 1-D, or the shapes do not
            add up to ``flat.numel()``.
    """
    if scope not in SCOPES:
        raise ValueError(f"algo.ls_scope={scope!r} is not one of {', '.join(SCOPES)}")
    sigma = _check_sigma(sigma_ls)
    if flat.dim() != 1:
        raise ValueError(f"smooth_flat needs a 1-D tensor, got shape {tuple(flat.shape)}")
    sizes = [math.prod(s) for s in shapes]
    if sum(sizes) != flat.numel():
        raise ValueError(f"shapes hold {sum(sizes)} entries but the flat vector has {flat.numel()}")
    if scope == "model":
        return laplacian_smooth(flat, sigma)
    if not sizes:
        return flat.clone()
    segments = torch.split(flat, sizes)
    if scope == "weights":
        return torch.cat(
            [
                laplacian_smooth(seg, sigma) if len(shape) >= 2 else seg.clone()
                for seg, shape in zip(segments, shapes)
            ]
        )
    return torch.cat([laplacian_smooth(seg, sigma) for seg in segments])
