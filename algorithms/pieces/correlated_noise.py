"""Correlated noise: DP-FTRL's privatizer and server step (Kairouz et al., ICML 2021,
"Practical and Private (Deep) Learning without Sampling or Shuffling", arXiv:2103.00039).

The engine's order is unchanged up to the clipped sum: clients clip Δ to C and the
server receives Σ clipped Δ of round t, x_t. Then, instead of noising x_t on its own:

* the server keeps the prefix sum X_t = Σ_{i ≤ t} x_i of the current epoch and releases
  X̃_t = X_t + (tree noise of the online estimator, :class:`OnlineTreeNoise`), divided
  by the public cohort size m;
* the server optimizer is the paper's DP-FTRL with momentum (DP-FTRLM) on the noisy
  prefix sums: M_t = γ·M_{t−1} + X̃_t / m and x^{t+1} = x^{(e)} + η_s·M_t, where x^{(e)}
  is the model at the start of epoch e (Δ points downhill, so + replaces the paper's −
  on gradients). With γ = 0 and no noise this is FedAvg's x^{t+1} = x^t + η_s·x_t/m.
* every epoch restarts the tree, the prefix sum and the momentum from the current model
  (the paper's restarts, Appendix D), so one epoch is one tree.

Privacy: each node of an epoch's tree is the sum of the clipped updates of the rounds
it covers (each client in at most one round per epoch, so sensitivity C per node) plus
N(0, (zC)²); everything the server releases is computed from nodes only. The accounted
event is :meth:`TreeAggregationPrivatizer.dp_event`, one epoch's
``SingleEpochTreeAggregationDpEvent``, composed over the epochs that ran
(``engine.privacy.accounting.EpsilonTracker``). The noise state (the nodes of the
current decomposition) is server-internal and written to checkpoints, so release mode
(``privacy.secure_noise``) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.privacy.banded_mf import BandedNoise
from engine.privacy.mechanism import GaussianMechanism
from engine.privacy.tree_aggregation import OnlineTreeNoise


@dataclass(frozen=True)
class TreeAggregationPrivatizer:
    """Clip each update to C; noise the epoch's prefix sums by tree aggregation (z per
    node); the server steps with DP-FTRLM's momentum γ. Duck-types
    :class:`algorithms.pipeline.GaussianPrivatizer` for clipping (C) and the client
    (noise at the server)."""

    clip_norm: float
    noise_multiplier: float
    momentum: float = 0.9
    site: str = "server"
    noise_support: str = "all"
    adaptive: Any = None
    #: clipping, each node's std z·C, its randomness and the epoch's DpEvent
    mechanism: GaussianMechanism = field(init=False, repr=False, compare=False)
    #: the noise of round t is correlated with earlier rounds' (the server's own step)
    correlated = True

    def __post_init__(self) -> None:
        _check_correlated(self)
        object.__setattr__(
            self,
            "mechanism",
            GaussianMechanism(self.clip_norm, self.noise_multiplier, "server", correlation="tree"),
        )

    @property
    def update_noise_multiplier(self) -> float:
        return self.mechanism.update_noise_multiplier

    def dp_event(self, sampling):
        """One epoch's tree (engine.privacy.accounting.SamplingSpec with mode
        ``epochs``): ``SingleEpochTreeAggregationDpEvent(z, ⌊N/m⌋)``."""
        return self.mechanism.dp_event(sampling)

    def server_state(self, sampling, server_lr: float):
        """The server's DP-FTRLM state for a run (``sampling``: mode ``epochs``)."""
        return TreeFTRL(self, sampling.rounds_per_epoch, sampling.denominator, server_lr)


def _check_correlated(self: Any) -> None:
    """What correlated noise refuses: C ≤ 0, z < 0, momentum outside [0, 1), client
    noise, a restricted support and adaptive clipping."""
    if not self.clip_norm > 0:
        raise ValueError(f"privacy.clip_norm={self.clip_norm!r} must be > 0")
    if not self.noise_multiplier >= 0:
        raise ValueError(f"noise multiplier {self.noise_multiplier!r} must be >= 0")
    if not 0 <= self.momentum < 1:
        raise ValueError(f"algo.momentum={self.momentum!r} must be in [0, 1)")
    if self.site != "server":
        raise ValueError(f"algo.noise_site={self.site!r}: correlated noise is added by the server")
    if self.noise_support != "all":
        raise ValueError(f"noise_support={self.noise_support!r}: correlated noise covers all d")
    if self.adaptive is not None:
        raise ValueError(
            "privacy.clip_mode='adaptive' is not available with correlated noise (its "
            "count release is not accounted with it); use privacy.clip_mode=fixed"
        )


