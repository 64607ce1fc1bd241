"""Local-step gradient rules: plain gradients, SAM/ASAM and DP-FedPGN.

Every function here is a local computation on a client's own data, before the update is
clipped and noised; none has any privacy effect by itself (docs/algorithms.md §0). They are
pure functions over a list of trainable parameters ``params = [p for p in
model.parameters() if p.requires_grad]`` and a closure that evaluates the minibatch loss
at the model's current parameters. Gradients are returned as detached tensors aligned
with ``params``; nothing is written to ``.grad``. Where a function evaluates the loss at a
perturbed point it restores the parameters bit-exactly from a saved copy before
returning (also on error).

Note: a closure evaluated twice (SAM) runs two forward passes; a model with BatchNorm in
train mode then updates its running statistics twice per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "LossFn",
    "gradients",
    "pgn_gradients",
    "pgn_public",
    "round_lr",
    "sam_gradients",
    "sam_perturbation",
]

LossFn = Callable[[], torch.Tensor]
"""Closure computing the minibatch loss at the model's current parameters, e.g.
``lambda: loss_fn(model(x), y) + reg(model)``."""


def _global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all tensors flattened together (a 0-dim tensor, no host sync)."""
    if not tensors:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


@contextmanager
def _perturbed(params: list[torch.Tensor], offsets: list[torch.Tensor]) -> Iterator[None]:
    """Temporarily set w ← w + offset in place; restore w bit-exactly on exit."""
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, e in zip(params, offsets):
                p.add_(e)
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def gradients(params: list[torch.Tensor], closure: LossFn) -> tuple[float, list[torch.Tensor]]:
    """Loss value and gradients at the current parameters (plain SGD direction).

    Uses ``torch.autograd.grad``, so ``.grad`` of the parameters is left untouched.

    Args:
        params: Trainable parameters (``requires_grad=True``).
        closure: Computes the minibatch loss at the current parameters.

    Returns:
        ``(loss, grads)``: the loss as a float and detached gradients aligned with
        ``params``; a parameter the loss does not depend on gets zeros.
    """
    loss = closure()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    out = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
    return float(loss.detach()), out


def sam_perturbation(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    rho: float,
    asam: bool,
    eps: float = 1e-12,
) -> list[torch.Tensor]:
    """SAM ascent step e (Foret et al. 2021) or its adaptive form ASAM (Kwon et al. 2021).

    Plain SAM: e = ρ·g/‖g‖₂, the norm taken over all tensors together, so ‖e‖ = ρ.
    ASAM (docs/algorithms.md §5): e = ρ·T_w²·g/‖T_w·g‖₂ with T_w = |w| elementwise, so e lies
    on the boundary of the ASAM ball ‖T_w⁻¹·e‖ = ρ. ``eps`` is added to the denominator;
    ρ = 0 or a zero (ASAM: zero T_w·g) direction gives zeros.

    Args:
        params: Current parameters w (only used for ASAM).
        grads: Gradient g at w, aligned with ``params``.
        rho: Neighbourhood radius ρ ≥ 0 (``algo.rho``).
        asam: Use ASAM instead of plain SAM (``algo.asam``).
        eps: Added to the norm in the denominator.

    Returns:
        The perturbation e, one detached tensor per parameter.

    Raises:
        ValueError: If ρ < 0 or the lists do not match.
    """
    rho = float(rho)
    if not rho >= 0.0:
        raise ValueError(f"algo.rho={rho} must be >= 0")
    if len(params) != len(grads):
        raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
    if rho == 0.0:
        return [torch.zeros_like(g) for g in grads]
    with torch.no_grad():
        if asam:
            scales = [p.detach().abs() for p in params]
            scaled = [t * g for t, g in zip(scales, grads)]
            norm = _global_norm(scaled)
            return [rho * t * sg / (norm + eps) for t, sg in zip(scales, scaled)]
        norm = _global_norm(grads)
        return [rho * g / (norm + eps) for g in grads]


