"""DP-FTRL's tree aggregation (Kairouz et al., ICML 2021, arXiv:2103.00039): the
participation, the noise of the online estimator, and the privacy event.

Participation without sampling (``SamplingSpec(mode="epochs")``): the population of N
clients is split, once per epoch, into R = ⌊N/m⌋ disjoint cohorts of m clients by a
permutation drawn from the run's seed; the N − R·m clients left over sit the epoch
out. So every client contributes to at most one round of an epoch. The privacy
argument does not use the permutation's randomness (any data-independent order is
covered), only that a client appears at most once per tree.

Noise: one binary tree per epoch (restarted at every epoch, as in the paper's
Appendix D). The leaves are the R rounds; node (k, j) covers rounds
[j·2^k + 1, (j + 1)·2^k] (1-based within the epoch) and carries N(0, (zC)² I). The
*online* estimator of the prefix sum after round t adds the nodes of the dyadic
decomposition of [1, t]: one node per set bit k of t. Each of them is the level-v₂(e)
node that ends at some e ≤ t (v₂ = number of trailing zero bits), so only one new node
is needed per round: the node of level v₂(t) ending at t. :class:`OnlineTreeNoise`
draws it from that round's noise stream and keeps the ≤ log₂ R + 1 nodes of the current
decomposition. The honest (Honaker) estimator is not implemented.

Accounting: with sensitivity C per node (a client's clipped update, replaced by the
zero "special" record of the replace-special adjacency) a client's leaf lies in at most
D(R) = ⌈log₂(R + 1)⌉ nodes of its epoch's tree, so one epoch is a Gaussian mechanism of
ℓ₂ sensitivity √D·C and noise zC: dp-accounting's
``SingleEpochTreeAggregationDpEvent(z, R)`` (RDP α·D/(2z²), neighbouring relation
``REPLACE_SPECIAL``). Epochs compose (a client is in every epoch's tree); a partial last
epoch of r rounds is the same event with ``step_counts=r`` (only nodes ending at rounds
≤ r have been released, and a leaf lies in at most D(r) of those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by the methods that use it (the accountant does not)
    import dp_accounting  # the accountant's events only (a client worker never imports it)
    import torch

#: ``SamplingSpec.name`` of epoch participation (the ``sampling`` column).
PARTICIPATION_NAME = "epoch_passes"
ADJACENCY = "replace_special"


def rounds_per_epoch(num_clients: int, cohort_size: int) -> int:
    """R = ⌊N/m⌋ disjoint cohorts of m clients per pass over the population."""
    if not 1 <= cohort_size <= num_clients:
        raise ValueError(f"cohort size {cohort_size} must be in [1, {num_clients}]")
    return num_clients // cohort_size


def epoch_event(noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """One tree of ``steps`` rounds in which each client appears at most once."""
    import dp_accounting

    return dp_accounting.SingleEpochTreeAggregationDpEvent(float(noise_multiplier), int(steps))


def rounds_event(
    epoch: dp_accounting.DpEvent, per_epoch: int, rounds: int
) -> dp_accounting.DpEvent:
    """The event of ``rounds`` rounds: ``rounds // per_epoch`` full trees of ``epoch``
    (a ``SingleEpochTreeAggregationDpEvent`` of ``per_epoch`` steps) composed, then the
    partial last tree, the same event with the rounds it ran."""
    import dp_accounting

    if not isinstance(epoch, dp_accounting.SingleEpochTreeAggregationDpEvent):
        raise TypeError(f"an epoch of tree aggregation is accounted, not {epoch!r}")
    full, rest = divmod(int(rounds), int(per_epoch))
    parts: list[dp_accounting.DpEvent] = []
    if full:
        parts.append(dp_accounting.SelfComposedDpEvent(epoch, full))
    if rest:
        parts.append(epoch_event(epoch.noise_multiplier, rest))
    if not parts:
        return dp_accounting.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


def epoch_cohort(seed: int, rnd: int, num_clients: int, cohort_size: int) -> np.ndarray:
    """The sorted cohort of round ``rnd`` (0-based) under epoch participation: epoch
    e = rnd // R is a permutation of the clients from the seed (stream key
    (SAMPLING, e, 1), distinct from the per-round sampling streams), cut into R
    consecutive blocks of m; round ``rnd`` takes block ``rnd % R``."""
    from engine.privacy import rng as rngs

    per_epoch = rounds_per_epoch(num_clients, cohort_size)
    epoch, pos = divmod(int(rnd), per_epoch)
    order = rngs.numpy_rng(seed, rngs.SAMPLING, epoch, 1).permutation(num_clients)
    block = order[pos * cohort_size : (pos + 1) * cohort_size]
    return np.sort(block).astype(np.int64)


def trailing_zeros(t: int) -> int:
    """v₂(t) for t ≥ 1: the level of the new tree node that ends at leaf t."""
    if t < 1:
        raise ValueError(f"leaf {t} must be >= 1")
    return (t & -t).bit_length() - 1


class OnlineTreeNoise:
    """The online estimator's noise on the prefix sums of one tree.

    :meth:`advance` is called once per leaf with that leaf's fresh node noise (the node
    of level v₂(t) ending at t) and returns the noise of the prefix sum
    Σ_{i ≤ t} x_i: the sum of the nodes of the dyadic decomposition of [1, t]. The
    stack holds those nodes, highest level first; a new node of level k replaces the k
    nodes of levels < k (they are inside it) that end just before t.
    """

    def __init__(self) -> None:
        self.leaves = 0
        self.stack: list[tuple[int, torch.Tensor]] = []  # (level, noise), level decreasing

    def advance(self, node_noise: torch.Tensor) -> torch.Tensor:
        self.leaves += 1
        level = trailing_zeros(self.leaves)
        while self.stack and self.stack[-1][0] < level:
            self.stack.pop()
        self.stack.append((level, node_noise))
        total = node_noise.new_zeros(node_noise.shape)
        for _, n in self.stack:  # highest level first: a fixed summation order
            total = total + n
        return total

    def state_dict(self) -> dict:
        return {
            "leaves": self.leaves,
            "stack": [(k, n.numpy().copy()) for k, n in self.stack],
        }

    def load_state_dict(self, state: dict) -> None:
        import torch

        self.leaves = int(state["leaves"])
        self.stack = [(int(k), torch.from_numpy(np.array(n))) for k, n in state["stack"]]
