"""What ``dpfl run --resume DIR`` continues from, checked before anything is written.

A run's folder holds ``config.json`` (the resolved config), ``checkpoint.pkl`` (the
state after round d, with round d's row), ``checkpoint.previous.pkl`` (the state after
round d − 1: the last checkpoint, kept before the next one replaced it) and
``rounds.parquet`` (the released rows, one per round). :func:`check_run_folder` reads
them and decides:

* ``complete``: the checkpoint is at the last round and every row is on disk;
  nothing is left to do and nothing is rewritten;
* ``continue``: the checkpoint is at round d and the rows on disk are exactly rounds
  1..d (or 1..d-1: the crash fell between the checkpoint and its row, which the
  checkpoint holds and the resume releases); each row on disk agrees with the run
  (algorithm, seed) and the row of round d with the checkpoint's copy;
* ``start``: neither a checkpoint nor any row exists (the run died before its first
  round ended): it starts from round 0 in the same folder, as it would have run.

A damaged or missing ``checkpoint.pkl`` is replaced by the previous checkpoint when
that one is intact: the run continues from round d − 1 as above. Round d may then have
been released already (its row written after its checkpoint); a seeded simulation
computes it again bit for bit (the same cohort, the same noise; the resume checks the
row it computes against the released one), so it is continued; under
``privacy.secure_noise`` a second computation would draw fresh noise, a second release
of round d that the accountant never composed, so it is refused.

Anything else is refused with one line naming the damaged or missing file and what
is left to do, before a byte is written. In particular a resume never continues
with fewer released rows than the checkpoint's round (rows would be lost silently)
and never computes a released round again: under client-level DP a round released
twice with different noise costs more than the one round the accountant composed.
"""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from engine.config import ConfigError, RunConfig

CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pkl"
#: The checkpoint before the last, kept beside it (engine.simulation.checkpoint).
PREVIOUS_CHECKPOINT_FILE = "checkpoint.previous.pkl"
ROUNDS_FILE = "rounds.parquet"
#: Columns of the checkpoint's row compared with the row of its round on disk.
AGREEING = ("round", "epsilon", "noise_multiplier", "test_accuracy", "test_loss")


@dataclass(frozen=True)
class RunFolder:
    """The checked state of a run's folder (see the module docstring)."""

    config: RunConfig
    status: str  # "complete", "continue" or "start"
    state: dict | None  # the checkpoint (None for "start")
    rows: pd.DataFrame  # the released rows on disk, rounds 1..m in order
    rounds_done: int  # the checkpoint's round (0 for "start")
    #: why checkpoint.pkl was not used and the previous checkpoint was (else None)
    fallback: str | None = None


def _refuse(out: Path, what: str, left: str) -> ConfigError:
    return ConfigError(f"--resume {out}: {what}; {left} (nothing was changed)")


def _start_again(out: Path) -> str:
    return (
        f"the run cannot be continued: start it again with dpfl run --out {out} "
        "--overwrite and its config"
    )


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _read_config(out: Path, restart: str) -> RunConfig:
    from engine.config import config_from_dict, replace

    path = out / CONFIG_FILE
    if not path.is_file():
        seeds = sorted(p.name for p in out.glob("seed*") if (p / CONFIG_FILE).is_file())
        if seeds:
            raise ConfigError(
                f"--resume {out}: a folder of runs with --seeds; resume each run on its "
                f"own: {', '.join(str(out / s) for s in seeds)}"
            )
        if (out / CHECKPOINT_FILE).exists() or (out / ROUNDS_FILE).exists():
            raise _refuse(out, f"{path} is missing", restart)
        raise ConfigError(f"--resume {out}: {path} is missing (expected the folder of a dpfl run)")
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))["config"]
        config = config_from_dict(tree)
    except (ValueError, KeyError, TypeError, ConfigError, UnicodeDecodeError) as e:
        raise _refuse(out, f"{path} is damaged ({_why(e)})", restart) from None
    return replace(config, out=str(out))


def _load_checkpoint(path: Path, config: RunConfig) -> tuple[dict | None, str | None]:
    """(state, None) for a readable checkpoint; (None, what is wrong) otherwise."""
    if not path.exists():
        return None, f"{path} is missing"
    try:
        state = pickle.loads(path.read_bytes())
        done = int(state["server"]["rounds_done"])
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is a damaged file
        return None, f"{path} is damaged ({_why(e)})"
    if not 1 <= done <= config.rounds:
        return None, (
            f"{path} is at round {done}, outside rounds=1..{config.rounds} of {CONFIG_FILE}"
        )
    return state, None


