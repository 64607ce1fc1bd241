"""Banded matrix factorization (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta,
Xu, "(Amplified) Banded Matrix Factorization: A unified approach to private training",
NeurIPS 2023, arXiv:2306.08153): the strategy, its sensitivity, and the noise.

Workload: A = the n×n lower-triangular matrix of ones (prefix sums of the rounds' clipped
sums x_1..x_n). Strategy: C, lower triangular and b-banded (C[i, j] = 0 unless
0 ≤ i − j < b), with unit-norm columns. The mechanism releases C·X + Z, Z with i.i.d.
N(0, z²C_clip²) entries; the server uses X̂ = C⁻¹(C·X + Z) = X + C⁻¹Z, so round t's
update carries the noise (C⁻¹Z)_t, correlated with the b − 1 rounds before it
(:class:`BandedNoise`, forward substitution). Everything released is post-processing of
C·X + Z.

Sensitivity under b-min-separation (each client in at most one of any b consecutive
rounds): columns i and j of a b-banded C with |i − j| ≥ b have disjoint row supports, so
for a client taking part in the set π of rounds, ‖C·(X − X')‖_F² = Σ_{i∈π} ‖C[:, i]‖²·‖δ_i‖²
≤ C_clip² Σ_{i∈π} ‖C[:, i]‖² (δ_i its clipped update, zero in the neighbour). The
sensitivity (÷ C_clip) is the square root of the largest Σ ‖C[:, i]‖² over b-separated π,
found exactly by dynamic programming (:func:`sensitivity`) from the matrix actually used;
after t rounds only the first t rows are released, so C[:t, :t] is used. The mechanism is
then one Gaussian mechanism with noise multiplier z / sens (:func:`gaussian_event`).

The strategy minimises the paper's objective for this workload, ‖A C⁻¹‖_F² with unit
column norms, over the band's entries (L-BFGS in float64, from the banded Toeplitz square
root of A), and is cached on disk by (rounds, bands) next to the calibration store.
"""

from __future__ import annotations

import hashlib
import math
import os
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from engine.base.atomic import atomic_write
from engine.privacy import calibration_store

if TYPE_CHECKING:  # the accountant's event only: a client worker never imports dp_accounting
    import dp_accounting

#: bump when the optimisation changes (cached strategies are keyed by it)
STRATEGY_VERSION = 1
LBFGS_ITERATIONS = 200
PARTICIPATION_NAME = "b_min_separation"


def check_banded(c: np.ndarray, bands: int) -> None:
    """Raise ValueError unless ``c`` is square, finite, lower triangular, ``bands``-banded
    with a positive diagonal (so invertible by forward substitution)."""
    n = c.shape[0]
    if c.ndim != 2 or c.shape != (n, n) or not np.isfinite(c).all():
        raise ValueError(f"a banded strategy must be a finite square matrix, got {c.shape}")
    i, j = np.indices(c.shape)
    outside = (i - j < 0) | (i - j >= bands)
    if np.any(c[outside] != 0):
        raise ValueError(f"the strategy is not lower triangular with {bands} bands")
    if np.any(np.diag(c) <= 0):
        raise ValueError("the strategy's diagonal must be positive")


def toeplitz_sqrt(n: int, bands: int) -> np.ndarray:
    """The banded Toeplitz square root of A (c_k = binom(2k, k)/4^k for k < b), columns
    scaled to unit norm: the optimisation's starting point."""
    coef = np.ones(min(bands, n))
    for k in range(1, len(coef)):
        coef[k] = coef[k - 1] * (2 * k - 1) / (2 * k)
    c = np.zeros((n, n))
    for k, v in enumerate(coef):
        c += np.diag(np.full(n - k, v), -k)
    return c / np.linalg.norm(c, axis=0)


def workload_loss(c: np.ndarray) -> float:
    """‖A C⁻¹‖_F² for A the prefix-sum workload (the paper's objective)."""
    n = c.shape[0]
    a = np.tril(np.ones((n, n)))
    b = np.linalg.solve(c.T, a.T).T
    return float((b**2).sum())


def optimize_strategy(n: int, bands: int, iterations: int = LBFGS_ITERATIONS) -> np.ndarray:
    """A b-banded, unit-column-norm C minimising ‖A C⁻¹‖_F² (float64, torch L-BFGS)."""
    import torch

    bands = max(1, min(int(bands), int(n)))
    init = toeplitz_sqrt(n, bands)
    rows = torch.tensor([i for k in range(bands) for i in range(k, n)])
    cols = torch.tensor([i - k for k in range(bands) for i in range(k, n)])
    theta = torch.tensor(init[rows.numpy(), cols.numpy()], dtype=torch.float64)
    theta.requires_grad_(True)
    a = torch.tril(torch.ones(n, n, dtype=torch.float64))

    def build(t: torch.Tensor) -> torch.Tensor:
        c = torch.zeros(n, n, dtype=torch.float64).index_put((rows, cols), t)
        return c / torch.linalg.vector_norm(c, dim=0)

    def loss() -> torch.Tensor:
        c = build(theta)
        b = torch.linalg.solve_triangular(c, a, upper=False, left=False)  # B C = A
        return (b**2).sum()

    if bands > 1:
        opt = torch.optim.LBFGS(
            [theta], max_iter=iterations, history_size=20, line_search_fn="strong_wolfe"
        )

        def closure() -> torch.Tensor:
            opt.zero_grad()
            value = loss()
            value.backward()
            return value

        opt.step(closure)
    with torch.no_grad():
        c = build(theta).numpy()
    if not workload_loss(c) <= workload_loss(init):  # never worse than the start
        c = init
    c = np.where(np.tril(np.ones((n, n))) * np.triu(np.ones((n, n)), -(bands - 1)) > 0, c, 0.0)
    check_banded(c, bands)
    return c


def _cache_file(n: int, bands: int) -> str | None:
    folder = calibration_store.store_dir()
    if folder is None:
        return None
    key = f"bandmf|n={n}|b={bands}|v={STRATEGY_VERSION}|it={LBFGS_ITERATIONS}"
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    return str(folder.parent / "strategies" / f"{name}.npy")


@lru_cache(maxsize=16)
def strategy(n: int, bands: int) -> np.ndarray:
    """The run's strategy for ``n`` rounds and ``bands`` bands (read-only): from the disk
    cache when present and valid, else optimised and cached. A cached matrix is checked
    (banded, lower triangular, positive diagonal) before use; the sensitivity is always
    computed from the matrix returned, so the accounting never trusts the cache."""
    bands = max(1, min(int(bands), int(n)))
    path = _cache_file(n, bands)
    c = None
    if path is not None and os.path.exists(path):
        try:
            c = np.load(path)
            check_banded(c, bands)
            if c.shape != (n, n):
                c = None
        except (OSError, ValueError):
            c = None
    if c is None:
        c = optimize_strategy(n, bands)
        if path is not None:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with atomic_write(path, suffix=".npy", unique=True) as tmp:
                    np.save(tmp, c)
            except OSError:
                pass
    c = np.array(c, dtype=np.float64)
    c.flags.writeable = False
    return c


def sensitivity(c: np.ndarray, rounds: int, bands: int) -> float:
    """max over b-separated participation sets π ⊆ [0, rounds) of √(Σ_{i∈π} ‖C[:rounds, i]‖²),
    exact by dynamic programming; valid because columns ≥ b apart have disjoint supports
    in a b-banded C (checked)."""
    check_banded(c, bands)
    t = int(rounds)
    w = (np.asarray(c[:t, :t]) ** 2).sum(axis=0)
    best = np.zeros(t + 1)  # best[i]: the largest sum over π ⊆ [0, i)
    for i in range(1, t + 1):
        take = w[i - 1] + best[max(0, i - bands)]
        best[i] = max(best[i - 1], take)
    return math.sqrt(best[t])


def max_participations(rounds: int, bands: int) -> int:
    """⌈rounds / b⌉: the most rounds a b-min-separated client can be in."""
    return -(-int(rounds) // int(bands))


def gaussian_event(noise_multiplier: float, sens: float) -> dp_accounting.DpEvent:
    """C·X + Z with Z ~ N(0, z²C_clip²) and ℓ₂ sensitivity sens·C_clip: one Gaussian
    mechanism with noise multiplier z / sens."""
    import dp_accounting

    if sens <= 0:
        return dp_accounting.NoOpDpEvent()
    return dp_accounting.GaussianDpEvent(float(noise_multiplier) / float(sens))


def group_cohort(seed: int, rnd: int, num_clients: int, cohort_size: int, bands: int) -> np.ndarray:
    """Round ``rnd``'s cohort under b-min-separation: the clients, permuted once from the
    seed (stream (SAMPLING, 0, 2)), are dealt into b groups; round t draws from group
    t mod b only, the next m clients of that group in a cycle. A client is therefore in
    at most one of any b consecutive rounds. Needs m ≤ ⌊N/b⌋."""
    from engine.privacy import rng as rngs

    if not 1 <= cohort_size <= num_clients // bands:
        raise ValueError(
            f"cohort size {cohort_size} must be in [1, N/bands = {num_clients // bands}]"
        )
    order = rngs.numpy_rng(seed, rngs.SAMPLING, 0, 2).permutation(num_clients)
    group = order[int(rnd) % bands :: bands]
    start = (int(rnd) // bands) * cohort_size
    picks = (start + np.arange(cohort_size)) % len(group)
    return np.sort(group[picks]).astype(np.int64)


class BandedNoise:
    """Round t's noise (C⁻¹Z)_t from Z's row t, by forward substitution over the b − 1
    previous outputs (kept as state)."""

    def __init__(self, c: np.ndarray, bands: int) -> None:
        self.c = c
        self.bands = int(bands)
        self.rounds = 0
        self.history: list = []  # the last b − 1 outputs, oldest first

    def advance(self, z_row):
        t = self.rounds
        out = z_row.clone()
        for k, prev in enumerate(reversed(self.history), start=1):  # prev = output t − k
            coef = float(self.c[t, t - k])
            if coef != 0.0:
                out = out - coef * prev
        out = out / float(self.c[t, t])
        self.history.append(out)
        if len(self.history) > self.bands - 1:
            self.history.pop(0)
        self.rounds += 1
        return out

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "history": [h.numpy().copy() for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        import torch

        self.rounds = int(state["rounds"])
        self.history = [torch.from_numpy(np.array(h)) for h in state["history"]]
