"""The shipped Grafana dashboard is the rendering of :func:`cluster.monitoring.grafana_dashboard`
and charts every dpfl series. (No Grafana here: its queries are run against a real
Prometheus in tests/integration/test_monitoring.py.)"""

from __future__ import annotations

import json

from cluster.monitoring import GRAFANA_DASHBOARD, grafana_dashboard
from engine.telemetry.metrics import DESCRIPTIONS


def test_shipped_file_equals_the_rendering() -> None:
    shipped = json.loads(GRAFANA_DASHBOARD.read_text())
    assert shipped == grafana_dashboard(), (
        "regenerate: python -c 'import json; from cluster.monitoring import *; "
        "GRAFANA_DASHBOARD.write_text(json.dumps(grafana_dashboard(), indent=2, "
        'ensure_ascii=False) + "\\n")\''
    )


def test_one_panel_per_series_with_its_description() -> None:
    panels = grafana_dashboard()["panels"]
    assert [p["title"] for p in panels] == list(DESCRIPTIONS)
    for p in panels:
        assert p["description"] == DESCRIPTIONS[p["title"]]
        (target,) = p["targets"]
        assert f"ray_dpfl_{p['title']}" in target["expr"]
        assert "$Run" in target["expr"] and "$SessionName" in target["expr"]
