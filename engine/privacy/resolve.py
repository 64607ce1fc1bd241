"""The one resolver of a run's privacy triple: two of (ε, δ, z) give the third.

Every caller that turns a budget into a noise multiplier (or back) goes through
:func:`resolve_privacy`: ``dpfl run`` (``engine.simulation.privacy_plan``), ``dpfl
privacy`` (``engine.cli.privacy``) and the Python API (``engine.epsilon``,
``engine.calibrate_noise``, ``engine.calibrate_delta``). Privacy assumptions:

* the events are :func:`engine.privacy.accounting.run_event` of the participation, the
  noise scheme and the number of rounds actually planned — the events the run's
  mechanism (:class:`engine.privacy.mechanism.GaussianMechanism`) is accounted with;
* the ε returned is always the accountant's ε at the returned (z, δ), never the target:
  a calibrated z or δ is re-checked at reporting precision, so ε ≤ the target;
* a z searched for a target ε is the smallest (to ``tol``) that meets it; a δ searched
  for (ε, z) is the smallest the accountant gives, nudged up only until ε ≤ the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting

from engine.privacy import calibration_store
from engine.privacy.accounting import (
    PLD_MIN_Z,
    PLD_REPORT_DISCRETIZATION,
    compute_epsilon,
    make_accountant,
    noise_of,
    run_event,
)
from engine.privacy.noise import NoiseScheme
from engine.privacy.participation import Participation

PLD_CALIBRATION_DISCRETIZATION = 1e-3
Z_BRACKET = (1e-2, 500.0)


class CalibrationError(ValueError):
    """The target ε cannot be met (or σ cannot be found) for the given settings."""


@dataclass(frozen=True)
class ResolvedPrivacy:
    """(ε, δ, z) of ``rounds`` rounds under ``sampling``, all three consistent: ``epsilon``
    is the accountant's ε at (``noise_multiplier``, ``delta``)."""

    noise_multiplier: float
    epsilon: float
    delta: float
    accountant: str
    sampling: Participation
    rounds: int
    target_epsilon: float | None = None  # the budget, when ε was one of the two given


def resolve_privacy(
    sampling: Participation,
    rounds: int,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | None = None,
    accountant: str | None = None,
    noise: NoiseScheme | None = None,
) -> ResolvedPrivacy:
    """The third of (ε, δ, z) from the two given, for ``rounds`` rounds of ``sampling``
    with the noise scheme ``noise`` (default: the participation's, see
    :func:`engine.privacy.accounting.noise_of`).

    ``accountant`` defaults to the participation's (``default_accountant``).
    Given (ε, δ): the smallest z whose ε ≤ the target. Given (z, δ): ε. Given (ε, z):
    the smallest δ whose ε ≤ the target. Raises ValueError (:class:`CalibrationError`
    for an unreachable budget) unless exactly two are given."""
    given = [v is not None for v in (epsilon, delta, noise_multiplier)]
    if sum(given) != 2:
        raise ValueError("give exactly two of epsilon, delta and the noise multiplier")
    accountant = accountant or sampling.default_accountant()
    sampling.check_accountant(accountant)
    if noise_multiplier is None:
        assert epsilon is not None and delta is not None
        z = calibrate_noise_multiplier(epsilon, delta, sampling, rounds, accountant, noise=noise)
    else:
        z = noise_multiplier
    if delta is None:
        assert epsilon is not None
        delta = calibrate_delta(epsilon, z, sampling, rounds, accountant, noise=noise)
    eps = compute_epsilon(z, sampling, rounds, delta, accountant, noise=noise)
    if epsilon is not None and eps > epsilon:  # pragma: no cover - guarded by the searches
        raise CalibrationError(f"privacy.epsilon={epsilon}: calibration overshot ({eps})")
    return ResolvedPrivacy(z, eps, delta, accountant, sampling, int(rounds), epsilon)


