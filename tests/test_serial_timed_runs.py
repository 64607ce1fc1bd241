"""Benchmarks and GPU tests run serially although ``addopts`` asks for two workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import selects_timed_tests

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("expr", "timed"),
    [
        ("benchmark", True),
        ("gpu", True),
        ("gpu and not slow", True),
        ("not gpu and not benchmark", False),
        ("not  benchmark", True),
        ("", False),
        ("slow", False),
        ("ray or benchmark", True),
        ("not (gpu)", True),
        ("not gpu", True),
        ("not (gpu or benchmark)", False),
        ("not slow", True),
        ("gpu and", False),
    ],
)
def test_timed_selections_are_recognised(expr: str, timed: bool) -> None:
    assert selects_timed_tests(expr) is timed


def test_reports_its_worker() -> None:
    """The probe of the test below: writes which xdist worker ran it (``main`` for a
    serial run) to the file named by ``DPFL_WORKER_PROBE``. Skipped on its own."""
    probe = os.environ.get("DPFL_WORKER_PROBE")
    if not probe:
        pytest.skip("only run as the probe of test_a_benchmark_selection_runs_in_one_process")
    Path(probe).write_text(os.environ.get("PYTEST_XDIST_WORKER", "main"))


def test_a_benchmark_selection_runs_in_one_process(tmp_path: Path) -> None:
    """xdist names each worker in ``PYTEST_XDIST_WORKER`` (gw0, gw1, ...); a serial run
    has none."""
    probe = "tests/test_serial_timed_runs.py::test_reports_its_worker"
    # This test may itself run in an xdist worker, whose variables the child inherits.
    outer_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    ran_in = {}
    for expr in ("benchmark or not benchmark", "not gpu and not benchmark"):
        report = tmp_path / f"{len(ran_in)}.txt"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", expr, probe],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**outer_env, "DPFL_WORKER_PROBE": str(report)},
        )
        assert done.returncode == 0, done.stdout[-2000:]
        ran_in[expr] = report.read_text()
    assert ran_in["benchmark or not benchmark"] == "main"
    assert ran_in["not gpu and not benchmark"].startswith("gw")
