"""Sparsification of client updates: top-k, rand-k and LUS (docs/algorithms.md §2, §3, §5).

Privacy rule (docs/algorithms.md §0 rule 4): a **data-dependent** mask — top-k by ``|Δ|``
(:func:`topk_mask`, :func:`keep_topk`) or LUS by ``|∇f·Δ|`` (:func:`lus_sparsify`) —
must never decide *where* noise is added. Such masks are local computation before
clipping, and the Gaussian noise then still covers all ``d`` coordinates (or they are
applied to the already-noised aggregate, which is post-processing). Only a **public**
mask — rand-k (:func:`randk_mask`), drawn from a generator seeded by public values
such as (seed, round) and shared by all clients of a round — may restrict the noise to
its support; that is where sparsification truly reduces the noise norm by sqrt(k/d).

All functions are pure: they return new tensors and never modify their inputs.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "apply_mask",
    "keep_topk",
    "lus_sparsify",
    "num_kept",
    "randk_mask",
    "sorted_topk_mask",
    "topk_mask",
]


def num_kept(d: int, fraction: float) -> int:
    """Number of coordinates kept out of ``d`` for a kept ``fraction``.

    Args:
        d: Number of coordinates, ``>= 1``.
        fraction: Kept fraction in ``(0, 1]``.

    Returns:
        ``k = max(1, min(d, round(fraction·d)))`` (Python's ``round``: halves to even).

    Raises:
        ValueError: If ``fraction`` is outside ``(0, 1]`` (names ``algo.keep_fraction``) or
            ``d < 1``.
    """
    f = float(fraction)
    if not (math.isfinite(f) and 0.0 < f <= 1.0):
        raise ValueError(f"algo.keep_fraction: kept fraction {fraction!r} must be in (0, 1]")
    if int(d) < 1:
        raise ValueError(f"need at least one coordinate, got d={d}")
    return max(1, min(int(d), round(f * int(d))))


def _check_1d(v: torch.Tensor, name: str) -> None:
    if v.dim() != 1:
        raise ValueError(f"{name} needs a 1-D tensor, got shape {tuple(v.shape)}")


def topk_mask(v: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` entries of largest magnitude.

    Ties are broken deterministically: among equal ``|v|`` the lower index is kept
    (stable sort of ``−|v|``). This mask is data-dependent: see the module docstring.

    Args:
        v: 1-D tensor of ``d`` entries.
        k: Number of entries to keep, ``0 <= k <= d``.

    Returns:
        Bool tensor of ``v``'s shape and device with exactly ``k`` ``True`` entries.

    Raises:
        ValueError: If ``v`` is not 1-D or ``k`` is out of range.
    """
    _check_1d(v, "topk_mask")
    d = v.numel()
    if not 0 <= k <= d:
        raise ValueError(f"k={k} must be in [0, {d}]")
    if k in (0, d):
        return torch.full((d,), k == d, dtype=torch.bool, device=v.device)
    a = v.detach().abs()
    if bool(torch.isnan(a).any()):
        return sorted_topk_mask(a, k)  # NaN: the sort's order (after every number)
    # The same mask in O(d): every entry above the k-th largest magnitude t, then the
    # entries equal to t in index order until k are kept (the stable sort's tie rule).
    # For the mlp's 199k coordinates 3.1 ms instead of the sort's 18 ms a client
    # (docs/explanation/performance.md).
    t = torch.kthvalue(a, d - k + 1).values
    mask = a > t
    short = k - int(mask.sum())
    if short:
        mask[torch.nonzero(a == t).squeeze(1)[:short]] = True
    return mask


def sorted_topk_mask(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_mask`'s definition, by a stable sort of ``−magnitudes``: its path for
    a vector holding NaN, and the benchmarks' "before"."""
    mask = torch.zeros(magnitudes.numel(), dtype=torch.bool, device=magnitudes.device)
    mask[torch.sort(-magnitudes, stable=True).indices[:k]] = True
    return mask


def keep_topk(v: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep the ``num_kept(d, fraction)`` largest-magnitude entries of ``v``, zero the rest.

    Args:
        v: 1-D tensor.
        fraction: Kept fraction in ``(0, 1]``; ``1`` returns a copy of ``v``.

    Returns:
        A new tensor of ``v``'s shape and dtype.

    Raises:
        ValueError: If ``fraction`` is outside ``(0, 1]`` (names ``algo.keep_fraction``).
    """
    _check_1d(v, "keep_topk")
    return apply_mask(v, topk_mask(v, num_kept(v.numel(), fraction)))


def randk_mask(d: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Public random mask with exactly ``num_kept(d, fraction)`` coordinates.

    The kept set is uniform among all ``k``-subsets (``torch.randperm(d)[:k]``). It
    depends only on ``generator``, so when the engine seeds it from public values
    (seed, round) all clients of a round share it and noise may be restricted to it.

    Args:
        d: Number of coordinates.
        fraction: Kept fraction in ``(0, 1]``.
        generator: Source of randomness; the mask is on its device.

    Returns:
        Bool tensor of shape ``(d,)``.

    Raises:
        ValueError: If ``fraction`` is outside ``(0, 1]`` (names ``algo.keep_fraction``).
    """
    k = num_kept(d, fraction)
    idx = torch.randperm(d, generator=generator, device=generator.device)[:k]
    mask = torch.zeros(d, dtype=torch.bool, device=generator.device)
    mask[idx] = True
    return mask


def apply_mask(v: torch.Tensor, mask: torch.Tensor, rescale: bool = False) -> torch.Tensor:
    """Zero ``v`` outside ``mask``; optionally rescale by ``d/k`` (unbiased rand-k).

    With a uniform random ``k``-subset mask, ``E[apply_mask(v, mask, True)] = v``
    because each coordinate is kept with probability ``k/d``.

    Args:
        v: Tensor to sparsify.
        mask: Bool tensor of ``v``'s shape.
        rescale: Multiply the kept entries by ``d / k``.

    Returns:
        A new tensor of ``v``'s shape and dtype.

    Raises:
        ValueError: If the shapes differ, or ``rescale`` with an empty mask.
    """
    if mask.shape != v.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != tensor shape {tuple(v.shape)}")
    mask = mask.to(device=v.device, dtype=torch.bool)
    out = torch.where(mask, v, torch.zeros_like(v))
    if rescale:
        k = int(mask.sum())
        if k == 0:
            raise ValueError("cannot rescale with an empty mask")
        out = out * (v.numel() / k)
    return out


def lus_sparsify(delta: torch.Tensor, grad: torch.Tensor, sparsity: float) -> torch.Tensor:
    """LUS (Cheng et al., CVPR 2022): zero the least important coordinates of ``Δ``.

    The first-order importance of coordinate ``j`` is ``|grad_j · delta_j|`` (Taylor
    estimate of the change in local loss when ``w_j`` is reset to ``x^t_j``). The top
    ``k = num_kept(d, 1 − c)`` coordinates by importance are kept (ties: lower index),
    the rest are zeroed. This is local computation **before clipping**; the noise still
    covers all ``d`` coordinates (docs/algorithms.md §0 rule 4) — never use this mask to
    restrict noise.

    Args:
        delta: Flattened local update ``Δ_i`` (1-D).
        grad: Local gradient ``∂f_i/∂w`` at the local model, same shape as ``delta``.
        sparsity: Zeroed fraction ``c`` in ``[0, 1)``; ``0`` returns a copy of ``delta``.

    Returns:
        A new tensor of ``delta``'s shape and dtype.

    Raises:
        ValueError: If ``sparsity`` is outside ``[0, 1)`` (names ``algo.zero_fraction``), or
            the shapes differ, or ``delta`` is not 1-D.
    """
    c = float(sparsity)
    if not (math.isfinite(c) and 0.0 <= c < 1.0):
        raise ValueError(f"algo.zero_fraction: LUS zeroed fraction {sparsity!r} must be in [0, 1)")
    _check_1d(delta, "lus_sparsify")
    if grad.shape != delta.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != delta shape {tuple(delta.shape)}")
    if c == 0.0 or delta.numel() == 0:
        return delta.clone()
    importance = (grad.detach().to(delta.device) * delta.detach()).abs()
    k = num_kept(delta.numel(), 1.0 - c)
    return apply_mask(delta, topk_mask(importance, k))