def _read_checkpoint(
    out: Path, config: RunConfig, restart: str, released: int
) -> tuple[dict | None, str | None]:
    """The state to continue from and, when it is the previous checkpoint, why the
    last one was not used. ``released``: the rounds on disk."""
    last, wrong = _load_checkpoint(out / CHECKPOINT_FILE, config)
    if last is not None:
        return last, None
    previous, _ = _load_checkpoint(out / PREVIOUS_CHECKPOINT_FILE, config)
    if previous is None:
        if not (out / CHECKPOINT_FILE).exists():
            return None, None  # no round ended (or nothing left to continue from)
        raise _refuse(out, str(wrong), restart)
    done = int(previous["server"]["rounds_done"])
    if released > done and config.privacy.secure_noise:
        raise _refuse(
            out,
            f"{wrong}, and {out / PREVIOUS_CHECKPOINT_FILE} is at round {done}, before the "
            f"released round {done + 1}, which release mode (privacy.secure_noise) cannot "
            "compute again without a second release",
            restart,
        )
    return previous, f"{wrong}; continuing from {out / PREVIOUS_CHECKPOINT_FILE} (round {done})"


def _read_rows(out: Path, restart: str) -> pd.DataFrame | None:
    path = out / ROUNDS_FILE
    if not path.exists():
        return None
    try:
        rows = pd.read_parquet(path)
        rounds = [int(r) for r in rows["round"]]
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise _refuse(
            out,
            f"{path} is damaged ({_why(e)}): its released rows cannot be read",
            restart,
        ) from None
    if rounds != list(range(1, len(rounds) + 1)):
        raise _refuse(out, f"{path} does not hold rounds 1..{len(rounds)} in order", restart)
    return rows


def _same(a: Any, b: Any) -> bool:
    try:
        fa, fb = float(a), float(b)
    except (TypeError, ValueError):
        return bool(a == b)
    return (math.isnan(fa) and math.isnan(fb)) or fa == fb


def check_run_folder(out: str | Path, restart: str | None = None) -> RunFolder:
    """Read and check the folder of an interrupted (or finished) ``dpfl run``;
    ConfigError (one line naming the file and what is left) when it cannot be
    continued without losing or recomputing a released round. Writes nothing.
    ``restart``: the choice the refusal names (default: ``dpfl run --overwrite``)."""
    out = Path(out)
    restart = restart or _start_again(out)
    if not out.is_dir():
        raise ConfigError(f"--resume {out}: no such folder")
    config = _read_config(out, restart)
    rows = _read_rows(out, restart)
    m = 0 if rows is None else len(rows)
    state, fallback = _read_checkpoint(out, config, restart, m)
    ckpt = out / (CHECKPOINT_FILE if fallback is None else PREVIOUS_CHECKPOINT_FILE)
    if state is None:
        if m == 0:
            return RunFolder(config, "start", None, pd.DataFrame(), 0)
        raise _refuse(
            out,
            f"{ckpt} is missing but {out / ROUNDS_FILE} holds {m} released rounds, "
            "which cannot be continued without the state after them",
            restart,
        )
    done = int(state["server"]["rounds_done"])
    assert rows is not None or m == 0
    # From the previous checkpoint, round done + 1 may have been released: a seeded
    # run computes it again bit for bit (checked against the released row).
    if m > done + (fallback is not None):
        raise _refuse(
            out,
            f"{out / ROUNDS_FILE} holds {m} rounds but {ckpt} is at round {done} "
            "(continuing would compute released rounds again)",
            restart,
        )
    pending = state.get("row")
    if m < done - 1 or (m == done - 1 and (pending is None or int(pending["round"]) != done)):
        where = f"{out / ROUNDS_FILE} holds {m} rounds" if m else f"{out / ROUNDS_FILE} is missing"
        raise _refuse(
            out,
            f"{where} but {ckpt} is at round {done}: the rows of rounds {m + 1}.."
            f"{done - (1 if pending is not None else 0)} are lost",
            restart,
        )
    if rows is not None and m:
        for col, want in (("algorithm", config.algorithm), ("seed", config.seed)):
            if col in rows and any(not _same(v, want) for v in rows[col]):
                raise _refuse(
                    out,
                    f"{out / ROUNDS_FILE} holds rows of another run ({col} is not "
                    f"{want!r} as in {CONFIG_FILE})",
                    restart,
                )
        if m >= done and pending is not None:
            last = rows.iloc[done - 1]
            for col in AGREEING:
                if col in rows and col in pending and not _same(last[col], pending[col]):
                    raise _refuse(
                        out,
                        f"round {done} of {out / ROUNDS_FILE} disagrees with {ckpt} "
                        f"({col}: {last[col]!r} != {pending[col]!r})",
                        restart,
                    )
    status = "complete" if done == config.rounds and m == done else "continue"
    frame = rows if rows is not None else pd.DataFrame()
    return RunFolder(config, status, state, frame, done, fallback)
