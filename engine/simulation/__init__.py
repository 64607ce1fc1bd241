"""Simulation: one federated run from its config to its results.

:func:`simulate` validates the config, resolves the privacy plan, builds the data and
the workers, runs the rounds and writes the results. Its modules, in the order a run
uses them:

* :mod:`.privacy_plan` — :func:`sampling_spec` and :func:`plan_privacy` (δ, the
  accountant, σ↔ε), resolved before any training;
* :mod:`.preparation` — :func:`prepare` (every check that needs no training; the
  dataset and the run's pipeline) and :func:`make_executor` (the worker pool);
* :mod:`.runner` — :func:`simulate`, its round loop, and :class:`SimulationResult`;
* :mod:`.callbacks` — the per-round side effects, in their fixed order (checkpoint,
  metrics, Parquet row, the caller's ``on_round``, progress);
* :mod:`.checkpoint` — ``checkpoint.pkl`` and :func:`load_run` (``dpfl run --resume``);
* :mod:`.compare` — ``dpfl compare``: several runs side by side.
"""

from __future__ import annotations

from engine.simulation.checkpoint import load_run
from engine.simulation.preparation import Prepared, make_executor, prepare
from engine.simulation.privacy_plan import PrivacyPlan, plan_privacy, sampling_spec
from engine.simulation.runner import SimulationResult, simulate
from engine.telemetry import timeline

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

timeline.mark("imports done")  # dpfl run: engine.simulation (torch, dp-accounting, pandas) loaded
