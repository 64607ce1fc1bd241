"""Results on disk: ``config.json`` and ``rounds.parquet`` (one row per round).

``rounds.parquet`` is rewritten atomically (write to a temporary file, then
``os.replace``) after every round, so a crash at any point leaves a readable file
holding every completed round. Rewriting costs milliseconds for thousands of rows.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd


class RoundWriter:
    """Accumulates round rows and keeps ``out_dir/rounds.parquet`` current."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "rounds.parquet"
        self.rows: list[dict[str, Any]] = []

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))
        self.flush()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def flush(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with writing(self.path, tmp):
            self.frame().to_parquet(tmp, index=False)
            os.replace(tmp, self.path)


@contextlib.contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Write ``path`` (through ``tmp``, then ``os.replace``): an OSError (a full disk,
    a read-only or forbidden folder) is raised again as an OSError naming ``path``,
    with its errno (pyarrow's errors carry it only in their text), after the partial
    ``tmp`` is removed; the previous ``path`` is left as it was."""
    try:
        yield
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        code = e.errno
        if code is None:
            found = re.search(r"\[Errno (\d+)\]", str(e)) or re.search(
                r"errno[ =:]+(\d+)", str(e), re.IGNORECASE
            )
            code = int(found.group(1)) if found else None
        reason = os.strerror(code) if code else (str(e).splitlines()[0] if str(e) else "error")
        err = OSError(code or _errno.EIO, reason, str(path))
        raise err from e


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, tmp):
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable))
        os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