class TreeFTRL:
    """DP-FTRLM's server step on tree-noised prefix sums (module docstring)."""

    def __init__(
        self,
        privatizer: TreeAggregationPrivatizer,
        rounds_per_epoch: int,
        denominator: float,
        server_lr: float,
    ) -> None:
        if denominator <= 0:
            raise ValueError(f"denominator={denominator} must be > 0")
        self.privatizer = privatizer
        self.rounds_per_epoch = int(rounds_per_epoch)
        self.denominator = float(denominator)
        self.server_lr = float(server_lr)
        self.start: torch.Tensor | None = None  # x^{(e)}: the model when the epoch began
        self.prefix: torch.Tensor | None = None  # X_t (float64)
        self.buffer: torch.Tensor | None = None  # M_t (float64)
        self.tree = OnlineTreeNoise()

    def epoch(self, rnd: int) -> int:
        return int(rnd) // self.rounds_per_epoch

    def row_extra(self, rnd: int) -> dict:
        return {"epoch": self.epoch(rnd)}  # the tree (pass) the round was in

    def step(
        self, rnd: int, clipped_sum: torch.Tensor, weights: torch.Tensor, node: torch.Tensor
    ) -> torch.Tensor:
        """Round ``rnd``'s new model (float32) from its clipped sum x_t and its noise
        ``node``: N(0, (zC)² I) from the round's own stream (the server draws it as it
        draws DP-FedAvg's), which is the tree node of level v₂(t) ending at leaf t."""
        if rnd % self.rounds_per_epoch == 0:  # restart: a new tree from the current model
            self.start = weights.clone()
            self.prefix = torch.zeros(clipped_sum.numel(), dtype=torch.float64)
            self.buffer = torch.zeros_like(self.prefix)
            self.tree = OnlineTreeNoise()
        assert self.start is not None and self.prefix is not None and self.buffer is not None
        noise = self.tree.advance(node.double())
        self.prefix = self.prefix + clipped_sum.double()
        noisy = (self.prefix + noise) / self.denominator
        self.buffer = self.privatizer.momentum * self.buffer + noisy
        return self.start + (self.server_lr * self.buffer).to(torch.float32)

    def state_dict(self) -> dict:
        def arr(t: torch.Tensor | None):
            return None if t is None else t.numpy().copy()

        return {
            "start": arr(self.start),
            "prefix": arr(self.prefix),
            "buffer": arr(self.buffer),
            "tree": self.tree.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        import numpy as np

        def tensor(a, dtype):
            return None if a is None else torch.from_numpy(np.array(a, dtype=dtype))

        self.start = tensor(state["start"], np.float32)
        self.prefix = tensor(state["prefix"], np.float64)
        self.buffer = tensor(state["buffer"], np.float64)
        self.tree.load_state_dict(state["tree"])


@dataclass(frozen=True)
class BandedMFPrivatizer:
    """Banded matrix factorization (Choquette-Choo et al., NeurIPS 2023, arXiv:2306.08153):
    clip each update to C; round t's noise is (C⁻¹Z)_t for the run's b-banded strategy
    C (engine.privacy.banded_mf) and Z's row t ~ N(0, (z·C_clip)² I) from the round's
    stream; the server steps with momentum γ on the de-correlated noisy means. The
    accounted event is the Gaussian mechanism C·X + Z with the strategy's sensitivity
    under b-min-separation (:meth:`dp_event`)."""

    clip_norm: float
    noise_multiplier: float
    momentum: float = 0.9
    bands: int = 4
    site: str = "server"
    noise_support: str = "all"
    adaptive: Any = None
    #: clipping, each row's std z·C, its randomness and the run's DpEvent
    mechanism: GaussianMechanism = field(init=False, repr=False, compare=False)
    correlated = True

    def __post_init__(self) -> None:
        _check_correlated(self)
        if not self.bands >= 1:
            raise ValueError(f"algo.bands={self.bands!r} must be >= 1")
        object.__setattr__(
            self,
            "mechanism",
            GaussianMechanism(
                self.clip_norm, self.noise_multiplier, "server", correlation="banded"
            ),
        )

    @property
    def update_noise_multiplier(self) -> float:
        return self.mechanism.update_noise_multiplier

    def dp_event(self, sampling):
        """The whole run: one Gaussian mechanism with multiplier z / sens
        (engine.privacy.accounting.banded_event, for SamplingSpec mode ``bands``)."""
        if sampling.mode != "bands" or sampling.bands != self.bands:
            raise ValueError(
                f"banded noise with {self.bands} bands needs b-min-separation with the same "
                f"bands, not {sampling.name} sampling"
            )
        return self.mechanism.dp_event(sampling)

    def server_state(self, sampling, server_lr: float):
        """The server's state for a run (``sampling``: mode ``bands``)."""
        from engine.privacy.banded_mf import strategy

        c = strategy(sampling.horizon, sampling.bands)
        return BandedServer(
            self, c, min(self.bands, sampling.horizon), sampling.denominator, server_lr
        )


class BandedServer:
    """Server momentum on X + C⁻¹Z: M_t = γ M_{t−1} + (x_t + (C⁻¹Z)_t)/m, x ← x + η_s M_t."""

    def __init__(
        self,
        privatizer: BandedMFPrivatizer,
        c,
        bands: int,
        denominator: float,
        server_lr: float,
    ) -> None:
        self.privatizer = privatizer
        self.noise = BandedNoise(c, bands)
        self.denominator = float(denominator)
        self.server_lr = float(server_lr)
        self.buffer: torch.Tensor | None = None

    def step(
        self, rnd: int, clipped_sum: torch.Tensor, weights: torch.Tensor, node: torch.Tensor
    ) -> torch.Tensor:
        """Round ``rnd``'s model from its clipped sum and Z's row (``node``, N(0, (zC)² I)
        from the round's stream)."""
        if rnd != self.noise.rounds:
            raise RuntimeError(f"round {rnd} after {self.noise.rounds} banded rounds")
        noise = self.noise.advance(node.double())
        avg = (clipped_sum.double() + noise) / self.denominator
        self.buffer = avg if self.buffer is None else self.privatizer.momentum * self.buffer + avg
        return weights + (self.server_lr * self.buffer).to(torch.float32)

    def row_extra(self, rnd: int) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {
            "noise": self.noise.state_dict(),
            "buffer": None if self.buffer is None else self.buffer.numpy().copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        import numpy as np

        self.noise.load_state_dict(state["noise"])
        b = state["buffer"]
        self.buffer = None if b is None else torch.from_numpy(np.array(b, dtype=np.float64))
