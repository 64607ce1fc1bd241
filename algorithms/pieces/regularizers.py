"""Terms added to a client's local loss.

These are local computations on a client's own data before clipping; they change what
the client's update is, not how it is clipped or noised, and so have no privacy effect
by themselves (docs/algorithms.md §0 rule 4).
"""

from __future__ import annotations

import torch

__all__ = ["blur_loss"]


def blur_loss(
    params: list[torch.Tensor],
    anchor: list[torch.Tensor],
    lam: float,
    clip_norm: float,
) -> torch.Tensor:
    """BLUR bounded-update regulariser (Cheng et al., CVPR 2022; docs/algorithms.md §2).

    Returns (λ/2)·max(0, ‖w − x^t‖² − C²), where w is the flattened local model (all
    trainable tensors together) and x^t the round's global model. The result is a
    differentiable scalar tensor that must be added to the minibatch loss before
    ``backward``/``autograd.grad``; its gradient is λ(w − x^t) only while
    ‖w − x^t‖ > C and zero inside the ball. λ = 0 gives a constant zero tensor, so the
    recipe is then exactly DP-FedAvg.

    Args:
        params: The client's trainable parameters (``requires_grad=True``), in the order
            of ``[p for p in model.parameters() if p.requires_grad]``.
        anchor: The round's global parameters x^t, aligned with ``params``; treated as
            constants (detached here).
        lam: Penalty weight λ ≥ 0 (``algo.blur_lambda``).
        clip_norm: The radius C (the clip norm, ``privacy.clip_norm``), ≥ 0.

    Returns:
        A 0-dim tensor on the parameters' device and dtype.

    Raises:
        ValueError: If λ < 0, C < 0, or ``params`` and ``anchor`` do not match.
    """
    lam = float(lam)
    clip_norm = float(clip_norm)
    if not lam >= 0.0:
        raise ValueError(f"algo.blur_lambda={lam} must be >= 0")
    if not clip_norm >= 0.0:
        raise ValueError(f"privacy.clip_norm={clip_norm} must be >= 0 for BLUR")
    if len(params) != len(anchor):
        raise ValueError(
            f"BLUR anchor has {len(anchor)} tensors, the model has {len(params)} trainable"
        )
    for p, a in zip(params, anchor):
        if p.shape != a.shape:
            raise ValueError(f"BLUR anchor shape {tuple(a.shape)} != parameter {tuple(p.shape)}")
    if not params:
        return torch.zeros(())
    if lam == 0.0:
        return torch.zeros((), device=params[0].device, dtype=params[0].dtype)
    sq = torch.zeros((), device=params[0].device, dtype=params[0].dtype)
    for p, a in zip(params, anchor):
        sq = sq + (p - a.detach()).pow(2).sum()
    return 0.5 * lam * torch.clamp(sq - clip_norm**2, min=0.0)
