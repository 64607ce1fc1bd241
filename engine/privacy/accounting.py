"""Client-level privacy accounting with ``dp-accounting``: the DpEvents and ε(σ).

Unit of privacy: one client (all of its data). The neighbouring relation follows
the sampling actually used:

* ``poisson`` — each client joins a round independently with probability q;
  add/remove-one adjacency; one round is ``PoissonSampledDpEvent(q, Gaussian(z))``.
  Accounted by RDP (default) or PLD.
* ``poisson`` with a hard cap ``max_cohort`` — truncated Poisson (a random subset
  of size ``max_cohort`` is kept when more clients are drawn):
  ``TruncatedSubsampledGaussianDpEvent``; PLD only.
* ``fixed`` — ``m`` clients without replacement; replace-one adjacency. The clipped
  sum then has sensitivity 2C while dp-accounting's ``SampledWithoutReplacement``
  RDP assumes C (library issue #378), so the Gaussian inside the event is given
  ``z / 2``: sound but far looser than Poisson. RDP only.
* ``epochs`` — participation without sampling (DP-FTRL, ``engine.privacy.tree_aggregation``):
  each epoch is a pass over the population in ⌊N/m⌋ disjoint cohorts of m clients, with
  one tree of noise per epoch; replace-special adjacency; an epoch is
  ``SingleEpochTreeAggregationDpEvent(z, ⌊N/m⌋)`` and epochs compose. RDP only.
* ``bands`` — b-min-separation (banded matrix factorization, ``engine.privacy.banded_mf``):
  each client in at most one of any b consecutive rounds; the rounds so far are one
  Gaussian mechanism with multiplier z / sens, sens the strategy's sensitivity.

ε is never assumed: every figure comes from the event built from the noise
multiplier, sampling and number of rounds actually used. Turning a budget into z (or
δ) is :mod:`engine.privacy.resolve`'s, with the same events.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant

from engine.privacy import banded_mf, calibration_store
from engine.privacy import tree_aggregation as tree

logging.getLogger("absl").setLevel(logging.ERROR)

PLD_REPORT_DISCRETIZATION = 1e-4
PLD_MIN_Z = 0.3  # below this a PLD needs gigabytes; use RDP there


@dataclass(frozen=True)
class SamplingSpec:
    """Public facts about how cohorts are drawn, as the accountant needs them."""

    mode: str  # "poisson" | "fixed" | "epochs" | "bands"
    num_clients: int
    rate: float | None = None  # poisson
    cohort_size: int | None = None  # fixed, epochs, bands
    max_cohort: int | None = None  # poisson with a hard cap (truncated Poisson)
    bands: int | None = None  # bands: b (each client in at most one of b consecutive rounds)
    horizon: int | None = None  # bands: the rounds the strategy was built for

    def __post_init__(self) -> None:
        if self.mode not in ("poisson", "fixed", "epochs", "bands"):
            raise ValueError(f"sampling.mode={self.mode!r} must be poisson, fixed, epochs or bands")
        if self.mode == "poisson" and not (self.rate is not None and 0 < self.rate <= 1):
            raise ValueError(f"sampling.rate={self.rate!r} must be in (0, 1]")
        if self.mode == "bands":
            b, n = self.bands, self.num_clients
            if not (b is not None and b >= 1 and self.horizon is not None and self.horizon >= 1):
                raise ValueError(f"algo.bands={b!r} must be >= 1 (and the rounds known)")
            if not (self.cohort_size is not None and 1 <= self.cohort_size <= n // b):
                raise ValueError(
                    f"cohort size {self.cohort_size!r} must be in [1, N/bands = {n // b}] "
                    f"(b-min-separation deals the {n} clients into {b} groups)"
                )
        if self.mode in ("fixed", "epochs") and not (
            self.cohort_size is not None and 1 <= self.cohort_size <= self.num_clients
        ):
            raise ValueError(
                f"sampling.cohort_size={self.cohort_size!r} must be in [1, {self.num_clients}]"
            )

    @property
    def adjacency(self) -> str:
        if self.mode in ("epochs", "bands"):
            return tree.ADJACENCY
        return "replace_one" if self.mode == "fixed" else "add_remove"

    @property
    def name(self) -> str:
        if self.mode == "epochs":
            return tree.PARTICIPATION_NAME
        if self.mode == "bands":
            return banded_mf.PARTICIPATION_NAME
        if self.mode == "fixed":
            return "fixed_without_replacement"
        return "truncated_poisson" if self.max_cohort is not None else "poisson"

    @property
    def effective_rate(self) -> float:
        """Sampling probability of one client in one round (public); under ``epochs``
        the fraction of the population in one round's cohort (m/N, not a sampling
        probability: participation is a fixed pass, and nothing is amplified)."""
        if self.mode in ("fixed", "epochs", "bands"):
            assert self.cohort_size is not None
            return self.cohort_size / self.num_clients
        assert self.rate is not None
        return self.rate

    @property
    def denominator(self) -> float:
        """The fixed, public divisor of the noisy sum: m, or the expected q·N."""
        if self.mode in ("fixed", "epochs", "bands"):
            assert self.cohort_size is not None
            return float(self.cohort_size)
        assert self.rate is not None
        return self.rate * self.num_clients

    @property
    def rounds_per_epoch(self) -> int:
        """R = ⌊N/m⌋ rounds per pass over the population (``epochs`` only)."""
        assert self.mode == "epochs" and self.cohort_size is not None
        return tree.rounds_per_epoch(self.num_clients, self.cohort_size)

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        """dp-accounting's relation for this sampling's adjacency."""
        if self.mode in ("epochs", "bands"):
            return dp_accounting.NeighboringRelation.REPLACE_SPECIAL
        if self.mode == "fixed":
            return dp_accounting.NeighboringRelation.REPLACE_ONE
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

    def default_accountant(self) -> str:
        return "pld" if self.max_cohort is not None else "rdp"

    def check_accountant(self, accountant: str) -> None:
        if self.max_cohort is not None and accountant != "pld":
            raise ValueError(
                f"privacy.accountant={accountant!r}: sampling.max_cohort is accounted as "
                "truncated Poisson, which only the PLD accountant supports"
            )
        if self.mode == "fixed" and accountant != "rdp":
            raise ValueError(
                f"privacy.accountant={accountant!r}: fixed-size sampling is supported only "
                "by the RDP accountant"
            )
        if self.mode == "epochs" and accountant != "rdp":
            raise ValueError(
                f"privacy.accountant={accountant!r}: tree aggregation (epoch participation) "
                "is accounted by the RDP accountant only"
            )


def round_event(noise_multiplier: float, spec: SamplingSpec) -> dp_accounting.DpEvent:
    """The DpEvent of one round of clipped-sum + Gaussian noise N(0, (zC)^2)."""
    z = float(noise_multiplier)
    if spec.mode in ("epochs", "bands"):
        raise ValueError(
            f"{spec.name} participation (correlated noise) has no per-round event: use run_event"
        )
    if spec.mode == "fixed":
        # Replace-one sensitivity of a clipped sum is 2C; the library's WOR RDP assumes
        # C, so the Gaussian is described with half the multiplier (sound).
        assert spec.cohort_size is not None
        return dp_accounting.SampledWithoutReplacementDpEvent(
            spec.num_clients, spec.cohort_size, dp_accounting.GaussianDpEvent(z / 2.0)
        )
    assert spec.rate is not None
    if spec.max_cohort is not None:
        return dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=spec.num_clients,
            sampling_probability=spec.rate,
            truncated_batch_size=spec.max_cohort,
            noise_multiplier=z,
        )
    return dp_accounting.PoissonSampledDpEvent(spec.rate, dp_accounting.GaussianDpEvent(z))


def run_event(noise_multiplier: float, spec: SamplingSpec, rounds: int) -> dp_accounting.DpEvent:
    """The DpEvent of ``rounds`` rounds: the round event self-composed, or under
    ``epochs`` the epochs' trees composed (:func:`tree_aggregation.rounds_event`)."""
    if spec.mode == "epochs":
        per_epoch = spec.rounds_per_epoch
        epoch = tree.epoch_event(noise_multiplier, per_epoch)
        return tree.rounds_event(epoch, per_epoch, rounds)
    if spec.mode == "bands":
        return banded_event(noise_multiplier, spec, rounds)
    return dp_accounting.SelfComposedDpEvent(round_event(noise_multiplier, spec), rounds)


