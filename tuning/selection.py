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
  one. ε with tuning is dp-accounting's repeat-and-select transform
  (``RepeatAndSelectDpEvent(one run, mean, shape)``, RDP only) applied to one run's
  RDP curve. This holds only if (1) the hyperparameter draws do not depend on other
  trials' results (random search, no ASHA), (2) the one-run curve bounds every
  configuration a trial can draw - a key that changes the event (:data:`PRIVACY_KEYS`)
  may vary only over a finite grid whose every configuration is accounted
  (``covered``: ``rounds`` and ``algo.bands`` under a total budget,
  :mod:`tuning.budget`), and the curve is then the elementwise max of the
  configurations' RDP curves (:func:`repeat_and_select_epsilon`; a trial that draws
  its configuration at random is a mixture of the configurations' mechanisms, whose
  Rényi divergence is at most the largest, by joint convexity); with one
  configuration this is dp-accounting's ``RepeatAndSelectDpEvent`` exactly; (3) only
  the selected trial is published, and (4) K itself stays secret: knowing K turns
  the mechanism into best-of-K-fixed, which the theorem does not cover.
  Truncated Poisson sampling (``sampling.max_cohort``) is accounted by PLD only, so
  it is refused under these rules.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting import rdp

from engine.privacy.accounting import (
    PLD_REPORT_DISCRETIZATION,
    make_accountant,
    run_event,
)
from engine.privacy.participation import Participation

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
    "algo.bands",  # a correlated strategy's shape: its sensitivity, hence the calibrated σ
)


class TuningPrivacyError(ValueError):
    """The requested tuning rule does not hold for this experiment."""


@dataclass(frozen=True)
class TrialEvent:
    """What one trial's privacy guarantee depends on (all public)."""

    noise_multiplier: float
    spec: Participation  # the trial's participation: its statement
    rounds: int
    delta: float
    accountant: str

    def dp_event(self) -> dp_accounting.DpEvent:
        # the noise scheme the participation is accounted with (independent noise: the
        # round event self-composed; epoch passes: the trees of tree aggregation)
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
    covered: tuple[str, ...] = (),
) -> None:
    """Refuse a Papernot-Steinke rule whose assumptions the experiment breaks.
    ``covered``: privacy keys the space varies over a finite grid whose every
    configuration the accounting bounds (:mod:`tuning.budget`), hence allowed."""
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
    varied = [k for k in varied if k not in covered]
    if varied:
        raise TuningPrivacyError(
            f"{flag}: the search space varies {varied[0]}, which changes a trial's privacy "
            "event; use --tuning-privacy compose (or --total-epsilon with "
            f"{varied[0]} a choice over a grid)"
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


def one_run_rdp(event: TrialEvent) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, RDP curve)`` of one trial's run, as dp-accounting's RDP accountant
    composes it inside a ``RepeatAndSelectDpEvent`` (from zero, with the accountant's
    default orders): ``rounds · rdp₁`` for per-round events (the library's own
    arithmetic, from the remembered one-round curve,
    :func:`engine.privacy.accounting.one_round_rdp`), the run's event composed in a
    fresh accountant for the correlated mechanisms."""
    from engine.privacy.accounting import one_round_rdp, round_event

    if event.spec.mode in ("poisson", "fixed") and event.spec.max_cohort is None:
        orders, rdp1 = one_round_rdp(round_event(event.noise_multiplier, event.spec), event.spec)
        return orders, event.rounds * rdp1
    acc = rdp.RdpAccountant(neighboring_relation=event.spec.neighboring_relation)
    acc.compose(event.dp_event())
    return np.array(acc._orders, dtype=float), np.array(acc._rdp, dtype=float)  # noqa: SLF001


def repeat_and_select_epsilon(
    curves: list[np.ndarray], orders: np.ndarray, delta: float, mean: float, mode: str, shape: float
) -> float:
    """ε at ``delta`` of releasing the best of K runs (K ~ Poisson(mean), or TNB(shape,
    mean)) when each run draws its configuration from a set whose one-run RDP curves are
    ``curves`` (over ``orders``): dp-accounting's repeat-and-select transform of their
    elementwise max. Sound for a random choice among the configurations (a mixture's
    Rényi divergence is at most the largest of its components', by the joint convexity
    of exp((α−1)D_α)); for one curve, the numbers of ``RdpAccountant`` composing
    ``RepeatAndSelectDpEvent`` bit for bit (the same transform and conversion)."""
    from dp_accounting.rdp import rdp_privacy_accountant as r

    worst = np.max(np.stack(curves), axis=0)
    shape_arg = np.inf if mode == POISSON else float(shape)
    out = r._compute_rdp_repeat_and_select(orders, worst, float(mean), shape_arg)  # noqa: SLF001
    return float(r.compute_epsilon(orders, out, delta)[0])


def papernot_steinke_epsilon(
    events: list[TrialEvent], delta: float, mean: float, mode: str, shape: float
) -> tuple[float, str]:
    """ε at ``delta`` of releasing only the best of K trials, K ~ Poisson(mean) or
    TNB(shape, mean): the repeat-and-select transform of the elementwise max of the
    events' one-run RDP curves (:func:`repeat_and_select_epsilon`; with one distinct
    event, dp-accounting's ``RepeatAndSelectDpEvent`` exactly). ``events``: every
    configuration a trial could run (the trials that ran, plus a grid's others)."""
    if not events:
        raise TuningPrivacyError("Papernot-Steinke accounting needs at least one trial's event")
    if any(t.spec.max_cohort is not None for t in events):
        raise TuningPrivacyError(
            "Papernot-Steinke accounting refused: truncated Poisson (sampling.max_cohort) is "
            "accounted by PLD only"
        )
    if any(t.noise_multiplier <= 0 for t in events):
        return math.inf, label(mode, mean, shape)
    if len({t.spec.neighboring_relation for t in events}) > 1:
        raise TuningPrivacyError(
            "Papernot-Steinke accounting refused: the configurations differ in adjacency"
        )
    distinct = list(dict.fromkeys((t.noise_multiplier, t.spec, t.rounds) for t in events))
    curves, orders = [], None
    for z, spec, rounds in distinct:
        orders, curve = one_run_rdp(TrialEvent(z, spec, rounds, delta, "rdp"))
        curves.append(curve)
    assert orders is not None
    return repeat_and_select_epsilon(curves, orders, delta, mean, mode, shape), label(
        mode, mean, shape
    )


def label(mode: str, mean: float, shape: float) -> str:
    if mode == POISSON:
        return f"Papernot-Steinke Poisson(mean {mean:g}), best trial only (RDP)"
    return (
        f"Papernot-Steinke truncated negative binomial(eta {shape:g}, mean {mean:g}), "
        "best trial only (RDP)"
    )
