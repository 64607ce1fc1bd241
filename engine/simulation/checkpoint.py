"""The round checkpoint of a ``dpfl run`` (``checkpoint.pkl``: model, server and
per-client state, and the round's row), written before the row is released, and
:func:`load_run`, which reads it back for ``dpfl run --resume``."""

from __future__ import annotations

from pathlib import Path

from engine.config import ConfigError, RunConfig
from engine.results import atomic_write
from engine.results.run_folder import CHECKPOINT_FILE


def save_checkpoint(out_dir: Path, state: dict) -> None:
    """Atomically write the round checkpoint (before the round's row is released)."""
    import pickle

    # a full disk: one error naming the file, the old one kept
    with atomic_write(Path(out_dir) / CHECKPOINT_FILE) as tmp:
        tmp.write_bytes(pickle.dumps(state))


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
