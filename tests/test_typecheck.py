"""engine/ and algorithms/ type-check clean under mypy ([tool.mypy] in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_engine_and_algorithms_type_check_clean() -> None:
    # --cache-dir=/dev/null: mypy writes no cache (a fresh one was thrown away after
    # each run anyway; writing it for torch, ray, pandas... cost ~7% of the run).
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", "/dev/null"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout
