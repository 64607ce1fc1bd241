"""The canary audit under correlated noise: ``dp_ftrl`` (tree aggregation) and
``dp_bandmf`` (banded matrix factorization).

The estimator and the lower bound are those of :mod:`engine.privacy.audit` (same
Gaussian shift fit, same Clopper–Pearson threshold test at 95 %); two things change.

**Participation.** A canary must be a client the accountant covers, so it obeys the
recipe's participation rule, and it takes the pattern that rule allows that is worst
for privacy (the accountant's own worst case): under epoch passes (``dp_ftrl``) the
first round of every epoch (leaf 1 of every tree, which lies in D(r) = ⌈log₂(r + 1)⌉
released nodes of an epoch of r rounds, the most a leaf can); under b-min-separation
(``dp_bandmf``) rounds 0, b, 2b, … (⌈T/b⌉ rounds, b apart). All K canaries share the
pattern; the held-out directions are scored as if they had it. :meth:`check_covered`
verifies at start-up that the pattern's signal norm does not exceed the sensitivity the
accountant uses.

**Statistic** (``eval.audit_every_round=true``; without it the final-model cosine of
the base audit is used, which is post-processing too). The noise of round t's released
quantity is a linear combination of independent Gaussian draws, so per-round cosines
are neither independent nor the strongest test. Instead the audit keeps, every round,
the projections q_t = D·(x^{t+1} − x^t) of the model change on the 2K directions D and,
at the end, inverts the public server step to get the projected noisy per-round sums
X̂ (up to a constant factor): DP-FTRLM's x^{t+1} = x^{(e)} + η_s·M_t and
M_t = γM_{t−1} + X̃_t/m give X̃_t ∝ P_t − γP_{t−1} with P_t = Σ_{epoch, s ≤ t} q_s and
x̂_t = X̃_t − X̃_{t−1}; BandMF's M_t = γM_{t−1} + (x_t + (C⁻¹Z)_t)/m gives
x̂_t ∝ q_t − γq_{t−1}. It then *whitens* them with the mechanism's own matrix W:

* tree: W's row t sums the rounds of the node ending at leaf t (its span 2^{v₂(t)}), so
  (W·X̂)_t = X̃_t − X̃_{t−2^{v₂(t)}} is that node's value, sum of its rounds' x plus its
  own N(0, z²C²) draw;
* banded: W = C, so W·X̂ = C·X + Z, Z with i.i.d. N(0, z²C²) rows.

Either way the rows of Y = W·X̂ carry independent noise of one scale. A canary in rounds
π moves Y by the signal v = W·1_π times C·u, and the statistic of direction u is the
matched filter vᵀ(Y·u)/‖v‖: Gaussian with the same variance for an inserted and a
held-out direction (the real clients' projected updates add the same spread to both),
its mean moved by C‖v‖ when inserted — the Neyman–Pearson test of this canary, whose
exact privacy is the Gaussian mechanism with multiplier z/‖v‖, never more than the
accountant's z/sensitivity. Why the audit stays a valid lower bound: the canaries are
neighbours the accountant covers (checked), and the statistic is computed from the
released models, public parameters (γ, W, the pattern) and the adversary's own
direction only, i.e. post-processing; the choice of statistic changes the audit's
power, never its validity. As in the base audit the threshold test treats the K
canaries as independent trials (the one-run heuristic).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.privacy import banded_mf
from engine.privacy.audit import (
    CORRELATED_STATISTICS,
    AuditSpec,
    CanaryAudit,
    audit_columns,
    empty_columns,
)

PROJECTION_CHUNK = 256  # directions projected per float64 block


def project(directions: torch.Tensor, vector: torch.Tensor) -> np.ndarray:
    """⟨u_k, v⟩ for every row u_k, in float64 (by blocks of rows, to bound memory)."""
    v = vector.double()
    out = np.empty(directions.shape[0])
    for s in range(0, directions.shape[0], PROJECTION_CHUNK):
        out[s : s + PROJECTION_CHUNK] = (directions[s : s + PROJECTION_CHUNK].double() @ v).numpy()
    return out


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


def decode_momentum(q: np.ndarray, momentum: float) -> np.ndarray:
    """Projected noisy per-round sums (∝) under server momentum x ← x + η_s M,
    M_t = γM_{t−1} + avg_t (M_{−1} = 0): avg_t ∝ q_t − γq_{t−1}."""
    out = q.copy()
    out[1:] -= momentum * q[:-1]
    return out


def matched_filter(w: np.ndarray, sums: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """vᵀ(W·X̂)/‖v‖ per column of ``sums`` (rounds × directions), v = W·pattern."""
    v = w @ pattern
    norm = float(np.linalg.norm(v))
    if norm == 0.0:
        return np.zeros(sums.shape[1])
    return (v @ (w @ sums)) / norm


class CorrelatedCanaryAudit(CanaryAudit):
    """The canary audit of a correlated-noise run (module docstring). ``sampling`` is
    the run's SamplingSpec (mode ``epochs`` or ``bands``), ``momentum`` the server's γ."""

    def __init__(
        self, spec: AuditSpec, initial_weights: torch.Tensor, sampling, momentum: float
    ) -> None:
        super().__init__(spec, initial_weights)
        if sampling.mode not in CORRELATED_STATISTICS or spec.participation != sampling.mode:
            raise ValueError(f"no correlated audit for {sampling.name} participation")
        self.mode = sampling.mode
        self.momentum = float(momentum)
        self.rounds = int(spec.rounds)
        if self.mode == "epochs":
            self.per_epoch = int(sampling.rounds_per_epoch)
            self.period = self.per_epoch  # leaf 1 of every epoch
            self.w = tree_observation(self.rounds, self.per_epoch)
        else:
            c = banded_mf.strategy(int(sampling.horizon), int(sampling.bands))  # the server's C
            self.bands = min(int(sampling.bands), int(sampling.horizon))
            self.period = self.bands  # rounds 0, b, 2b, …: b-min-separated
            self.w = np.array(c[: self.rounds, : self.rounds])
            self.strategy = c
        self.proj = np.full((self.rounds, 2 * spec.canaries), np.nan)
        self.check_covered()

    def pattern(self, rounds: int) -> np.ndarray:
        """1 in the rounds < ``rounds`` every canary takes part in, else 0."""
        return (np.arange(rounds) % self.period == 0).astype(np.float64)

    def check_covered(self) -> None:
        """Raise unless the canaries' participation is one the accountant covers: its
        signal norm ‖W·1_π‖ at most the accounted sensitivity after every round."""
        for t in range(1, self.rounds + 1):
            signal = float(np.linalg.norm(self.w[:t, :t] @ self.pattern(t)))
            if self.mode == "epochs":
                sens = math.sqrt(tree_sensitivity_sq(t, self.per_epoch))
            else:
                sens = banded_mf.sensitivity(self.strategy, t, self.bands)
            if signal > sens * (1 + 1e-9):
                raise RuntimeError(
                    f"canary participation exceeds the accounted sensitivity at round {t}: "
                    f"{signal} > {sens}"
                )

    def sampled(self, rnd: int) -> np.ndarray:
        """Every canary in the pattern's rounds (module docstring), none otherwise."""
        if rnd % self.period == 0:
            return np.arange(self.spec.canaries)
        return np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict:
        return super().state_dict() | {"proj": self.proj.copy()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.proj = np.array(state["proj"], dtype=np.float64)

    def scores(self, rounds: int) -> np.ndarray:
        """The whitened statistic of every direction after ``rounds`` rounds."""
        q = self.proj[:rounds]
        if self.mode == "epochs":
            sums = decode_tree(q, self.per_epoch, self.momentum)
        else:
            sums = decode_momentum(q, self.momentum)
        return matched_filter(self.w[:rounds, :rounds], sums, self.pattern(rounds))

    def observe_round(
        self, rnd: int, before: torch.Tensor, after: torch.Tensor, rounds: int
    ) -> dict:
        if not self.spec.every_round:  # an adversary who sees the final model only
            return super().observe_round(rnd, before, after, rounds)
        self.proj[rnd] = project(self.directions, after - before)
        if rnd + 1 != rounds:
            return empty_columns()
        return audit_columns(self.scores(rounds), self.spec, self.participations)


def make_audit(spec: AuditSpec, initial_weights: torch.Tensor, privatizer, sampling) -> CanaryAudit:
    """The server's audit object for any private recipe: :class:`CanaryAudit` for sampled
    participation, :class:`CorrelatedCanaryAudit` for ``epochs``/``bands`` with the
    server's own momentum γ (``privatizer.momentum``) and sampling spec."""
    if spec.participation == "sampled":
        return CanaryAudit(spec, initial_weights)
    return CorrelatedCanaryAudit(spec, initial_weights, sampling, privatizer.momentum)
