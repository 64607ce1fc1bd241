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

Ray exports them with a ``ray_`` prefix (e.g. ``ray_dpfl_epsilon_spent``) to the
Prometheus endpoint of each node; the dashboard's Metrics view charts them once
Prometheus and Grafana are attached (README, "Cluster"). The ε is the accountant's.
Names ending in ``_nonprivate`` are operator diagnostics computed from private data
(README, "Privacy"): updates per second carries the realised (Poisson, hence private)
cohort size, and round timings carry the timing of private computation; the
simulation's operator sees everything, they are never part of a released result.
"""

from __future__ import annotations

import math
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


def _registry() -> dict[str, Any]:
    if not _METRICS:
        from ray.util.metrics import Counter, Gauge

        _METRICS["rounds_completed"] = Counter(
            "dpfl_rounds_completed", description="Rounds completed", tag_keys=TAG_KEYS
        )
        for name, text in (
            ("epsilon_spent", "Cumulative epsilon from the accountant"),
            ("test_accuracy", "Test accuracy of the global model"),
            ("client_updates_per_second_nonprivate", "Clients trained per second"),
            ("seconds_per_round_nonprivate", "Wall seconds per round"),
            ("clipped_fraction_nonprivate", "Fraction of client updates clipped (non-private)"),
        ):
            _METRICS[name] = Gauge(f"dpfl_{name}", description=text, tag_keys=TAG_KEYS)
    return _METRICS


class RunMetrics:
    """Records every round of one run; a no-op when Ray is not initialised."""

    def __init__(self, run: str, trial: str, algorithm: str) -> None:
        import ray

        self.tags = {"run": run, "trial": trial, "algorithm": algorithm}
        self.enabled = ray.is_initialized()
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
