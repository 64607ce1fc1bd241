"""Reading ``rounds.parquet`` while a run in another process still writes it.

The writer replaces the file atomically (``os.replace``), yet ``pd.read_parquet(path)``
can still fail on it: pyarrow's dataset reader takes the file's size from one look at
the path and reads its pages through a later open, so a replacement in between gives
``OSError: Unexpected end of stream: Page was smaller (9) than expected (13)`` (measured
on this project's machine: 363 of 2,275 reads torn by a writer replacing a growing file
in a loop; 0 of 3,267 read as below). Reading the bytes through one open file reads
one version of the file, old or new, never a mix of the two.
"""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd


def read_live_rows(path: Path) -> pd.DataFrame | None:
    """The rows of ``path`` as one version of the file holds them; None before the
    first version exists."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return pd.read_parquet(io.BytesIO(data))


def released_rounds(path: Path) -> int:
    """How many rows the file holds now (0 before it exists)."""
    rows = read_live_rows(path)
    return 0 if rows is None else len(rows)
