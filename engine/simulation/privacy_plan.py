"""The run's privacy plan: its participation (:func:`sampling_spec`) and noise scheme
(:func:`noise_scheme`), δ, the accountant and σ↔ε (:func:`plan_privacy`), resolved from
the config before any training. Both are the recipe's, built by their registered
builders (algorithms.registry); a participation whose draw is not dpfl's own is sampled
before it is used (:func:`engine.privacy.participation.check_draws`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from algorithms import registry
from algorithms.recipes import recipe_config
from algorithms.spec import BuildContext
from engine.config import ConfigError, RunConfig
from engine.privacy import rng as rngs
from engine.privacy.accounting import default_delta
from engine.privacy.noise import GAUSSIAN, NoiseScheme
from engine.privacy.participation import Participation, check_draws
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
    sampling: Participation
    randomness: str = rngs.SEEDED_SIMULATION  # or rngs.SECURE (privacy.secure_noise)
    noise: NoiseScheme = GAUSSIAN  # what a round's draw is and costs

    def summary(self) -> dict[str, Any]:
        # the participation's own public facts
        return self.sampling.columns() | {
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


def _context(config: RunConfig) -> BuildContext:
    return BuildContext(
        clip_norm=config.privacy.clip_norm,
        model_name=config.model.name,
        recipe=recipe_config(config.algorithm, config.recipe),
        sampling=config.sampling,
        num_clients=config.dataset.num_clients,
        rounds=config.rounds,
    )


def sampling_spec(config: RunConfig) -> Participation:
    """The run's participation: the one its recipe names (``sampled``: the
    ``sampling:`` section's), built by its registered builder; raises ConfigError."""
    ctx = _context(config)
    spec = registry.spec(ctx.recipe.participation or "sampled")
    try:
        return spec.build(spec.piece_class(), config.algo, ctx)
    except ValueError as e:
        raise ConfigError(f"algorithm={config.algorithm}: {e}") from None


def noise_scheme(config: RunConfig, sampling: Participation) -> NoiseScheme:
    """The run's noise scheme: the one its recipe names (``gaussian`` by default), with
    the ``algo.*`` values the participation resolved."""
    ctx = _context(config)
    spec = registry.spec(ctx.recipe.noise or "gaussian")
    algo = dataclasses.replace(config.algo, **sampling.algo_keys())
    try:
        return spec.build(spec.piece_class(), algo, ctx)
    except ValueError as e:
        raise ConfigError(f"algorithm={config.algorithm}: {e}") from None


def plan_privacy(config: RunConfig) -> PrivacyPlan:
    """Resolve δ, the accountant and σ↔ε for ``config``; raises ConfigError."""
    spec = sampling_spec(config)
    p = config.privacy
    try:
        check_draws(spec, config.seed, config.dataset.materialize is False)
    except ValueError as e:
        raise ConfigError(f"algorithm={config.algorithm}: {e}") from None
    mode = rngs.randomness_mode(p.secure_noise)
    if not config.is_private:
        return PrivacyPlan(False, 0.0, math.inf, 0.0, None, math.inf, "none", spec, mode)
    noise = noise_scheme(config, spec)
    delta = p.delta if p.delta is not None else default_delta(config.dataset.num_clients)
    if p.secure_noise and not (noise.secure_ok and spec.secure_ok):
        # the canary audit runs (engine.privacy.audit_correlated); release mode does not
        raise ConfigError(
            f"privacy.secure_noise={p.secure_noise!r} is not available with "
            f"algorithm={config.algorithm} (correlated noise: its noise state is kept "
            "in checkpoints)"
        )
    try:
        noise.accepts(spec)  # a scheme refuses a participation its event does not hold under
    except ValueError as e:
        raise ConfigError(f"algorithm={config.algorithm}: {e}") from None
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
            noise=noise,
        )
    except ValueError as e:  # CalibrationError included
        raise ConfigError(str(e)) from None
    return PrivacyPlan(
        True,
        r.noise_multiplier,
        p.clip_norm,
        delta,
        p.epsilon,
        r.epsilon,
        r.accountant,
        spec,
        mode,
        noise,
    )
