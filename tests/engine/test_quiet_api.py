"""The Python API is as quiet as the CLI: ``simulate`` with the Ray executor keeps Ray's
console output (its notices, the core worker's C++ log lines) in ``ray.log``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import sys
from engine import load_config, simulate
out, verbose = sys.argv[1], sys.argv[2] == "1"
over = ["rounds=2", f"out={out}", "dataset.num_clients=60", "ray.num_workers=1"]
r = simulate(load_config(overrides=over), verbose=verbose)
print("final", r.final_accuracy)
"""


def _run(out: Path, verbose: bool) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CODE, str(out), "1" if verbose else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


def test_simulate_keeps_ray_output_in_ray_log(tmp_path) -> None:
    done = _run(tmp_path / "quiet", verbose=False)
    assert "final" in done.stdout
    # Ray's own lines (its logger's records, C++ lines on fd 2) are not on the console
    assert "core_worker" not in done.stderr + done.stdout, done.stderr
    assert "Token authentication" not in done.stderr + done.stdout, done.stderr
    log = (tmp_path / "quiet" / "ray.log").read_text()
    assert "core_worker" in log  # they are in the results folder


def test_verbose_simulate_shows_ray_output(tmp_path) -> None:
    """The check above can fail: with verbose=True Ray's lines reach the console."""
    done = _run(tmp_path / "loud", verbose=True)
    assert "core_worker" in done.stderr + done.stdout
    assert not (tmp_path / "loud" / "ray.log").exists()
