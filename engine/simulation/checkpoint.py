"""The round checkpoint of a ``dpfl run`` (``checkpoint.pkl``: model, server and
per-client state, and the round's row), written before the row is released, with the
checkpoint before it kept beside it (``checkpoint.previous.pkl``), and
:func:`load_run`, which reads it back for ``dpfl run --resume``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from engine.config import ConfigError, RunConfig
from engine.results import atomic_write
from engine.results.run_folder import CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE


def save_checkpoint(out_dir: Path, state: dict) -> None:
    """Write the round checkpoint (before the round's row is released), keeping the
    one it replaces as ``checkpoint.previous.pkl``.

    Order: the last checkpoint becomes the previous one first (a hard link, renamed over
    the older previous one; a copy where the file system has no hard links), then the
    new one replaces the last atomically. At every instant ``checkpoint.pkl`` exists
    (the old or the new state) and the previous one is intact, so a damaged last
    checkpoint resumes from the one before (:mod:`engine.results.run_folder`)."""
    import pickle

    out = Path(out_dir)
    last = out / CHECKPOINT_FILE
    data = pickle.dumps(state)
    if last.exists():
        with atomic_write(out / PREVIOUS_CHECKPOINT_FILE) as tmp:
            tmp.unlink(missing_ok=True)  # a stale one, left by a crash
            try:
                os.link(last, tmp)
            except OSError:  # no hard links on this file system: a copy
                shutil.copyfile(last, tmp)
    # a full disk: one error naming the file, the old one kept
    with atomic_write(last) as tmp:
        tmp.write_bytes(data)


def load_run(out_dir: str | Path) -> tuple[RunConfig, dict]:
    """(config, checkpoint) of an interrupted ``dpfl run`` whose results are in
    ``out_dir``, after :func:`engine.results.run_folder.check_run_folder` checked the config,
    the checkpoint and every released row; raises ConfigError naming the missing or
    damaged file."""
    from engine.results.run_folder import check_run_folder

    folder = check_run_folder(out_dir)
    if folder.state is None:
        path = Path(out_dir) / CHECKPOINT_FILE
        raise ConfigError(f"--resume {out_dir}: {path} is missing (no round has ended)")
    return folder.config, folder.state
