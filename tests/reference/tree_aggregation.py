"""Independent reference of DP-FTRL with tree aggregation (imports nothing from dpfl).

Written from Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private
(Deep) Learning without Sampling or Shuffling" (ICML 2021, arXiv:2103.00039):

* the tree over the leaves 1..R of one epoch: node (k, j) covers [j·2^k + 1, (j+1)·2^k]
  and holds the sum of those leaves plus its own Gaussian noise;
* the online estimate of the prefix sum Σ_{i ≤ t} x_i is the sum of the nodes of the
  dyadic decomposition of [1, t] (one node per 1-bit of t, from the highest bit down);
* DP-FTRLM (Algorithm 1 with momentum): M_t = γ M_{t−1} + S̃_t and θ_{t+1} = θ_0 − η M_t
  (here Δ are model deltas, so + instead of −), restarted every epoch (Appendix D).

The prefix estimate is recomputed from the decomposition at every round (no
incremental state), which is how the equations read; dpfl keeps a stack instead.
Randomness (cohorts, minibatch orders, node noise) is input, as in ``methods.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tests.reference.common import DT, Problem, clip, flat, shapes, unflat
from tests.reference.methods import Setting, local_train


def dyadic_nodes(t: int) -> list[tuple[int, int]]:
    """The nodes (k, j) of the dyadic decomposition of [1, t], highest level first:
    for each 1-bit k of t (from the top), the block of 2^k leaves after those taken."""
    out, start = [], 0
    for k in range(t.bit_length() - 1, -1, -1):
        if t >> k & 1:
            out.append((k, start >> k))
            start += 1 << k
    assert start == t
    return out


def node_span(k: int, j: int) -> tuple[int, int]:
    """Leaves [first, last] (1-based) that node (k, j) covers."""
    return j * 2**k + 1, (j + 1) * 2**k


def prefix_noise(t: int, node: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """Noise of the online estimate after leaf t: Σ over the decomposition's nodes."""
    parts = [node(k, j) for k, j in dyadic_nodes(t)]
    total = torch.zeros_like(parts[0])
    for p in parts:
        total = total + p
    return total


def run_dp_ftrl(
    s: Setting,
    prob: Problem,
    init: list[np.ndarray],
    cohorts: list[np.ndarray],
    orders: Callable[[int, int], Iterator[np.ndarray]],
    noise: Callable[[int], np.ndarray],
    rounds_per_epoch: int,
    momentum: float,
    restart: bool = True,
) -> np.ndarray:
    """DP-FTRLM for ``s.rounds`` rounds; returns the final flat model.

    ``noise(r)`` is a standard normal vector; node (k, j) of the tree of epoch e is
    z·C·noise(r) for r the 0-based round at which the node's last leaf is played
    (round e·R + last − 1). ``restart=False`` (an ablation) keeps one tree, one prefix
    sum and one momentum buffer for the whole run."""
    x = torch.as_tensor(prob.x, dtype=DT)
    y = torch.as_tensor(prob.y)
    w = [torch.as_tensor(a, dtype=DT) for a in init]
    d = sum(math.prod(t) for t in shapes(s.model, prob.dim, prob.num_classes))
    theta0 = flat(w)
    leaves: list[torch.Tensor] = []  # x_1..x_t of the current tree
    m_buf = torch.zeros(d, dtype=DT)
    tree_start = 0  # 0-based round of the current tree's first leaf
    for r in range(s.rounds):
        if restart and r % rounds_per_epoch == 0:
            theta0, leaves, m_buf, tree_start = flat(w), [], torch.zeros(d, dtype=DT), r
        x_t = flat(w)
        lr = s.lr * s.lr_decay**r
        total = torch.zeros(d, dtype=DT)
        for i in [int(c) for c in cohorts[r]]:
            w_i, _ = local_train(
                s, w, x, y, prob.client_train[i], lambda i=i, r=r: orders(r, i), lr, None, None
            )
            total += clip(flat(w_i) - x_t, s.clip)
        leaves.append(total)
        t = len(leaves)

        def node(k: int, j: int, base: int = tree_start, leaves=leaves) -> torch.Tensor:
            first, last = node_span(k, j)
            value = sum(leaves[first - 1 : last], torch.zeros(d, dtype=DT))
            xi = torch.as_tensor(noise(base + last - 1), dtype=DT)
            return value + s.z * s.clip * xi

        s_tilde = torch.zeros(d, dtype=DT)
        for k, j in dyadic_nodes(t):
            s_tilde = s_tilde + node(k, j)
        assert s.denominator is not None
        m_buf = momentum * m_buf + s_tilde / s.denominator
        w = unflat(theta0 + s.server_lr * m_buf, w)
    return flat(w).numpy()