def banded_event(noise_multiplier: float, spec: SamplingSpec, rounds: int) -> dp_accounting.DpEvent:
    """The first ``rounds`` rows of C·X + Z for the run's banded strategy: one Gaussian
    with multiplier z / sens (:mod:`engine.privacy.banded_mf`)."""
    assert spec.mode == "bands" and spec.bands is not None and spec.horizon is not None
    if not 0 <= rounds <= spec.horizon:
        raise ValueError(f"rounds={rounds} beyond the strategy's {spec.horizon} rounds")
    c = banded_mf.strategy(spec.horizon, spec.bands)
    bands = min(spec.bands, spec.horizon)
    return banded_mf.gaussian_event(noise_multiplier, banded_mf.sensitivity(c, rounds, bands))


def unit_event(noise_multiplier: float, spec: SamplingSpec) -> dp_accounting.DpEvent:
    """The event :class:`EpsilonTracker` composes: one round's, one epoch's tree under
    ``epochs``, or the whole planned strategy under ``bands``."""
    if spec.mode == "epochs":
        return tree.epoch_event(noise_multiplier, spec.rounds_per_epoch)
    if spec.mode == "bands":
        assert spec.horizon is not None
        return banded_event(noise_multiplier, spec, spec.horizon)
    return round_event(noise_multiplier, spec)


