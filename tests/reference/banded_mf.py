"""Independent reference of DP-BandMF's noise and server step (imports nothing from dpfl).

From Choquette-Choo et al., "(Amplified) Banded Matrix Factorization" (NeurIPS 2023,
arXiv:2306.08153): the mechanism releases C·X + Z for a lower-triangular strategy C
(here given as input: a public matrix), and training uses X̂ = C⁻¹(C·X + Z), computed
here as one dense solve over all rounds' noise at once (dpfl substitutes forward, round by
round). The server takes momentum steps on X̂/m. Randomness (cohorts, minibatch orders,
the rows of Z) is input, as in ``methods.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tests.reference.common import DT, Problem, clip, flat, shapes, unflat
from tests.reference.methods import Setting, local_train


def run_dp_bandmf(
    s: Setting,
    prob: Problem,
    init: list[np.ndarray],
    cohorts: list[np.ndarray],
    orders: Callable[[int, int], Iterator[np.ndarray]],
    noise: Callable[[int], np.ndarray],
    strategy: np.ndarray,
    momentum: float,
) -> np.ndarray:
    """``s.rounds`` rounds; ``noise(r)`` is Z's row r divided by z·C (standard normal)."""
    x = torch.as_tensor(prob.x, dtype=DT)
    y = torch.as_tensor(prob.y)
    w = [torch.as_tensor(a, dtype=DT) for a in init]
    d = sum(math.prod(t) for t in shapes(s.model, prob.dim, prob.num_classes))
    z_all = np.stack([noise(r) for r in range(s.rounds)]) * s.z * s.clip
    correlated = torch.as_tensor(np.linalg.solve(strategy[: s.rounds, : s.rounds], z_all))
    m_buf = torch.zeros(d, dtype=DT)
    assert s.denominator is not None
    for r in range(s.rounds):
        x_t = flat(w)
        total = torch.zeros(d, dtype=DT)
        for i in [int(c) for c in cohorts[r]]:
            w_i, _ = local_train(
                s, w, x, y, prob.client_train[i], lambda i=i, r=r: orders(r, i), s.lr, None, None
            )
            total += clip(flat(w_i) - x_t, s.clip)
        m_buf = momentum * m_buf + (total + correlated[r]) / s.denominator
        w = unflat(x_t + s.server_lr * m_buf, w)
    return flat(w).numpy()
