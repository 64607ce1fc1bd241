"""Import a module of the ``benchmarks`` package in tests (``benchmarks/<filename>``),
and the command that runs one as a script (``python -m benchmarks.<name>``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def load_benchmark(filename: str, module_name: str | None = None) -> ModuleType:
    """``benchmarks/<filename>`` as the module ``benchmarks.<stem>`` (``module_name`` is
    ignored: the package's modules import each other by their package names)."""
    return importlib.import_module(f"benchmarks.{Path(filename).stem}")


def benchmark_command(filename: str, *args: str) -> list[str]:
    """The command running ``benchmarks/<filename>`` from the repository root."""
    return [sys.executable, "-m", f"benchmarks.{Path(filename).stem}", *args]
