"""Live run metrics for the Ray dashboard (``ray.util.metrics``), one set per process.

Each completed round updates, tagged by ``run``, ``trial`` and ``algorithm``:

=========================================  =======  ==========================================
metric (Prometheus name)                   kind     value
=========================================  =======  ==========================================
dpfl_rounds_completed                      counter  +1 per round
dpfl_epsilon_spent                         gauge    the accountant's cumulative ε
dpfl_test_accuracy                         gauge    last test accuracy (public test set)
dpfl_client_updates_per_second_nonprivate  gauge    clients trained in the round / its seconds
dpfl_seconds_per_round_nonprivate          gauge    wall seconds of the round
dpfl_clipped_fraction_nonprivate           gauge    fraction of the round's updates clipped
=========================================  =======  ==========================================

Ray (2.5x, OpenTelemetry) exports them with a ``ray_`` prefix to the Prometheus
endpoint of each node: ``ray_dpfl_epsilon_spent`` and the other gauges under their own
name, the counter as ``ray_dpfl_rounds_completed_total``. ``run`` is the actor-name
prefix: ``dpfl-<results folder>`` for ``dpfl run`` (:func:`run_label`), the Tune trial's
name in a sweep. :data:`DESCRIPTIONS` (Prometheus's HELP line) gives each one's unit.
The dashboard's Metrics view charts them once Prometheus and Grafana are attached
(README, "Dashboard metrics"; ``cluster/monitoring.py``). The ε is the accountant's.
Names ending in ``_nonprivate`` are operator diagnostics computed from private data
(README, "Privacy"): updates per second carries the realised (Poisson, hence private)
cohort size, and round timings carry the timing of private computation; the
simulation's operator sees everything, they are never part of a released result.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

TAG_KEYS = ("run", "trial", "algorithm")
_METRICS: dict[str, Any] = {}


def round_metrics(row: dict[str, Any], seconds: float) -> dict[str, float]:
    """The gauge values of one round (NaN-free: a value that is not known is omitted)."""
    out: dict[str, float] = {"seconds_per_round_nonprivate": float(seconds)}
    eps = row.get("epsilon", math.nan)
    if eps is not None and math.isfinite(eps):
        out["epsilon_spent"] = float(eps)
    acc = row.get("test_accuracy", math.nan)
    if acc is not None and not math.isnan(acc):
        out["test_accuracy"] = float(acc)
    n = row.get("realised_cohort_size_nonprivate")
    if n is not None and seconds > 0:
        out["client_updates_per_second_nonprivate"] = float(n) / seconds
    clipped = row.get("clipped_fraction_nonprivate", math.nan)
    if clipped is not None and not math.isnan(clipped):
        out["clipped_fraction_nonprivate"] = float(clipped)
    return out


#: Description of each series (Prometheus's HELP line, shown by Grafana and Prometheus's
#: UI): what it is and its unit. Ray's metrics have no unit field, so the unit is here.
DESCRIPTIONS = {
    "rounds_completed": "dpfl: rounds completed by this run or trial (count; the round "
    "number of the last round released)",
    "epsilon_spent": "dpfl: cumulative epsilon spent, from the accountant at the run's "
    "delta (dimensionless; excludes hyperparameter tuning)",
    "test_accuracy": "dpfl: test accuracy of the global model on the public test set "
    "(fraction 0-1; last evaluated round)",
    "client_updates_per_second_nonprivate": "dpfl: client updates trained per wall second "
    "in the last round (1/s; NOT private: realised cohort size)",
    "seconds_per_round_nonprivate": "dpfl: wall seconds of the last round (s; NOT private: "
    "timing of private computation)",
    "clipped_fraction_nonprivate": "dpfl: fraction of the last round's client updates "
    "clipped (fraction 0-1; NOT private: computed from clients' data)",
}


def run_label(out_dir: str | Path) -> str:
    """The ``run`` tag and actor-name prefix of a ``dpfl run`` writing to ``out_dir``:
    ``dpfl-<folder name>`` (``dpfl-<folder>-seed<S>`` for one seed of ``--seeds``), so
    that the dashboard and Prometheus say which results folder a series or actor is."""
    path = Path(out_dir)
    name = path.name
    if name.startswith("seed") and name[4:].lstrip("-").isdigit():
        name = f"{path.parent.name}-{name}"
    return f"dpfl-{name}"


def _registry() -> dict[str, Any]:
    if not _METRICS:
        from ray.util.metrics import Counter, Gauge

        _METRICS["rounds_completed"] = Counter(
            "dpfl_rounds_completed",
            description=DESCRIPTIONS["rounds_completed"],
            tag_keys=TAG_KEYS,
        )
        for name, text in DESCRIPTIONS.items():
            if name != "rounds_completed":
                _METRICS[name] = Gauge(f"dpfl_{name}", description=text, tag_keys=TAG_KEYS)
    return _METRICS


class RunMetrics:
    """Records every round of one run; a no-op when Ray is not initialised."""

    def __init__(self, run: str, trial: str, algorithm: str) -> None:
        # A process that has not imported Ray has not initialised it: an in-process
        # run (ray.executor=local) does not import Ray (~0.5 s) just to learn that.
        ray = sys.modules.get("ray")
        self.tags = {"run": run, "trial": trial, "algorithm": algorithm}
        self.enabled = ray is not None and ray.is_initialized()
        self.last: dict[str, float] = {}

    def record(self, row: dict[str, Any], seconds: float) -> dict[str, float]:
        values = round_metrics(row, seconds)
        self.last = values
        if not self.enabled:
            return values
        metrics = _registry()
        metrics["rounds_completed"].inc(1.0, tags=self.tags)
        for name, value in values.items():
            metrics[name].set(value, tags=self.tags)
        return values