def make_accountant(
    accountant: str, spec: SamplingSpec, discretization: float = PLD_REPORT_DISCRETIZATION
) -> dp_accounting.PrivacyAccountant:
    relation = spec.neighboring_relation
    if accountant == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation)
    if accountant == "pld":
        return pld.PLDAccountant(
            neighboring_relation=relation, value_discretization_interval=discretization
        )
    raise ValueError(f"privacy.accountant={accountant!r} must be rdp or pld")


#: One round's RDP curve per (event, adjacency), kept for the life of the process.
_ONE_ROUND_RDP: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_ONE_ROUND_RDP_MAX = 1024  # ~2.5 MB of curves at most


def one_round_rdp(
    event: dp_accounting.DpEvent, spec: SamplingSpec
) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, RDP of one round)`` of ``event`` under ``spec``'s adjacency.

    dp-accounting's RDP accountant composes ``count`` rounds as ``0 + count · rdp₁``
    with rdp₁ computed over ~150 orders (0.06 s), and a run asks for the same event
    several times: calibration's check, the plan, the server's tracker, and every trial
    of a sweep at a fixed ε. rdp₁ is therefore computed once per process, by the
    library (``RdpAccountant.compose(event, 1)``), and ``count · rdp₁`` is the
    library's own arithmetic, so ε is bit for bit what a fresh accountant gives
    (tested). The key is the event's repr, which spells every field (floats exactly).
    """
    key = f"{spec.adjacency}|{event!r}"
    hit = _ONE_ROUND_RDP.get(key)
    if hit is None:
        acc = make_accountant("rdp", spec)
        acc.compose(event, 1)
        orders = np.array(acc._orders, dtype=float)  # noqa: SLF001
        rdp1 = np.array(acc._rdp, dtype=float)  # noqa: SLF001
        orders.flags.writeable = rdp1.flags.writeable = False
        if len(_ONE_ROUND_RDP) >= _ONE_ROUND_RDP_MAX:
            _ONE_ROUND_RDP.clear()
        hit = _ONE_ROUND_RDP[key] = (orders, rdp1)
    return hit


def forget_remembered() -> None:
    """Drop this process's remembered RDP curves and calibrations (the disk store
    stays); for benchmarks that time a cold start."""
    _ONE_ROUND_RDP.clear()
    calibration_store.forget_in_process()


def compute_epsilon(
    noise_multiplier: float,
    spec: SamplingSpec,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    discretization: float = PLD_REPORT_DISCRETIZATION,
) -> float:
    """ε after ``rounds`` rounds of the mechanism described by (z, spec)."""
    spec.check_accountant(accountant)
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    if accountant == "pld" and noise_multiplier < PLD_MIN_Z:
        raise ValueError(
            f"privacy.noise_multiplier={noise_multiplier}: the PLD accountant needs z >= "
            f"{PLD_MIN_Z} (memory); use privacy.accountant=rdp"
        )
    if spec.mode in ("epochs", "bands"):  # not linear in the rounds: the rounds that ran
        acc = make_accountant(accountant, spec, discretization)
        acc.compose(run_event(noise_multiplier, spec, rounds))
        return float(acc.get_epsilon(delta))
    event = round_event(noise_multiplier, spec)
    if accountant == "rdp":
        orders, rdp1 = one_round_rdp(event, spec)
        return float(rdp_privacy_accountant.compute_epsilon(orders, rounds * rdp1, delta)[0])
    acc = make_accountant(accountant, spec, discretization)
    acc.compose(event, rounds)
    return float(acc.get_epsilon(delta))


class EpsilonTracker:
    """Cumulative ε after each round, cheap enough to record every round.

    RDP is linear in the number of rounds, so the one-round RDP curve is computed
    once and scaled by t. PLD is recomputed from scratch for t rounds (never
    composed one round at a time, which is slow and accumulates discretisation).
    """

    def __init__(
        self,
        noise_multiplier: float,
        spec: SamplingSpec,
        delta: float,
        accountant: str,
        event: dp_accounting.DpEvent | None = None,
    ) -> None:
        """``event`` is the run's mechanism's ``dp_event`` (the server passes it, so the
        mechanism that noises is the one accounted); default: :func:`unit_event`."""
        spec.check_accountant(accountant)
        self.noise_multiplier = float(noise_multiplier)
        self.spec = spec
        self.delta = float(delta)
        self.accountant = accountant
        # under epochs: one epoch's tree, composed per epoch
        self.event = unit_event(self.noise_multiplier, spec) if event is None else event
        self._orders: np.ndarray | None = None
        self._rdp1: np.ndarray | None = None
        self._pld1: Any = None  # one-round PLD, self-composed per query
        correlated = spec.mode in ("epochs", "bands")
        if accountant == "rdp" and self.noise_multiplier > 0 and not correlated:
            self._orders, self._rdp1 = one_round_rdp(self.event, spec)

    def epsilon(self, rounds: int) -> float:
        if rounds <= 0:
            return 0.0
        if self.noise_multiplier <= 0:
            return math.inf
        if self.spec.mode == "epochs":
            acc = make_accountant(self.accountant, self.spec)
            acc.compose(tree.rounds_event(self.event, self.spec.rounds_per_epoch, rounds))
            return float(acc.get_epsilon(self.delta))
        if self.spec.mode == "bands":  # the first t rows of the strategy (its sensitivity)
            return compute_epsilon(
                self.noise_multiplier, self.spec, rounds, self.delta, self.accountant
            )
        if self._rdp1 is not None:
            eps, _ = rdp_privacy_accountant.compute_epsilon(
                self._orders, rounds * self._rdp1, self.delta
            )
            return float(eps)
        if self._pld1 is None:
            acc = make_accountant("pld", self.spec)
            acc.compose(self.event, 1)
            self._pld1 = acc._pld  # noqa: SLF001
        return float(self._pld1.self_compose(rounds).get_epsilon_for_delta(self.delta))


#: The largest N·δ the default δ gives; dpfl warns when a run's N·δ exceeds it.
MAX_DELTA_TIMES_N = 0.01


def default_delta(num_clients: int) -> float:
    """δ = min(N^-1.1, 0.01/N), so N·δ ≤ 0.01.

    δ bounds the probability mass on which the ε guarantee may fail: a mechanism that
    publishes one client's whole data with probability δ, independently per client, is
    (0, δ)-DP and exposes N·δ clients in expectation. N^-1.1 alone gives N·δ = N^-0.1
    (0.5 at N = 1000), so the default also caps N·δ at :data:`MAX_DELTA_TIMES_N`."""
    n = float(num_clients)
    return min(n**-1.1, MAX_DELTA_TIMES_N / n)
