"""The arithmetic of DP-FTRL's tree aggregation (Kairouz et al., ICML 2021,
arXiv:2103.00039); the method, its participation, noise scheme, server step and privacy
argument are :mod:`algorithms.dp_ftrl`'s.

* :func:`epoch_cohort`: each epoch a permutation of the N clients from the seed, cut into
  R = ⌊N/m⌋ disjoint cohorts of m (a client in at most one round per epoch);
* :class:`OnlineTreeNoise`: one binary tree per epoch whose leaves are the R rounds;
  node (k, j) covers rounds [j·2^k + 1, (j + 1)·2^k] (1-based within the epoch) and
  carries N(0, (zC)² I); the online estimator's noise after round t is the sum of the
  nodes of the dyadic decomposition of [1, t], one per set bit of t, and the one new node
  a round needs is the node of level v₂(t) ending at t (v₂: trailing zero bits). The
  honest (Honaker) estimator is not implemented;
* :func:`epoch_event`, :func:`rounds_event`: a client's leaf lies in at most
  D(R) = ⌈log₂(R + 1)⌉ nodes of its epoch's tree, so an epoch is dp-accounting's
  ``SingleEpochTreeAggregationDpEvent(z, R)`` (RDP α·D/(2z²), replace-special); epochs
  compose, a partial last epoch of r rounds is the same event with r steps;
* :func:`tree_observation`, :func:`tree_sensitivity_sq`, :func:`decode_tree`: the canary
  audit's view of the tree (engine.privacy.audit_correlated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported by the methods that use it (the accountant does not)
    import dp_accounting  # the accountant's events only (a client worker never imports it)
    import torch

#: The ``sampling`` column of epoch participation.
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


def tree_observation(rounds: int, per_epoch: int) -> np.ndarray:
    """W (rounds × rounds) of tree aggregation: row t has ones on the rounds of the node
    that ends at round t (1-based leaf ℓ of its epoch: the last 2^{v₂(ℓ)} leaves)."""
    w = np.zeros((rounds, rounds))
    for t in range(rounds):
        leaf = t % per_epoch + 1
        span = leaf & -leaf
        w[t, t - span + 1 : t + 1] = 1.0
    return w


def tree_sensitivity_sq(rounds: int, per_epoch: int) -> int:
    """Σ over the epochs run of D(r) = ⌈log₂(r + 1)⌉: the squared sensitivity (÷ C) of
    all nodes released after ``rounds`` rounds, as the accountant composes them."""
    full, rest = divmod(int(rounds), int(per_epoch))
    depth = (per_epoch).bit_length()  # ⌈log₂(R + 1)⌉ = bit length of R
    return full * depth + (rest.bit_length() if rest else 0)


def decode_tree(q: np.ndarray, per_epoch: int, momentum: float) -> np.ndarray:
    """Projected noisy per-round sums x̂ (∝, rows = rounds) from projected model changes
    under DP-FTRLM: per epoch, P = cumsum(q) ∝ M, X̃_t ∝ M_t − γM_{t−1}, x̂_t = X̃_t − X̃_{t−1}."""
    out = np.empty_like(q)
    for s in range(0, q.shape[0], per_epoch):
        m = np.cumsum(q[s : s + per_epoch], axis=0)
        prefix = m.copy()
        prefix[1:] -= momentum * m[:-1]
        out[s : s + per_epoch] = np.diff(prefix, axis=0, prepend=0.0)
    return out


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
