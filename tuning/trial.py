"""One Tune trial = one simulation at a fixed budget ε with σ calibrated from it.

The trial's client workers and server are Ray actors created inside the trial's
placement group. Every round is written as its own Parquet file under
``DIR/rounds/algorithm=<a>/epsilon_budget=<ε>/`` (one file per (trial, round): no
append races), after the round has been checkpointed (server state, per-client
state; RNG streams are keyed by (seed, round) and ε by the round count, so that is the
whole state and a resumed trial equals an uninterrupted one) to Tune and to the
trial's own file. Checkpoint before release: a restored trial never recomputes a round
whose row was written (a recomputation need not be bit-identical on a GPU, and two
releases of one round with different noise would cost more than one round's ε).

Independent trials: trial k of (algorithm, ε) runs with its own seed,
:func:`trial_seed` (``engine.rng`` stream ``TRIAL_SEED`` keyed by the experiment seed,
algorithm, ε and k), recorded as ``trial_seed`` in its rows. Cohorts, noise, model
initialisation and minibatch order therefore differ between trials (two trials with
one seed would share their noise, and the difference of their models would be
noiseless). The data set is the experiment's: it is built from the experiment seed
(``data_seed``), so every trial tunes on the same clients.

Privacy note: each trial's ε is the ε of *that* trial alone. Selecting the best
trial on the same private data costs more (see ``tuning.report.tuning_epsilon`` and
the README's "privacy cost of tuning").
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.config import config_from_dict

PARTITIONS = ("algorithm", "epsilon_budget")
TUNE_STREAM = 9  # rng stream of random-search samples
#: Columns every row carries (NaN where unused) so that all files of the dataset share
#: one schema: pandas/pyarrow read a directory with the first file's schema.
STRING_COLUMNS = ("ls_scope", "ls_local")


def hyperparameter_columns() -> list[str]:
    from algorithms import RECIPES
    from algorithms.compose import PIECE_HYPERPARAMETERS

    names = {h for r in RECIPES.values() for h in r.hyperparameters}
    names |= {h for hs in PIECE_HYPERPARAMETERS.values() for h in hs}
    return sorted(
        names | {"personal_accuracy_nonprivate", "mia_auc_nonprivate", "clip_norm", "lr", "epochs"}
    )


def _as_float(value: Any) -> float:
    """``pd.to_numeric(errors="coerce")`` of one value, as float64: numbers and numeric
    strings convert, anything else (None, other text) is NaN."""
    if isinstance(value, str):
        return float(pd.to_numeric(value, errors="coerce"))
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def row_frame(row: dict[str, Any], columns: dict[str, str]) -> pd.DataFrame:
    """One row as a one-row frame, partition columns left out, every column of
    ``columns`` present with its fixed type (float64, or pandas' ``string``), the others
    typed as pandas infers them, columns sorted by name: all files of a sweep then share
    one schema (pandas/pyarrow read a directory with the first file's schema).

    Built column by column from typed one-element arrays, 0.6 ms, where casting the
    columns of a one-row frame one ``astype`` at a time took 4 ms idle and 12 ms under
    a sweep's load, more than a small trial's round (equal frames, tested)."""
    data: dict[str, Any] = {k: [v] for k, v in row.items() if k not in PARTITIONS}
    for col, kind in columns.items():
        value = data[col][0] if col in data else None
        if kind == "string":
            data[col] = pd.array([value], dtype="string")
        else:
            data[col] = np.array([_as_float(value)], dtype=np.float64)
    return pd.DataFrame({k: data[k] for k in sorted(data)})


def column_names(keys: list[str]) -> dict[str, str]:
    """Hyperparameter column = last part of its key (full key if that collides)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (n if last.count(n) == 1 else k.replace(".", "_")) for k, n in zip(keys, last)}


def rounds_dir(out: str | Path, algorithm: str, epsilon: float) -> Path:
    return Path(out) / "rounds" / f"algorithm={algorithm}" / f"epsilon_budget={epsilon:g}"


def write_round(out: str | Path, row: dict[str, Any], columns: dict[str, str]) -> Path:
    """Atomically write one (trial, round) row; partition columns live in the path."""
    folder = rounds_dir(out, row["algorithm"], row["epsilon_budget"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{row['trial_id']}-round{int(row['round']):05d}.parquet"
    frame = row_frame(row, columns)
    tmp = folder / f".{path.name}.tmp"
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return path


def compact_trial(out: str | Path, algorithm: str, epsilon: float, trial_id: str) -> Path | None:
    """Fold a finished trial's per-round files into one ``<trial_id>.parquet``.

    While a trial runs each round is its own file (readable at once, never rewritten);
    once it ends, one file per trial keeps a sweep of thousands of trials × hundreds of
    rounds quick to read. The compacted file also takes any earlier compacted file of
    the trial (a trial Tune restores after it ended), one row per round (the newest).
    It is written under a dot-name (ignored by readers) and renamed into place before
    the round files go, so a crash leaves at worst duplicate rows, which
    :func:`tuning.report.load_rounds` drops. Returns the file, or None with no rows."""
    folder = rounds_dir(out, algorithm, epsilon)
    target = folder / f"{trial_id}.parquet"
    parts = sorted(folder.glob(f"{trial_id}-round*.parquet"))
    sources = ([target] if target.exists() else []) + parts
    if not sources:
        return None
    frame = pd.concat([pd.read_parquet(p) for p in sources], ignore_index=True)
    frame = frame.drop_duplicates("round", keep="last").sort_values("round", ignore_index=True)
    tmp = folder / f".{target.name}.tmp"
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, target)
    for p in parts:
        p.unlink()
    return target


def compact_cell(out: str | Path, algorithm: str, epsilon: float) -> int:
    """Compact every trial of (algorithm, ε) that still has per-round files (trials a
    scheduler stopped, or that failed, end without compacting themselves). Call it once
    no trial of the cell runs. Returns the number of trials compacted."""
    folder = rounds_dir(out, algorithm, epsilon)
    ids = {p.name.rsplit("-round", 1)[0] for p in folder.glob("*-round*.parquet")}
    for trial_id in sorted(ids):
        compact_trial(out, algorithm, epsilon, trial_id)
    return len(ids)


def trial_seed(experiment_seed: int, algorithm: str, epsilon: float, index: int) -> int:
    """The run seed of trial ``index`` of (algorithm, ε): an ``engine.rng`` stream of its
    own, so no two trials share noise or cohorts (and none shares the experiment's)."""
    from engine import rng as rngs

    key = zlib.crc32(f"{algorithm}|{epsilon:g}".encode())
    return rngs.derive_seed(experiment_seed, rngs.TRIAL_SEED, key, int(index))


def trial_index(params: dict[str, Any], trial_id: str) -> int:
    """Trial k: the random-search sample index, else the counter in Tune's trial id
    (``<hash>_00003``), else a hash of the id (still distinct per trial)."""
    if "sample" in params:
        return int(params["sample"])
    tail = trial_id.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else zlib.crc32(trial_id.encode())


def round_record(
    row: dict[str, Any], event_columns: dict[str, Any], trial_id: str, hp_columns: dict[str, Any]
) -> dict[str, Any]:
    """One released row of a trial: the engine's row, the trial's event columns and id,
    and its sampled hyperparameters. Where a hyperparameter's column name is also a
    per-round column of the engine (``clip_norm`` is C_t under adaptive clipping, the
    sampled value only its start), the engine's per-round value is kept; the sampled
    value stays in ``trials.parquet``."""
    return {**hp_columns, **event_columns, "trial_id": trial_id, **row}


def trial_checkpoint_path(out: str | Path, trial_id: str) -> Path:
    """The trial's own round checkpoint (model, server and per-client state, incl.
    personal heads: not a release artefact), rewritten before every row."""
    return Path(out) / "trial_checkpoints" / f"{trial_id}.pkl"


def make_trainable(
    base: dict,
    algorithm: str,
    epsilon: float,
    out: str,
    every: int = 1,
    columns: dict[str, str] | None = None,
    space: dict[str, Any] | None = None,
):
    """A fresh Tune function trainable for (algorithm, ε) (``with_resources`` mutates it).

    ``columns`` maps every hyperparameter column of the experiment to its type. With
    ``space`` given (random search), the trial's parameter is only its sample index
    and its hyperparameters are drawn from (seed, algorithm, ε, index): every trial
    exists from the start (so a resume never loses one) and is reproducible.
    """
    if every != 1:  # a row released after a later checkpoint would be recomputed on resume
        raise ValueError(f"tune.checkpoint_every={every}: must be 1")
    columns = dict(columns or {})
    for c in hyperparameter_columns():
        columns.setdefault(c, "string" if c in STRING_COLUMNS else "float")

    def trainable(params: dict[str, Any]) -> None:
        from ray import tune

        from engine import rng as rngs
        from engine.config import replace, with_algorithm
        from engine.data import build_dataset
        from engine.simulate import sampling_spec, simulate

        hps = dict(params)
        ctx = tune.get_context()
        trial_id, trial_name = ctx.get_trial_id(), ctx.get_trial_name()
        index = trial_index(hps, trial_id)
        seed = trial_seed(int(base["seed"]), algorithm, epsilon, index)
        if space is not None:
            from tuning.spaces import sample

            key = zlib.crc32(f"{algorithm}|{epsilon:g}".encode())
            hps = sample(space, rngs.numpy_rng(base["seed"], TUNE_STREAM, key, hps["sample"]))
        config = with_algorithm(
            config_from_dict(base),
            algorithm,
            **{"privacy.epsilon": epsilon, "privacy.noise_multiplier": None},
            **hps,
        )
        # Same clients for every trial (experiment seed), own randomness (trial seed).
        dataset = build_dataset(config.dataset, rngs.numpy_rng(config.seed, rngs.DATA))
        spec = sampling_spec(config)
        event_columns = {  # what tuning.report needs to rebuild the trial's DpEvent
            "trial_index": index,
            "trial_seed": seed,
            "data_seed": config.seed,
            "num_clients": spec.num_clients,
            "max_cohort": spec.max_cohort if spec.max_cohort is not None else math.nan,
            "rounds_planned": config.rounds,
        }
        config = replace(config, seed=seed)
        resume = None
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                resume = pickle.loads((Path(d) / "state.pkl").read_bytes())
        # Tune's experiment snapshot can name an older checkpoint than the newest; the
        # trial's own checkpoint file, written before each row, is never behind a row.
        own = trial_checkpoint_path(out, trial_id)
        if own.exists():
            mine = pickle.loads(own.read_bytes())
            done = resume["server"]["rounds_done"] if resume is not None else -1
            if mine["server"]["rounds_done"] > done:
                resume = mine
        names = column_names(list(hps))
        last_acc = {"value": math.nan}

        def on_checkpoint(state: dict, row: dict) -> None:
            """Persist the round's state before its row is released (never recompute a
            released round): the trial's own file, then Tune's checkpoint."""
            blob = pickle.dumps(state)
            own.parent.mkdir(parents=True, exist_ok=True)
            tmp = own.with_name(f".{own.name}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, own)
            if not math.isnan(row["test_accuracy"]):
                last_acc["value"] = row["test_accuracy"]
            metrics = {
                "round": int(row["round"]),
                "test_accuracy": last_acc["value"],
                "epsilon": row["epsilon"],
                "noise_multiplier": row["noise_multiplier"],
            }
            pa = row.get("personal_accuracy_nonprivate", math.nan)
            if not math.isnan(pa):  # reported; tuned on only with --allow-nonprivate-metric
                metrics["personal_accuracy_nonprivate"] = pa
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "state.pkl").write_bytes(blob)
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))

        def on_round(row: dict, executor) -> None:
            hp_columns = {names[k]: v for k, v in hps.items()}
            write_round(out, round_record(row, event_columns, trial_id, hp_columns), columns)

        simulate(
            config,
            write=False,
            dataset=dataset,
            resume=resume,
            on_round=on_round,
            on_checkpoint=on_checkpoint,
            run_name=trial_name,
            trial=trial_id,
        )
        compact_trial(out, algorithm, epsilon, trial_id)  # one file per finished trial

    return trainable