def calibrate_delta(
    target_epsilon: float,
    noise_multiplier: float,
    spec: Participation,
    rounds: int,
    accountant: str = "rdp",
    noise: NoiseScheme | None = None,
) -> float:
    """Smallest δ (as the accountant converts) at which ``rounds`` rounds with z have
    ε ≤ ``target_epsilon``; re-checked with :func:`compute_epsilon` and nudged up until
    it holds. Raises :class:`CalibrationError` when no δ < 1 does."""
    spec.check_accountant(accountant)
    if target_epsilon <= 0:
        raise CalibrationError(f"privacy.epsilon={target_epsilon} must be > 0")
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)) or rounds < 1:
        raise CalibrationError(
            f"noise multiplier {noise_multiplier} over {rounds} rounds: no delta < 1 gives a "
            "finite epsilon"
        )
    if accountant == "pld" and noise_multiplier < PLD_MIN_Z:
        raise ValueError(
            f"privacy.noise_multiplier={noise_multiplier}: the PLD accountant needs z >= "
            f"{PLD_MIN_Z} (memory); use privacy.accountant=rdp"
        )
    acc = make_accountant(accountant, spec, PLD_REPORT_DISCRETIZATION)
    acc.compose(run_event(noise_multiplier, spec, rounds, noise))
    delta = float(acc.get_delta(target_epsilon))
    for _ in range(50):
        if not 0 < delta < 1:
            break
        eps = compute_epsilon(noise_multiplier, spec, rounds, delta, accountant, noise=noise)
        if eps <= target_epsilon:
            return delta
        delta *= 1.0 + 1e-6
    raise CalibrationError(
        f"privacy.epsilon={target_epsilon} with noise multiplier {noise_multiplier} in "
        f"rounds={rounds} ({spec.name} sampling): no delta in (0, 1) found (got {delta:.3g})"
    )


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    spec: Participation,
    rounds: int,
    accountant: str = "rdp",
    tol: float = 1e-4,
    noise: NoiseScheme | None = None,
) -> float:
    """Smallest z (to ``tol``) whose ε after ``rounds`` rounds is ≤ ``target_epsilon``.

    The answer of an earlier search with the same inputs is remembered
    (:mod:`engine.privacy.calibration_store`) and reused only after the accountant
    confirms, at reporting precision, that it meets the target.

    Raises:
        CalibrationError: if even z = 500 exceeds the target (unreachable budget).
    """
    spec.check_accountant(accountant)
    if target_epsilon <= 0:
        raise CalibrationError(f"privacy.epsilon={target_epsilon} must be > 0")
    scheme = noise_of(spec, noise)
    key = calibration_store.calibration_key(
        target_epsilon=float(target_epsilon),
        delta=float(delta),
        spec=spec,
        participation=spec.name,
        noise=repr(scheme),
        rounds=int(rounds),
        accountant=accountant,
        tol=float(tol),
        bracket=list(Z_BRACKET),
        discretization=[PLD_CALIBRATION_DISCRETIZATION, PLD_REPORT_DISCRETIZATION],
        pld_min_z=PLD_MIN_Z,
    )
    hint = calibration_store.recall(key)
    if hint is not None and (
        compute_epsilon(hint, spec, rounds, delta, accountant, PLD_REPORT_DISCRETIZATION, scheme)
        <= target_epsilon
    ):
        return hint
    z = _search_noise_multiplier(target_epsilon, delta, spec, rounds, accountant, tol, scheme)
    calibration_store.remember(key, z)
    return z


def _search_noise_multiplier(
    target_epsilon: float,
    delta: float,
    spec: Participation,
    rounds: int,
    accountant: str,
    tol: float,
    noise: NoiseScheme | None = None,
) -> float:
    """The root search behind :func:`calibrate_noise_multiplier` (nothing remembered)."""
    noise = noise_of(spec, noise)
    lo, hi = Z_BRACKET
    disc = PLD_CALIBRATION_DISCRETIZATION
    if accountant == "pld":
        # PLD at tiny z needs enormous memory; RDP's z (an upper bound on PLD's, found
        # cheaply) brackets the search from below.
        hint_spec = spec.rdp_hint()
        z_rdp = calibrate_noise_multiplier(
            target_epsilon, delta, hint_spec, rounds, "rdp", tol, noise
        )
        lo = max(PLD_MIN_Z, 0.5 * z_rdp)

    def eps_at(z: float, d: float = disc) -> float:
        return compute_epsilon(z, spec, rounds, delta, accountant, d, noise)

    eps_hi = eps_at(hi)
    if eps_hi > target_epsilon:
        raise CalibrationError(
            f"privacy.epsilon={target_epsilon} is unreachable in rounds={rounds} with "
            f"{spec.name} sampling (rate {spec.effective_rate:.4g}, delta={delta:.3g}): even "
            f"noise multiplier {hi} gives epsilon={eps_hi:.4g}"
        )
    if eps_at(lo) <= target_epsilon:
        z = lo
    else:
        z = float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: make_accountant(accountant, spec, disc),
                lambda z: run_event(z, spec, rounds, noise),
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
                tol=tol,
            )
        )
    # Re-check at reporting precision; never overshoot the target.
    for _ in range(50):
        if eps_at(z, PLD_REPORT_DISCRETIZATION) <= target_epsilon:
            return z
        z *= 1.0 + tol
    raise CalibrationError(f"could not calibrate privacy.epsilon={target_epsilon}")
