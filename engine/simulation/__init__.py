"""Simulation: one federated run from its config to its results.

:func:`simulate` validates the config, resolves the privacy plan, builds the data and
the workers, runs the rounds and writes the results. Its modules, in the order a run
uses them:

* :mod:`.validation` — the checks that need more than the config and no training (the
  data's files and format, the device, Ray's start, the model on the data);
* :mod:`.privacy_plan` — :func:`sampling_spec` and :func:`plan_privacy` (δ, the
  accountant, σ↔ε), resolved before any training;
* :mod:`.preparation` — :func:`prepare` (the run's one validation stage: every check
  that needs no training; the dataset and the run's pipeline, the plan the run
  executes) and :func:`make_executor` (the worker pool);
* :mod:`.runner` — :func:`simulate`, its round loop, and :class:`SimulationResult`;
* :mod:`.callbacks` — the per-round side effects, in their fixed order (checkpoint,
  metrics, Parquet row, the caller's ``on_round``, progress);
* :mod:`.checkpoint` — ``checkpoint.pkl`` (and the previous round's beside it) and
  :func:`load_run` (``dpfl run --resume``);
* :mod:`.compare` — ``dpfl compare``: several runs side by side.

The names below are loaded on first use (PEP 562): a check that fails before the
engine's heavy modules (torch, pandas) are needed does not wait for their import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from engine.simulation.checkpoint import load_run
    from engine.simulation.preparation import Prepared, make_executor, prepare
    from engine.simulation.privacy_plan import PrivacyPlan, plan_privacy, sampling_spec
    from engine.simulation.runner import SimulationResult, simulate

#: Each public name and the module that defines it.
_HOMES = {
    "load_run": "checkpoint",
    "Prepared": "preparation",
    "make_executor": "preparation",
    "prepare": "preparation",
    "PrivacyPlan": "privacy_plan",
    "plan_privacy": "privacy_plan",
    "sampling_spec": "privacy_plan",
    "SimulationResult": "runner",
    "simulate": "runner",
}

__all__ = [
    "PrivacyPlan",
    "Prepared",
    "SimulationResult",
    "load_run",
    "make_executor",
    "plan_privacy",
    "prepare",
    "sampling_spec",
    "simulate",
]


def __getattr__(name: str) -> Any:
    """``simulate``, ``prepare`` & co. from their module, imported on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine.simulation' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engine.simulation.{home}"), name)
    globals()[name] = value
    return value
