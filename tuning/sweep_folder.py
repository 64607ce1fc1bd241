"""What ``dpfl tune --resume`` continues from, checked before anything is written.

A sweep's folder holds ``tune/runner.txt`` (how its trials were run),
``tune/experiment.json`` (the resolved config and the sweep's settings),
``unreleased/tuning_draws.json`` (the drawn numbers of trials, Papernot-Steinke modes),
each trial's released rows under ``rounds/`` (``<trial>-round<k>.parquet`` while it
runs, one ``<trial>.parquet`` once it ended), each trial's checkpoint
``trial_checkpoints/<trial>.pkl`` (written before each row) and ``trials.parquet``
(one row per trial, rebuilt from the rows at the end of every ``dpfl tune``, so a
damaged table is simply rebuilt).

:func:`check_sweep_folder` reads all of them and refuses, with one line naming the
file and what is left to do, a sweep that cannot continue without losing a released
row or computing a released round again: an unreadable row file or checkpoint that is
still needed, a trial whose rows stop before its checkpoint's round (rows lost), a
trial with rows beyond its checkpoint or rows but no checkpoint (released rounds would
be computed again, with noise a GPU need not reproduce: two releases of one round),
a config or sweep setting that differs from the one the sweep started with (its
trials would mix two experiments), or a lost record of the drawn numbers of trials
under secure noise (K cannot be drawn again without changing what was accounted).
A trial whose rows are complete needs no checkpoint.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine.results import _jsonable

EXPERIMENT_FILE = "experiment.json"
#: Keys that may differ between the start of a sweep and its resume: where Ray runs.
MAY_DIFFER = ("out", "ray.address")
#: Settings recorded only since dpfl recorded them: a sweep started before has none, and
#: resumes with today's value (its default then).
RECORDED_LATER = ("--metric", "--budget", "--tune.")


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _refuse(out: Path, what: str) -> ConfigError:
    return ConfigError(
        f"--resume --out {out}: {what}; start the sweep again with --overwrite "
        "(nothing was changed)"
    )


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flat(v, f"{key}."))
        else:
            flat[key] = v
    return flat


def experiment_record(config_tree: dict, settings: dict[str, Any]) -> dict[str, Any]:
    """What ``tune/experiment.json`` holds: the resolved config and the sweep's
    settings (algorithms, budgets, trials, search, tuning privacy)."""
    return {"config": config_tree, "settings": settings}


def read_runner(out: Path, runners: tuple[str, ...], marker: Path) -> str | None:
    """The runner recorded in ``tune/runner.txt``; None when the file is missing (a
    sweep of Tune's runner keeps Tune's state folders under ``tune/``)."""
    if not marker.exists():
        folder = out / "tune"
        if folder.is_dir() and any(p.is_dir() for p in folder.iterdir()):
            return "tune"
        return None
    try:
        runner = marker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise _refuse(out, f"{marker} is damaged ({_why(e)})") from None
    if runner not in runners:
        raise _refuse(
            out, f"{marker} is damaged (holds {runner[:20]!r}, not one of {', '.join(runners)})"
        )
    return runner


def check_experiment_record(out: Path, record: dict[str, Any]) -> None:
    """The sweep must continue with the config and settings it started with."""
    path = out / "tune" / EXPERIMENT_FILE
    if not path.exists():  # a sweep started before the record existed: not checked
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        before = {**_flat(saved["config"]), **_flat(saved["settings"], "--")}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise _refuse(out, f"{path} is damaged ({_why(e)})") from None
    now = {**_flat(record["config"]), **_flat(record["settings"], "--")}
    now = json.loads(json.dumps(now, default=_jsonable))  # as written (tuples -> lists)
    for key in sorted(set(before) | set(now)):
        if key in MAY_DIFFER:
            continue
        if key not in before and key.startswith(RECORDED_LATER):
            continue
        if before.get(key) != now.get(key):
            raise ConfigError(
                f"--resume --out {out}: {key}={now.get(key)!r} but the sweep started with "
                f"{before.get(key)!r} ({path}); resume it with the same --config/--set and "
                "flags (nothing was changed)"
            )


def read_experiment_record(out: Path) -> dict[str, Any] | None:
    """``tune/experiment.json`` (what ``dpfl tune --resume DIR`` takes its flags from), or
    None for a sweep started before it was written; ConfigError when damaged."""
    path = out / "tune" / EXPERIMENT_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record["config"], dict) or not isinstance(record["settings"], dict):
            raise TypeError("config and settings must be mappings")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise _refuse(out, f"{path} is damaged ({_why(e)})") from None
    return record


def check_draws(out: Path, secure: bool, has_rows: bool) -> None:
    """``unreleased/tuning_draws.json`` (Papernot-Steinke modes) must be readable; a
    lost one can be drawn again only when K comes from the seed (not secure noise)."""
    path = out / "unreleased" / "tuning_draws.json"
    if not path.exists():
        if secure and has_rows:
            raise _refuse(
                out,
                f"{path} is missing: the numbers of trials were drawn from OS entropy "
                "(privacy.secure_noise) and cannot be drawn again",
            )
        return
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        {str(k): int(v) for k, v in record["num_trials"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise _refuse(out, f"{path} is damaged ({_why(e)})") from None


def _trial_of(path: Path) -> str:
    return path.stem.rsplit("-round", 1)[0]


def check_trials(out: Path, rounds: int) -> None:
    """Every trial's rows and checkpoint (see the module docstring)."""
    import pyarrow.parquet as pq

    released: dict[tuple[Path, str], set[int]] = defaultdict(set)
    files: dict[tuple[Path, str], list[Path]] = defaultdict(list)
    root = out / "rounds"
    for path in sorted(root.rglob("*.parquet")) if root.is_dir() else []:
        if path.name.startswith("."):
            continue  # a temporary file of a write cut short: never read
        try:
            got = pq.read_table(path, columns=["round"]).column("round").to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise _refuse(
                out, f"{path} is damaged ({_why(e)}): its released rows cannot be read"
            ) from None
        key = (path.parent, _trial_of(path))
        released[key].update(int(r) for r in got)
        files[key].append(path)
    by_trial = {key[1]: key for key in released}
    folder = out / "trial_checkpoints"
    checkpoints = {p.stem: p for p in folder.glob("*.pkl")} if folder.is_dir() else {}
    complete = {tid for (_, tid), got in released.items() if got == set(range(1, rounds + 1))}
    for tid, path in sorted(checkpoints.items()):
        if tid in complete:
            continue  # its rows are all released: the checkpoint is never read again
        try:
            state = pickle.loads(path.read_bytes())
            done = int(state["server"]["rounds_done"])
            pending = state.get("row")
        except Exception as e:  # noqa: BLE001 - any unreadable pickle is a damaged file
            raise _refuse(out, f"{path} is damaged ({_why(e)})") from None
        got = released.get(by_trial[tid], set()) if tid in by_trial else set()
        m = max(got, default=0)
        where = ", ".join(str(p) for p in files.get(by_trial.get(tid, (out, tid)), []))
        if not where:  # the trial's folder, from the row its checkpoint holds
            cell = root
            if pending is not None and {"algorithm", "epsilon_budget"} <= set(pending):
                from tuning.rounds import rounds_dir

                cell = rounds_dir(out, pending["algorithm"], float(pending["epsilon_budget"]))
            where = f"{cell}/{tid}*.parquet (no file left)"
        if got != set(range(1, m + 1)):
            missing = sorted(set(range(1, m + 1)) - got)
            raise _refuse(out, f"trial {tid}: rounds {missing} are missing from {where}")
        if m > done:
            raise _refuse(
                out,
                f"trial {tid}: {where} holds {m} rounds but {path} is at round {done} "
                "(continuing would compute released rounds again)",
            )
        pending_round = int(pending["round"]) if pending is not None else None
        if m < done - 1 or (m == done - 1 and pending_round != done):
            lost = done - 1 if pending_round == done else done
            raise _refuse(
                out,
                f"trial {tid}: {path} is at round {done} but only {m} rounds are in {where} "
                f"(the rows of rounds {m + 1}..{lost} are lost)",
            )
    for key, got in sorted(released.items()):
        tid = key[1]
        if tid in complete or tid in checkpoints:
            continue
        where = ", ".join(str(p) for p in files[key])
        raise _refuse(
            out,
            f"trial {tid}: {folder / (tid + '.pkl')} is missing but {where} holds "
            f"{len(got)} of its {rounds} rounds (the trial would compute them again)",
        )


def check_sweep_folder(
    out: Path,
    *,
    rounds: int,
    record: dict[str, Any],
    papernot_steinke: bool,
    secure: bool,
) -> None:
    """Everything a resumed sweep reads, before it writes anything; ConfigError (one
    line naming the file) when it cannot continue without losing or recomputing a
    released row. (``tune/runner.txt`` is read by :func:`read_runner`.)"""
    check_experiment_record(out, record)
    has_rows = (out / "rounds").is_dir() and any((out / "rounds").rglob("*.parquet"))
    if papernot_steinke:
        check_draws(out, secure, has_rows)
    check_trials(out, rounds)
