"""dpfl's simulation engine: config, data, models, privacy, Ray execution, results.

Public API for notebooks::

    from engine import load_config, simulate, epsilon, calibrate_noise
    result = simulate(load_config(overrides=["rounds=20"]))
    result.rounds  # pandas DataFrame, one row per round
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from engine.simulation import SimulationResult

__all__ = ["calibrate_noise", "epsilon", "load_config", "simulate", "RunConfig"]

from engine.config import RunConfig, load_config


def simulate(config: RunConfig, **kwargs: Any) -> SimulationResult:
    """Run one simulation; see :func:`engine.simulation.simulate`."""
    from engine.simulation import simulate as _simulate

    return _simulate(config, **kwargs)


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    *,
    accountant: str = "rdp",
) -> float:
    """ε(σ, q, T, δ) of DP-FedAvg with Poisson sampling (add/remove one client)."""
    from engine.privacy.accounting import SamplingSpec, compute_epsilon

    spec = SamplingSpec("poisson", 10**9, rate=sampling_rate)
    return compute_epsilon(noise_multiplier, spec, rounds, delta, accountant)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    rounds: int,
    *,
    accountant: str = "rdp",
) -> float:
    """σ(ε, δ, q, T): the smallest noise multiplier whose ε does not exceed the target."""
    from engine.privacy.accounting import SamplingSpec, calibrate_noise_multiplier

    spec = SamplingSpec("poisson", 10**9, rate=sampling_rate)
    return calibrate_noise_multiplier(target_epsilon, delta, spec, rounds, accountant)
