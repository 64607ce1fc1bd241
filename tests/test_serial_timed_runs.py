"""Benchmarks and GPU tests run serially although ``addopts`` asks for two workers."""

from __future__ import annotations

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
    ],
)
def test_timed_selections_are_recognised(expr: str, timed: bool) -> None:
    assert selects_timed_tests(expr) is timed


def test_a_benchmark_selection_runs_in_one_process() -> None:
    """xdist announces its workers (``-q``: "bringing up nodes..."); a serial run does not."""
    probe = "tests/test_serial_timed_runs.py::test_timed_selections_are_recognised"
    runs = {}
    for expr in ("benchmark or not benchmark", "not gpu and not benchmark"):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", expr, probe],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout[-2000:]
        runs[expr] = done.stdout
    assert "bringing up nodes" not in runs["benchmark or not benchmark"]
    assert "bringing up nodes" in runs["not gpu and not benchmark"]
