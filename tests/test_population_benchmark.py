"""benchmarks/population.py --quick runs and reports consistent numbers (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_command

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.benchmark
def test_population_benchmark_quick(tmp_path):
    out = tmp_path / "pop.json"
    subprocess.run(
        benchmark_command("population.py", "--quick", "--json", str(out)),
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    r = json.loads(out.read_text())
    (mat,) = r["materialised"]
    assert mat["clients"] == 20000 and mat["data_bytes"] > 0 and mat["setup_cpu_s"] > 0
    assert mat["peak_rss_bytes"] >= mat["data_bytes"]  # RSS holds the data it reports
    assert [row["clients"] for row in r["on_demand"]] == [1000, 20000]
    assert all(row["mean_cohort"] > 0 for row in r["on_demand"])
