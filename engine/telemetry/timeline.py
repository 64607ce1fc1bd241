"""Wall-clock marks of a ``dpfl`` process's phases: start-up, rounds, shutdown.

Off unless the environment variable ``DPFL_TIMELINE`` names a file: then :func:`mark`
records ``(label, time.time())`` in the driver and :func:`dump` appends the marks to
that file as JSON lines (``benchmarks/bench.py --workload w1`` reads them to split a
whole process into interpreter and imports, ``ray.init``, worker start, data, σ
calibration, rounds, final evaluation, writing and shutdown). Off, a mark is one
dictionary lookup. Marks read only the clock: no random stream, no computed value.
"""

from __future__ import annotations

import json
import os
import time

ENV = "DPFL_TIMELINE"
_marks: list[tuple[str, float]] = []


def mark(label: str) -> None:
    """Record that ``label`` happened now (nothing unless ``DPFL_TIMELINE`` is set)."""
    if os.environ.get(ENV):
        _marks.append((label, time.time()))


def dump() -> None:
    """Append the marks recorded so far to ``$DPFL_TIMELINE`` and forget them."""
    path = os.environ.get(ENV)
    if not path or not _marks:
        return
    with open(path, "a", encoding="utf-8") as f:
        for label, t in _marks:
            f.write(json.dumps([label, t]) + "\n")
    _marks.clear()