def sam_gradients(
    params: list[torch.Tensor], closure: LossFn, rho: float, asam: bool
) -> tuple[float, list[torch.Tensor]]:
    """SAM/ASAM gradient ∇F(w + e) for one local step (docs/algorithms.md §5).

    Computes g = ∇F(w), e = :func:`sam_perturbation` (g), evaluates the gradient at
    w + e and restores w bit-exactly. The caller then steps w ← w − η·∇F(w + e) with its
    base optimizer. ρ = 0 short-circuits to :func:`gradients` (exactly SGD).

    Args:
        params: Trainable parameters, modified temporarily and restored.
        closure: Computes the minibatch loss at the current parameters (called twice).
        rho: Neighbourhood radius ρ ≥ 0 (``algo.rho``).
        asam: Use ASAM instead of plain SAM (``algo.asam``).

    Returns:
        ``(loss at w, detached gradients at w + e)``.

    Raises:
        ValueError: If ρ < 0.
    """
    rho = float(rho)
    if not rho >= 0.0:
        raise ValueError(f"algo.rho={rho} must be >= 0")
    loss, grads = gradients(params, closure)
    if rho == 0.0:
        return loss, grads
    e = sam_perturbation(params, grads, rho, asam)
    with _perturbed(params, e):
        _, grads_at_e = gradients(params, closure)
    return loss, grads_at_e


def pgn_public(
    params: list[torch.Tensor],
    *,
    beta: float,
    rho: float,
    g_tilde: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """DP-FedPGN's public inputs of a round, the same for every client: ``(g̃, δ)``.

    Checks β ∈ [0, 1], ρ ≥ 0 and that g̃ matches ``params`` in count and shapes, moves
    g̃ to the parameters' device and dtype, and forms δ = ρ·g̃/‖g̃‖ (None when g̃ is
    None or ρ = 0; a zero g̃ gives δ = 0 through the 1e-12 in the denominator, without
    a host sync). Shared by :func:`pgn_gradients` and the vectorised trainer, whose
    ``params`` may be any tensors with the parameters' shapes.

    Raises:
        ValueError: If β ∉ [0, 1], ρ < 0, or g̃ does not match ``params``.
    """
    beta = float(beta)
    rho = float(rho)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"algo.beta={beta} must be in [0, 1]")
    if not rho >= 0.0:
        raise ValueError(f"algo.rho={rho} must be >= 0")
    if g_tilde is None:
        return None, None
    if len(g_tilde) != len(params):
        raise ValueError(f"g_tilde has {len(g_tilde)} tensors for {len(params)} parameters")
    for p, gt in zip(params, g_tilde):
        if p.shape != gt.shape:
            raise ValueError(f"g_tilde shape {tuple(gt.shape)} != parameter {tuple(p.shape)}")
    g_tilde = [gt.detach().to(device=p.device, dtype=p.dtype) for p, gt in zip(params, g_tilde)]
    if rho == 0.0:
        return g_tilde, None
    with torch.no_grad():
        norm = _global_norm(g_tilde)
        delta = [rho * gt / (norm + 1e-12) for gt in g_tilde]
    return g_tilde, delta


def pgn_gradients(
    params: list[torch.Tensor],
    closure: LossFn,
    *,
    beta: float,
    rho: float,
    g_tilde: list[torch.Tensor] | None,
) -> tuple[float, list[torch.Tensor]]:
    """DP-FedPGN local direction (Liu et al.; docs/algorithms.md §7).

    δ = ρ·g̃/‖g̃‖ (δ = 0 when g̃ is None, zero, or ρ = 0), then
    g = β·∇F(w + δ) + (1 − β)·g̃, with g̃ taken as zeros when None. g̃ is the server's
    previous noisy pseudo-gradient (public). One gradient evaluation per step; w is
    restored bit-exactly. β = 1 with ρ = 0 (or g̃ None) returns exactly
    :func:`gradients`.

    Args:
        params: Trainable parameters, modified temporarily and restored.
        closure: Computes the minibatch loss at the current parameters.
        beta: Weight β ∈ [0, 1] of the local gradient (``algo.beta``).
        rho: Perturbation radius ρ ≥ 0 along g̃ (``algo.rho``).
        g_tilde: Global gradient estimate aligned with ``params``, or None (round 0).

    Returns:
        ``(loss at w + δ, detached direction g)``.

    Raises:
        ValueError: If β ∉ [0, 1], ρ < 0, or g̃ does not match ``params``.
    """
    beta = float(beta)
    g_tilde, delta = pgn_public(params, beta=beta, rho=rho, g_tilde=g_tilde)
    if delta is None:
        loss, grads = gradients(params, closure)
    else:
        with _perturbed(params, delta):
            loss, grads = gradients(params, closure)

    if beta == 1.0:
        return loss, grads
    with torch.no_grad():
        if g_tilde is None:
            return loss, [beta * g for g in grads]
        return loss, [beta * g + (1.0 - beta) * gt for g, gt in zip(grads, g_tilde)]


def round_lr(lr: float, decay: float, rnd: int) -> float:
    """η_t = η·decay^t: the local step size of round ``rnd`` (public; clients use it
    for their steps, the server for PGN's public drift and direction)."""
    return lr * decay**rnd
