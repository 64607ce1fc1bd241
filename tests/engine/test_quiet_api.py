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
over = ["rounds=2", "dataset.num_clients=60", "ray.num_workers=1", f"out={sys.argv[1]}"]
print("done", simulate(load_config(overrides=over)).final_accuracy)
"""


def test_simulate_keeps_ray_output_in_ray_log(tmp_path) -> None:
    """Before this was so, the same script printed Ray's token-authentication notice and
    the core worker's ``core_worker.cc ... max_restarts`` line on stderr (the C++ line
    is logged once per process, so a verbose run in the same process cannot show it
    again; ``test_cli.py`` checks ``--verbose`` for the CLI)."""
    done = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path / "quiet")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "done" in done.stdout
    console = done.stderr + done.stdout
    assert "core_worker" not in console and "Token authentication" not in console, console
    assert "core_worker" in (tmp_path / "quiet" / "ray.log").read_text()  # kept here
