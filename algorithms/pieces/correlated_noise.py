"""DP-FTRL's server step arithmetic (:class:`TreeFTRL`): DP-FTRL with momentum on
tree-noised prefix sums. The method — participation, noise scheme, the step's
declaration, recipe and privacy argument — is :mod:`algorithms.dp_ftrl`'s; this module
holds the names the reference parity tests import (``tests/reference``).

Round t's clipped sum x_t and its draw (the tree node of level v₂(t) ending at leaf t,
N(0, (zC)² I)) give X̃_t = X_t + (the online estimator's noise,
:class:`engine.privacy.tree_aggregation.OnlineTreeNoise`), X_t the epoch's prefix sum;
then M_t = γ·M_{t−1} + X̃_t / m and x^{t+1} = x^{(e)} + η_s·M_t, x^{(e)} the model when
epoch e began. Tree, prefix sum and momentum restart every epoch. Everything it returns
is computed from the tree's nodes (post-processing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.privacy import tree_aggregation as tree

if TYPE_CHECKING:
    import torch

#: ``algo.server_momentum`` when null (the paper's DP-FTRLM uses γ = 0.9)
FTRL_MOMENTUM = 0.9


class TreeFTRL:
    """DP-FTRLM's server step on tree-noised prefix sums (a run's
    :class:`algorithms.server_step.ServerStep`); ``piece`` holds γ."""

    def __init__(
        self, piece: Any, rounds_per_epoch: int, denominator: float, server_lr: float
    ) -> None:
        if denominator <= 0:
            raise ValueError(f"denominator={denominator} must be > 0")
        self.momentum = float(piece.momentum)
        self.rounds_per_epoch = int(rounds_per_epoch)
        self.denominator = float(denominator)
        self.server_lr = float(server_lr)
        self.start: torch.Tensor | None = None  # x^{(e)}: the model when the epoch began
        self.prefix: torch.Tensor | None = None  # X_t (float64)
        self.buffer: torch.Tensor | None = None  # M_t (float64)
        self.tree = tree.OnlineTreeNoise()

    def epoch(self, rnd: int) -> int:
        return int(rnd) // self.rounds_per_epoch

    def row(self, rnd: int) -> dict:
        return {"epoch": self.epoch(rnd)}  # the tree (pass) the round was in

    def update(self, rnd: int, weights: torch.Tensor, agg: Any) -> torch.Tensor:
        return self.step(rnd, agg.clipped_sum, weights, agg.noise)

    def step(
        self, rnd: int, clipped_sum: torch.Tensor, weights: torch.Tensor, node: torch.Tensor
    ) -> torch.Tensor:
        """Round ``rnd``'s new model (float32) from its clipped sum x_t and its draw
        ``node`` (N(0, (zC)² I)), the tree node of level v₂(t) ending at leaf t."""
        import torch

        if rnd % self.rounds_per_epoch == 0:  # restart: a new tree from the current model
            self.start = weights.clone()
            self.prefix = torch.zeros(clipped_sum.numel(), dtype=torch.float64)
            self.buffer = torch.zeros_like(self.prefix)
            self.tree = tree.OnlineTreeNoise()
        assert self.start is not None and self.prefix is not None and self.buffer is not None
        noise = self.tree.advance(node.double())
        self.prefix = self.prefix + clipped_sum.double()
        noisy = (self.prefix + noise) / self.denominator
        self.buffer = self.momentum * self.buffer + noisy
        return self.start + (self.server_lr * self.buffer).to(torch.float32)

    def state_dict(self) -> dict:
        def arr(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.numpy().copy()

        return {
            "start": arr(self.start),
            "prefix": arr(self.prefix),
            "buffer": arr(self.buffer),
            "tree": self.tree.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        import torch

        def tensor(a: Any, dtype: Any) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.array(a, dtype=dtype))

        self.start = tensor(state["start"], np.float32)
        self.prefix = tensor(state["prefix"], np.float64)
        self.buffer = tensor(state["buffer"], np.float64)
        self.tree.load_state_dict(state["tree"])

    def public(self) -> dict:
        return {}


@dataclass(frozen=True)
class TreeAggregationPrivatizer:
    """dp_ftrl's clip norm C, z and momentum γ in one object (the reference parity
    tests' spelling; a pipeline holds a privatizer with tree noise and an
    :class:`algorithms.dp_ftrl.FTRLStep`)."""

    clip_norm: float
    noise_multiplier: float
    momentum: float = FTRL_MOMENTUM
