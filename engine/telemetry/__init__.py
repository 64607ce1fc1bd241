"""Telemetry: what a run reports about itself while it runs, without changing it.

:mod:`.phases` times the phases of a round (benchmarks), :mod:`.timeline` marks
start-up and exit (``DPFL_TIMELINE``), and :mod:`.metrics` exports per-round gauges to
Ray's metrics agent (Prometheus, the dashboard, Grafana).
"""
