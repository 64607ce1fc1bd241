"""Remembered noise calibrations: z(ε) found once, re-checked by the accountant at each use.

Calibrating the noise multiplier is a root search over the accountant (about 20
evaluations of the RDP or PLD of the whole run): 0.8 s of the 1 s ``dpfl run`` spends
before it starts any worker, and the same search is repeated by every trial of a sweep
at a fixed ε. Its answer is a pure function of its inputs, so it is remembered in the
process and on disk, one small JSON file per input set, under ``$DPFL_CACHE_DIR``
(default ``$XDG_CACHE_HOME/dpfl`` or ``~/.cache/dpfl``), in ``calibration/``. Set
``DPFL_CACHE_DIR=off`` to keep nothing on disk. A folder that cannot be written is
skipped without error: the store only saves time.

Privacy: a remembered z is a hint, never a guarantee. The caller
(:func:`engine.privacy.resolve.calibrate_noise_multiplier`) recomputes ε(z) with the
accountant at reporting precision and uses z only if it is within the target, else it
searches afresh; the ε that dpfl reports is computed from the z that ran either way.
The key holds every input of the search (target ε, δ, the sampling facts, rounds,
accountant, tolerance, bracket and discretisation) and the dp-accounting version, and an
entry is read only when its stored key equals the one asked for, so an answer from
another setting or library version is never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.base.atomic import atomic_write

#: Bump when the search itself changes (its answer for the same inputs would differ).
SEARCH_VERSION = 1
MAX_IN_PROCESS = 4096

_remembered: dict[str, float] = {}


@cache
def _dp_accounting_version() -> str:
    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source checkout
        return "unknown"


def calibration_key(**inputs: Any) -> str:
    """A canonical string of the search's inputs (floats written exactly, by repr)."""
    fields = {
        k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
        for k, v in inputs.items()
    }
    fields["search_version"] = SEARCH_VERSION
    fields["dp_accounting"] = _dp_accounting_version()
    return json.dumps(fields, sort_keys=True, default=repr)


def store_dir() -> Path | None:
    """Where calibrations are kept on disk; None when ``DPFL_CACHE_DIR=off``."""
    root = os.environ.get("DPFL_CACHE_DIR")
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    if root:
        return Path(root) / "calibration"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpfl" / "calibration"


def _file(key: str) -> Path | None:
    folder = store_dir()
    if folder is None:
        return None
    return folder / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def recall(key: str) -> float | None:
    """The z remembered for ``key`` (in this process, else on disk), or None."""
    z = _remembered.get(key)
    if z is not None:
        return z
    path = _file(key)
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text())
        stored_key, z = entry["key"], float(entry["noise_multiplier"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if stored_key != key or not (math.isfinite(z) and z > 0):
        return None
    _remembered[key] = z
    return z


def remember(key: str, noise_multiplier: float) -> None:
    """Keep ``noise_multiplier`` for ``key``: in this process and, if possible, on disk."""
    z = float(noise_multiplier)
    if len(_remembered) >= MAX_IN_PROCESS:
        _remembered.clear()
    _remembered[key] = z
    path = _file(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # atomic: a concurrent reader sees the old file or this one
        with atomic_write(path, unique=True) as tmp:
            tmp.write_text(json.dumps({"key": key, "noise_multiplier": z}))
    except OSError:
        return


def forget_in_process() -> None:
    """Drop what this process remembers (the disk store stays); for tests and benchmarks."""
    _remembered.clear()
