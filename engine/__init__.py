"""dpfl's simulation engine: config, data, models, privacy, Ray execution, results.

Public API for notebooks::

    from engine import load_config, simulate, epsilon, calibrate_noise, calibrate_delta
    result = simulate(load_config(overrides=["rounds=20"]))
    result.rounds  # pandas DataFrame, one row per round
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from engine.config import RunConfig, load_config  # noqa: F401
    from engine.simulation import SimulationResult

__all__ = ["calibrate_delta", "calibrate_noise", "epsilon", "load_config", "simulate", "RunConfig"]


def __getattr__(name: str) -> Any:
    """``RunConfig`` and ``load_config`` on first use (PEP 562), so that importing any
    ``engine.*`` module, which runs this package's code first, does not import
    ``engine.config`` (which imports ``algorithms``, whose modules import
    ``engine.base``: importing ``algorithms.compose`` alone was a cycle)."""
    if name in ("RunConfig", "load_config"):
        import engine.config as config

        return getattr(config, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


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
    return _resolve(
        sampling_rate, rounds, accountant, noise_multiplier=noise_multiplier, delta=delta
    ).epsilon


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    rounds: int,
    *,
    accountant: str = "rdp",
) -> float:
    """σ(ε, δ, q, T): the smallest noise multiplier whose ε does not exceed the target."""
    return _resolve(
        sampling_rate, rounds, accountant, epsilon=target_epsilon, delta=delta
    ).noise_multiplier


def calibrate_delta(
    target_epsilon: float,
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    *,
    accountant: str = "rdp",
) -> float:
    """δ(ε, σ, q, T): the smallest δ at which σ meets ε (the accountant's ε ≤ the target)."""
    return _resolve(
        sampling_rate, rounds, accountant, epsilon=target_epsilon, noise_multiplier=noise_multiplier
    ).delta


def _resolve(sampling_rate: float, rounds: int, accountant: str, **two: Any):
    """Two of (ε, δ, σ) → all three, by the one resolver (:mod:`engine.privacy.resolve`)
    for Poisson sampling of a large population (its accounting does not depend on N)."""
    from engine.privacy.accounting import SamplingSpec
    from engine.privacy.resolve import resolve_privacy

    spec = SamplingSpec("poisson", 10**9, rate=sampling_rate)
    return resolve_privacy(spec, rounds, accountant=accountant, **two)
