"""Client-level privacy accounting with ``dp-accounting``: the DpEvents and ε(σ).

Unit of privacy: one client (all of its data). What the accountant assumes comes from
two objects and nothing else:

* the run's participation (:class:`engine.privacy.participation.Participation`), which
  *states* the sampling: its adjacency (the neighbouring relation), the accountants
  that can account it and, where it samples, one round's subsampled Gaussian
  (Poisson: ``PoissonSampledDpEvent``, add/remove one; truncated Poisson:
  ``TruncatedSubsampledGaussianDpEvent``, PLD only; fixed size: without replacement,
  replace one, RDP only: :mod:`engine.privacy.sampling`);
* the run's noise scheme (:class:`engine.privacy.noise.NoiseScheme`), which makes the
  event of t rounds from that statement: independent noise composes the rounds'
  subsampled Gaussians; correlated noise (the methods' modules in ``algorithms``)
  builds its own event under the participation it was made for.

ε is never assumed: every figure comes from the event built from the noise
multiplier, the participation and the number of rounds actually used. Turning a budget
into z (or δ) is :mod:`engine.privacy.resolve`'s, with the same events.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant

from engine.privacy import calibration_store
from engine.privacy.noise import GAUSSIAN, NoiseScheme
from engine.privacy.participation import Participation
from engine.privacy.sampling import SamplingSpec  # noqa: F401 - re-exported (a mode to its statement)

logging.getLogger("absl").setLevel(logging.ERROR)

PLD_REPORT_DISCRETIZATION = 1e-4
PLD_MIN_Z = 0.3  # below this a PLD needs gigabytes; use RDP there


def noise_of(spec: Participation, noise: NoiseScheme | None = None) -> NoiseScheme:
    """``noise``, or when it is not named the scheme ``spec`` is accounted with by
    default (its ``default_noise``: independent Gaussian noise for sampled
    participation; a participation made for correlated noise names its scheme)."""
    if noise is not None:
        return noise
    return getattr(spec.statement, "default_noise", None) or GAUSSIAN


def round_event(noise_multiplier: float, spec: Participation) -> dp_accounting.DpEvent:
    """The DpEvent of one round of clipped sum + independent N(0, (zC)²): the
    participation's subsampled Gaussian."""
    return spec.statement.sampled_gaussian(noise_multiplier)


def run_event(
    noise_multiplier: float,
    spec: Participation,
    rounds: int,
    noise: NoiseScheme | None = None,
) -> dp_accounting.DpEvent:
    """The DpEvent of ``rounds`` rounds of the noise scheme under ``spec``."""
    return noise_of(spec, noise).run_event(float(noise_multiplier), spec, int(rounds))


def unit_event(
    noise_multiplier: float, spec: Participation, noise: NoiseScheme | None = None
) -> dp_accounting.DpEvent:
    """The event :class:`EpsilonTracker` composes: one round's, or the scheme's unit."""
    return noise_of(spec, noise).unit_event(float(noise_multiplier), spec)


def make_accountant(
    accountant: str, spec: Participation, discretization: float = PLD_REPORT_DISCRETIZATION
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
    event: dp_accounting.DpEvent, spec: Participation
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
    spec: Participation,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    discretization: float = PLD_REPORT_DISCRETIZATION,
    noise: NoiseScheme | None = None,
) -> float:
    """ε after ``rounds`` rounds of the mechanism described by (z, spec, noise)."""
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
    scheme = noise_of(spec, noise)
    if not scheme.linear:  # not linear in the rounds: the event of the rounds that ran
        acc = make_accountant(accountant, spec, discretization)
        acc.compose(scheme.run_event(noise_multiplier, spec, rounds))
        return float(acc.get_epsilon(delta))
    event = scheme.unit_event(noise_multiplier, spec)
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
        spec: Participation,
        delta: float,
        accountant: str,
        event: dp_accounting.DpEvent | None = None,
        noise: NoiseScheme | None = None,
    ) -> None:
        """``noise`` is the run's noise scheme and ``event`` its mechanism's
        ``dp_event`` (the server passes both, so the mechanism that noises is the one
        accounted); default: :func:`unit_event` of the default scheme."""
        spec.check_accountant(accountant)
        self.noise_multiplier = float(noise_multiplier)
        self.spec = spec
        self.noise = noise_of(spec, noise)
        self.delta = float(delta)
        self.accountant = accountant
        self.event = self.noise.unit_event(self.noise_multiplier, spec) if event is None else event
        self._orders: np.ndarray | None = None
        self._rdp1: np.ndarray | None = None
        self._pld1: Any = None  # one-round PLD, self-composed per query
        if accountant == "rdp" and self.noise_multiplier > 0 and self.noise.linear:
            self._orders, self._rdp1 = one_round_rdp(self.event, spec)

    def epsilon(self, rounds: int) -> float:
        if rounds <= 0:
            return 0.0
        if self.noise_multiplier <= 0:
            return math.inf
        if not self.noise.linear:  # the event of the rounds that ran, composed afresh
            acc = make_accountant(self.accountant, self.spec)
            acc.compose(self.noise.run_event(self.noise_multiplier, self.spec, rounds))
            return float(acc.get_epsilon(self.delta))
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
