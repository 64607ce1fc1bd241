"""The privacy cost of ``dpfl tune``: how many trials run, which is released, at what ε.

Two rules, chosen with ``dpfl tune --tuning-privacy`` (README, "The privacy cost of
tuning"):

* ``compose`` (default; the only rule for optuna/hyperopt, which are adaptive, and for
  ASHA, which stops trials on their results): every trial that ran may be released.
  ε with tuning is the composition of all trials of an (algorithm, ε) cell, each
  trial's ``SelfComposedDpEvent(round event, planned rounds)`` composed in one
  dp-accounting accountant of the kind the runs used (RDP or PLD), built with
  :func:`engine.privacy.accounting.round_event` / ``make_accountant`` - the same
  event and accountant as the run, so one trial composes to exactly the ε the run
  reported. Planned rounds, not the rounds done: a trial stopped early by ASHA is a
  post-processing of the full run, so the bound does not depend on the stopping
  decision (which depends on the data). Refused: an adaptive searcher over a space
  that varies a key in :data:`PRIVACY_KEYS` (the events themselves would be chosen
  from earlier results; composing realised events then needs a privacy filter).
* ``poisson`` / ``truncated_negative_binomial`` (Papernot & Steinke, "Hyperparameter
  Tuning with Renyi Differential Privacy", ICLR 2022, arXiv:2110.03620): dpfl draws
  the number of trials K itself (:func:`draw_num_trials`; Poisson with mean
  ``--num-samples``, or the truncated negative binomial with shape η and that mean),
  runs exactly K trials of non-adaptive random search, and releases only the best
  one. ε with tuning is dp-accounting's ``RepeatAndSelectDpEvent(one run, mean,
  shape)`` (RDP only). This holds only if (1) the hyperparameter draws do not depend
  on other trials' results (random search, no ASHA), (2) every trial has the same
  one-run event - enforced by refusing spaces that vary a key that changes it
  (:data:`PRIVACY_KEYS`), and the max over the trials' events is taken anyway - (3)
  only the selected trial is published, and (4) K itself stays secret: knowing K
  turns the mechanism into best-of-K-fixed, which the theorem does not cover.
  Truncated Poisson sampling (``sampling.max_cohort``) is accounted by PLD only, so
  it is refused under these rules.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting import dp_event, rdp

from engine.privacy.accounting import (
    PLD_REPORT_DISCRETIZATION,
    SamplingSpec,
    make_accountant,
    run_event,
)

COMPOSE = "compose"
POISSON = "poisson"
TNB = "truncated_negative_binomial"
MODES = (COMPOSE, POISSON, TNB)
#: Config keys whose value changes a trial's one-run DpEvent (σ is calibrated from ε,
#: δ, the sampling, the number of clients and rounds, with the accountant): a space
#: that varies one is refused under Papernot-Steinke (its events would differ).
PRIVACY_KEYS = (
    "rounds",
    "sampling.",
    "privacy.delta",
    "privacy.accountant",
    "dataset.",
    "algo.bands",  # dp_bandmf: the strategy, hence its sensitivity and the calibrated σ
)


class TuningPrivacyError(ValueError):
    """The requested tuning rule does not hold for this experiment."""


@dataclass(frozen=True)
class TrialEvent:
    """What one trial's privacy guarantee depends on (all public)."""

    noise_multiplier: float
    spec: SamplingSpec
    rounds: int
    delta: float
    accountant: str

    def dp_event(self) -> dp_accounting.DpEvent:
        # the round event self-composed; under epoch participation (dp_ftrl) the trees
        return run_event(self.noise_multiplier, self.spec, self.rounds)


def is_papernot_steinke(mode: str) -> bool:
    return mode in (POISSON, TNB)


def check_mode(
    mode: str,
    *,
    search: str,
    scheduler: str,
    max_cohort: int | None,
    space_keys: list[str],
    shape: float,
) -> None:
    """Refuse a Papernot-Steinke rule whose assumptions the experiment breaks."""
    if mode not in MODES:
        raise TuningPrivacyError(f"--tuning-privacy={mode!r}: must be one of {', '.join(MODES)}")
    varied = [
        k
        for k in space_keys
        if any(k == p or (p.endswith(".") and k.startswith(p)) for p in PRIVACY_KEYS)
    ]
    if not is_papernot_steinke(mode):
        if varied and search != "random":
            # the trials' events would be chosen adaptively from earlier results; composing
            # the realised events would need a privacy filter, which dpfl does not have
            raise TuningPrivacyError(
                f"--search={search} with a space that varies {varied[0]} (it changes a "
                "trial's privacy event, chosen adaptively): use --search random"
            )
        return
    flag = f"--tuning-privacy={mode}"
    if search != "random":
        raise TuningPrivacyError(
            f"{flag} needs --search random: {search} is adaptive (each trial depends on "
            "earlier results); use --tuning-privacy compose"
        )
    if scheduler != "fifo":
        raise TuningPrivacyError(
            f"{flag} needs --scheduler fifo: {scheduler} stops trials on their results "
            "(adaptive); use --tuning-privacy compose"
        )
    if max_cohort is not None:
        raise TuningPrivacyError(
            f"{flag}: sampling.max_cohort (truncated Poisson) is accounted by PLD only and "
            "Papernot-Steinke by RDP only; use --tuning-privacy compose"
        )
    if varied:
        raise TuningPrivacyError(
            f"{flag}: the search space varies {varied[0]}, which changes a trial's privacy "
            "event; use --tuning-privacy compose"
        )
    if mode == TNB and not (shape >= 0 and math.isfinite(shape)):
        raise TuningPrivacyError(f"--tnb-shape={shape}: must be finite and >= 0")


