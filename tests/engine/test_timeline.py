"""engine.timeline: marks are recorded only when DPFL_TIMELINE names a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import timeline


def test_marks_are_written_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.mark("off")
    timeline.dump()
    assert not path.exists()
    monkeypatch.setenv(timeline.ENV, str(path))
    timeline.mark("a")
    timeline.mark("b")
    timeline.dump()
    timeline.dump()  # nothing left: no duplicate lines
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r[0] for r in rows] == ["a", "b"]
    assert rows[0][1] <= rows[1][1]
