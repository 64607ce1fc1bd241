"""The run's privacy plan: sampling (:func:`sampling_spec`), δ, the accountant and
σ↔ε (:func:`plan_privacy`), resolved from the config before any training."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from algorithms.recipes import participation
from engine.config import ConfigError, RunConfig
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec, default_delta
from engine.privacy.resolve import resolve_privacy


@dataclass(frozen=True)
class PrivacyPlan:
    """The resolved privacy parameters of a run (all public)."""

    private: bool
    noise_multiplier: float
    clip_norm: float
    delta: float
    target_epsilon: float | None  # the budget, if one was given
    planned_epsilon: float  # ε after config.rounds rounds at noise_multiplier
    accountant: str
    sampling: SamplingSpec
    randomness: str = rngs.SEEDED_SIMULATION  # or rngs.SECURE (privacy.secure_noise)

    def summary(self) -> dict[str, Any]:
        extra = (  # epoch participation (DP-FTRL): the passes' length, recorded
            {"rounds_per_epoch": self.sampling.rounds_per_epoch}
            if self.sampling.mode == "epochs"
            else {}
        )
        return extra | {
            "private": self.private,
            "randomness": self.randomness,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "planned_epsilon": self.planned_epsilon,
            "accountant": self.accountant if self.private else "none",
            "sampling": self.sampling.name,
            "adjacency": self.sampling.adjacency if self.private else "none",
            "sampling_rate": self.sampling.effective_rate,
            "denominator": self.sampling.denominator,
        }


def sampling_spec(config: RunConfig) -> SamplingSpec:
    s = config.sampling
    if participation(config.algorithm) == "epochs":  # DP-FTRL: passes, no sampling
        n = config.dataset.num_clients
        if s.max_cohort is not None:
            raise ConfigError(
                f"sampling.max_cohort={s.max_cohort}: algorithm={config.algorithm} takes "
                "cohorts of one fixed size in passes over the population (set "
                "sampling.cohort_size with sampling.mode=fixed, or sampling.rate)"
            )
        m = s.cohort_size if s.mode == "fixed" else max(1, round(s.rate * n))
        assert m is not None
        return SamplingSpec(mode="epochs", num_clients=n, cohort_size=min(m, n))
    if participation(config.algorithm) == "bands":  # DP-BandMF: b-min-separation
        from algorithms.recipes import BANDMF_BANDS

        n = config.dataset.num_clients
        m = s.cohort_size if s.mode == "fixed" else max(1, round(s.rate * n))
        assert m is not None
        # null: BANDMF_BANDS, or fewer when the b groups of N/b clients are smaller than m
        b = config.algo.bands or max(1, min(BANDMF_BANDS, n // m))
        if s.max_cohort is not None:
            raise ConfigError(
                f"sampling.max_cohort={s.max_cohort}: algorithm={config.algorithm} takes "
                "cohorts of one fixed size (sampling.cohort_size or sampling.rate)"
            )
        try:
            return SamplingSpec("bands", n, cohort_size=m, bands=b, horizon=config.rounds)
        except ValueError as e:
            raise ConfigError(f"algorithm={config.algorithm}: {e}") from None
    return SamplingSpec(
        mode=s.mode,
        num_clients=config.dataset.num_clients,
        rate=s.rate if s.mode == "poisson" else None,
        cohort_size=s.cohort_size if s.mode == "fixed" else None,
        max_cohort=s.max_cohort,
    )


def plan_privacy(config: RunConfig) -> PrivacyPlan:
    """Resolve δ, the accountant and σ↔ε for ``config``; raises ConfigError."""
    spec = sampling_spec(config)
    p = config.privacy
    mode = rngs.randomness_mode(p.secure_noise)
    if not config.is_private:
        return PrivacyPlan(False, 0.0, math.inf, 0.0, None, math.inf, "none", spec, mode)
    delta = p.delta if p.delta is not None else default_delta(config.dataset.num_clients)
    if spec.mode in ("epochs", "bands") and p.secure_noise:
        # the canary audit runs (engine.privacy.audit_correlated); release mode does not
        raise ConfigError(
            f"privacy.secure_noise={p.secure_noise!r} is not available with "
            f"algorithm={config.algorithm} (correlated noise: its noise state is kept "
            "in checkpoints)"
        )
    # σ from ε (or ε from σ) at δ: the one resolver (engine.privacy.resolve)
    z = None if p.epsilon is not None else p.noise_multiplier
    try:
        r = resolve_privacy(
            spec,
            config.rounds,
            epsilon=p.epsilon,
            delta=delta,
            noise_multiplier=z,
            accountant=p.accountant,
        )
    except ValueError as e:  # CalibrationError included
        raise ConfigError(str(e)) from None
    return PrivacyPlan(
        True, r.noise_multiplier, p.clip_norm, delta, p.epsilon, r.epsilon, r.accountant, spec, mode
    )
