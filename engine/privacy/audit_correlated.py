"""The canary audit under correlated noise: any noise scheme whose ``audit_model``
gives an :class:`AuditModel` (the built-in correlated schemes do).

The estimator and the lower bound are those of :mod:`engine.privacy.audit` (same
Gaussian shift fit, same Clopper–Pearson threshold test at 95 %); two things change.

**Participation.** A canary must be a client the accountant covers, so it obeys the
recipe's participation rule, and it takes the pattern that rule allows that is worst
for privacy (the accountant's own worst case): rounds 0, p, 2p, … with the scheme's
period p (epoch passes: the first round of every epoch, leaf 1 of every tree, which
lies in the most released nodes; b-min-separation: every b-th round). All K canaries
share the pattern; the held-out directions are scored as if they had it.
:meth:`CorrelatedCanaryAudit.check_covered` verifies at start-up that the pattern's
signal norm does not exceed the sensitivity the accountant uses.

**Statistic** (``eval.audit_every_round=true``; without it the final-model cosine of
the base audit is used, which is post-processing too). The noise of round t's released
quantity is a linear combination of independent Gaussian draws, so per-round cosines
are neither independent nor the strongest test. Instead the audit keeps, every round,
the projections q_t = D·(x^{t+1} − x^t) of the model change on the 2K directions D and,
at the end, inverts the public server step (the model's ``decode``) to get the
projected noisy per-round sums X̂ (up to a constant factor). It then *whitens* them
with the mechanism's own matrix W, whose rows carry independent noise of one scale (each
row one independent draw, e.g. one node of a tree, or a row of C·X + Z for a
factorization C). A canary in rounds π moves Y = W·X̂ by the signal v = W·1_π times C·u,
and the statistic of direction u is the matched filter vᵀ(Y·u)/‖v‖: Gaussian with the
same variance for an inserted and a held-out direction, its mean moved by C‖v‖ when
inserted — the Neyman–Pearson test of this canary, whose exact privacy is the Gaussian
mechanism with multiplier z/‖v‖, never more than the accountant's z/sensitivity. Why
the audit stays a valid lower bound: the canaries are neighbours the accountant covers
(checked), and the statistic is computed from the released models, public parameters
(γ, W, the pattern) and the adversary's own direction only, i.e. post-processing; the
choice of statistic changes the audit's power, never its validity. As in the base
audit the threshold test treats the K canaries as independent trials.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.privacy.audit import (
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


@dataclass(frozen=True)
class AuditModel:
    """A correlated noise scheme's view for the audit (its ``audit_model``): the canary
    pattern's period (canaries in rounds 0, p, 2p, …: the participation's worst case),
    the observation matrix W (rounds × rounds), the accounted sensitivity (÷ C) after t
    rounds, and the decoding of projected model changes into projected noisy per-round
    sums (the inversion of the public server step)."""

    period: int
    w: np.ndarray
    sensitivity: Callable[[int], float]
    decode: Callable[[np.ndarray], np.ndarray]


class CorrelatedCanaryAudit(CanaryAudit):
    """The canary audit of a correlated-noise run (module docstring), with the noise
    scheme's :class:`AuditModel`."""

    def __init__(self, spec: AuditSpec, initial_weights: torch.Tensor, model: AuditModel) -> None:
        super().__init__(spec, initial_weights)
        if spec.correlated_statistic is None:
            raise ValueError("a correlated audit needs its scheme's statistic")
        self.model = model
        self.rounds = int(spec.rounds)
        self.period = int(model.period)
        self.w = np.array(model.w[: self.rounds, : self.rounds])
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
            sens = self.model.sensitivity(t)
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
        sums = self.model.decode(self.proj[:rounds])
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


def make_audit(
    spec: AuditSpec, initial_weights: torch.Tensor, mechanism: Any, sampling: Any, step: Any
) -> CanaryAudit:
    """The server's audit object for any private recipe: :class:`CanaryAudit`, or
    :class:`CorrelatedCanaryAudit` with the model the mechanism's noise scheme gives for
    the run's participation and server step (``step``: the pipeline's server step piece)."""
    model = mechanism.scheme.audit_model(sampling, step, int(spec.rounds))
    if model is None:
        return CanaryAudit(spec, initial_weights)
    return CorrelatedCanaryAudit(spec, initial_weights, model)
