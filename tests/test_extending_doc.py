"""docs/extending.md is run, not only read: its Python blocks, in order, as one module
(what they define is registered under that module's name, as a user's module would
be). Each block asserts what it shows (a piece's column, a server step's effect at the
same ε, a participation and noise scheme accounted as dp-accounting composes their
declared event, the default noise refusing that participation, callbacks that add a
column and stop the run); the registry is left as it was."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from algorithms import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
MODULE = "dpfl_extending_doc"


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)


@pytest.mark.filterwarnings("ignore:sampling.mode=fixed is accounted:UserWarning")
def test_the_extending_guide_runs_as_written() -> None:
    code = blocks()
    assert len(code) >= 6
    before = {s.name for s in registry.specs()}
    module = types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    try:
        for i, block in enumerate(code):
            exec(compile(block, f"{DOC}:block{i}", "exec"), module.__dict__)  # noqa: S102
    finally:
        for name in [s.name for s in registry.specs() if s.name not in before]:
            registry.unregister(name)
        del sys.modules[MODULE]
    assert {s.name for s in registry.specs()} == before