def tnb_gamma(shape: float, mean: float) -> float:
    """γ of the truncated negative binomial with shape η and the given mean, exactly as
    dp-accounting's RepeatAndSelect accounting maps (shape, mean) to γ."""
    from dp_accounting.rdp import rdp_privacy_accountant as r

    return float(r._gamma_truncated_negative_binomial(shape, mean))  # noqa: SLF001


def draw_num_trials(mode: str, mean: float, shape: float, rng: np.random.Generator | None) -> int:
    """K for one (algorithm, ε) cell: Poisson(mean), or TNB(η=shape, γ) with that mean
    (P[K=k] ∝ (1-γ)^k·Π_{l<k}(l+η)/(l+1), k ≥ 1; η = 0 is the logarithmic law).
    ``rng=None`` draws from a generator seeded by the OS CSPRNG (release mode)."""
    if rng is None:
        rng = np.random.default_rng(secrets.randbits(128))
    if mode == POISSON:
        return int(rng.poisson(mean))
    if mode != TNB:
        raise TuningPrivacyError(f"--tuning-privacy={mode!r}: K is drawn only for {POISSON}/{TNB}")
    gamma = tnb_gamma(shape, mean)
    if shape == 0:
        return int(rng.logseries(1.0 - gamma))
    while True:  # negative binomial (failures before `shape` successes), conditioned ≥ 1
        k = int(rng.negative_binomial(shape, gamma))
        if k >= 1:
            return k


def composed_epsilon(events: list[TrialEvent], delta: float) -> tuple[float, str]:
    """ε at ``delta`` of running every trial in ``events`` (and releasing all), and the
    rule used: one dp-accounting accountant over all trials' events when they share the
    accountant and adjacency (the runs' own accounting), otherwise basic composition
    (Σ ε_i at δ/K each)."""
    if not events:
        return 0.0, "no trial ran"
    if any(t.noise_multiplier <= 0 for t in events):
        return math.inf, f"composition of {len(events)} trials"
    kinds = {(t.accountant, t.spec.adjacency) for t in events}
    if len(kinds) == 1:
        accountant = events[0].accountant
        acc = make_accountant(accountant, events[0].spec, PLD_REPORT_DISCRETIZATION)
        for t in events:
            acc.compose(t.dp_event())
        return float(acc.get_epsilon(delta)), (
            f"composition of {len(events)} trials ({accountant.upper()})"
        )
    total = 0.0
    for t in events:
        acc = make_accountant(t.accountant, t.spec, PLD_REPORT_DISCRETIZATION)
        acc.compose(t.dp_event())
        total += float(acc.get_epsilon(delta / len(events)))
    return total, f"basic composition of {len(events)} trials (mixed accountants)"


def papernot_steinke_epsilon(
    events: list[TrialEvent], delta: float, mean: float, mode: str, shape: float
) -> tuple[float, str]:
    """ε at ``delta`` of releasing only the best of K trials, K ~ Poisson(mean) or
    TNB(shape, mean): RDP ``RepeatAndSelectDpEvent`` of each trial's one-run event, the
    max over trials (they are equal when the space leaves the event alone)."""
    if not events:
        raise TuningPrivacyError("Papernot-Steinke accounting needs at least one trial's event")
    if any(t.spec.max_cohort is not None for t in events):
        raise TuningPrivacyError(
            "Papernot-Steinke accounting refused: truncated Poisson (sampling.max_cohort) is "
            "accounted by PLD only"
        )
    shape_arg = np.inf if mode == POISSON else float(shape)
    worst = 0.0
    for t in events:
        if t.noise_multiplier <= 0:
            return math.inf, label(mode, mean, shape)
        acc = rdp.RdpAccountant(neighboring_relation=t.spec.neighboring_relation)
        acc.compose(dp_event.RepeatAndSelectDpEvent(t.dp_event(), float(mean), shape_arg))
        worst = max(worst, float(acc.get_epsilon(delta)))
    return worst, label(mode, mean, shape)


def label(mode: str, mean: float, shape: float) -> str:
    if mode == POISSON:
        return f"Papernot-Steinke Poisson(mean {mean:g}), best trial only (RDP)"
    return (
        f"Papernot-Steinke truncated negative binomial(eta {shape:g}, mean {mean:g}), "
        "best trial only (RDP)"
    )
