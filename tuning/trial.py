"""One Tune trial = one simulation at a fixed budget ε with σ calibrated from it.

The trial's client workers and server are Ray actors created inside the trial's
placement group. Every round is written as its own Parquet file under
``DIR/rounds/algorithm=<a>/epsilon_budget=<ε>/`` (one file per (trial, round): no append
races), after the round has been checkpointed (server state, per-client state; RNG
streams are keyed by (seed, round) and ε by the round count, so that is the whole state
and a resumed trial equals an uninterrupted one) to the trial's own file
(:func:`trial_checkpoint_path`), which a trial that Tune restores or retries resumes
from; Tune itself is handed no checkpoint. Checkpoint before release: a restored trial
never recomputes a round whose row was written (a recomputation need not be
bit-identical on a GPU, and two releases of one round with different noise would cost
more than one round's ε).

Independent trials: trial k of (algorithm, ε) runs with its own seed,
:func:`trial_seed` (``engine.privacy.rng`` stream ``TRIAL_SEED`` keyed by the experiment seed,
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
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.config import config_from_dict
from engine.results import writing

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


#: Values whose one-element pandas column has a dtype fixed by their Python type.
_SCALARS = (float, int, bool, str, type(None), np.floating, np.integer, np.bool_)
#: Arrow schema (with pandas' metadata) of each row layout seen: (column, kind) pairs,
#: kind = the fixed type of a ``columns`` entry or the Python type of any other value.
_ROW_SCHEMAS: dict[tuple[tuple[str, Any], ...], Any] = {}


def _as_column(value: Any) -> np.ndarray:
    """The one-element numpy column pandas builds for ``value`` (its dtype inference)."""
    if isinstance(value, np.generic):
        return np.array([value])
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    if isinstance(value, int):
        return np.array([value], dtype=np.int64)  # beyond int64: OverflowError
    if isinstance(value, float):
        return np.array([value], dtype=np.float64)
    column = np.empty(1, dtype=object)
    column[0] = value
    return column


def row_table(row: dict[str, Any], columns: dict[str, str]) -> Any:
    """:func:`row_frame` as the Arrow table ``pandas.DataFrame.to_parquet`` would write
    (pandas' metadata included), without pandas after the first row of a layout.

    pandas infers a one-element column's dtype from the value's Python type alone, so
    rows whose columns have the same (name, type) pairs share one schema: it is taken
    once from pandas (``pyarrow.Table.from_pandas(row_frame(...))``) and later rows are
    filled into it from the one-element numpy column pandas would hold, converted as
    pandas converts it (``from_pandas=True``).
    1.2 ms a row against 4 ms through pandas; equal tables (tested). A value the fast
    path cannot place (e.g. an integer beyond int64) takes pandas' path."""
    import pyarrow as pa

    def fill(schema: Any) -> Any:
        arrays = [pa.array(_as_column(data.get(f.name)), f.type, from_pandas=True) for f in schema]
        return pa.Table.from_arrays(arrays, schema=schema)

    data = {k: v for k, v in row.items() if k not in PARTITIONS}
    layout: list[tuple[str, Any]] = []
    for col in sorted(set(data) | set(columns)):
        kind = columns.get(col)
        value = data.get(col)
        if kind == "string" and not (value is None or isinstance(value, str)):
            break  # pd.array's own conversion of a non-text value: pandas' path
        if kind is None and not isinstance(value, _SCALARS):
            break  # a list, dict, ...: its Arrow type depends on the value
        if kind == "float":
            data[col] = _as_float(value)
        layout.append((col, kind if kind is not None else type(value)))
    else:
        key = tuple(layout)
        schema = _ROW_SCHEMAS.get(key)
        if schema is not None:
            try:
                return fill(schema)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass  # e.g. an integer beyond int64, which pandas stores otherwise
        table = pa.Table.from_pandas(row_frame(row, columns), preserve_index=False)
        if schema is None and len(_ROW_SCHEMAS) < 1024:
            try:  # remember the layout only if the fast path rebuilds this very row
                if fill(table.schema).equals(table):
                    _ROW_SCHEMAS[key] = table.schema
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass
        return table
    return pa.Table.from_pandas(row_frame(row, columns), preserve_index=False)


def column_names(keys: list[str]) -> dict[str, str]:
    """Hyperparameter column = last part of its key (full key if that collides)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (n if last.count(n) == 1 else k.replace(".", "_")) for k, n in zip(keys, last)}


def rounds_dir(out: str | Path, algorithm: str, epsilon: float) -> Path:
    return Path(out) / "rounds" / f"algorithm={algorithm}" / f"epsilon_budget={epsilon:g}"


def round_file(out: str | Path, row: dict[str, Any]) -> Path:
    """Where ``write_round`` puts a (trial, round) row."""
    folder = rounds_dir(out, row["algorithm"], row["epsilon_budget"])
    return folder / f"{row['trial_id']}-round{int(row['round']):05d}.parquet"


def write_round(out: str | Path, row: dict[str, Any], columns: dict[str, str]) -> Any:
    """Atomically write one (trial, round) row; partition columns live in the path.
    Returns the one-row Arrow table written (what :func:`compact_trial` would read)."""
    import pyarrow.parquet as pq

    path = round_file(out, row)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = row_table(row, columns)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, tmp):  # a full disk: an OSError naming the file, no partial file
        pq.write_table(table, tmp)  # what DataFrame.to_parquet does with this table
        os.replace(tmp, path)
    return table


def compact_trial(
    out: str | Path,
    algorithm: str,
    epsilon: float,
    trial_id: str,
    written: dict[int, Any] | None = None,
    last: Any | None = None,
) -> Path | None:
    """Fold a finished trial's per-round files into one ``<trial_id>.parquet``.

    While a trial runs each round is its own file (readable at once, never rewritten);
    once it ends, one file per trial keeps a sweep of thousands of trials × hundreds of
    rounds quick to read. The compacted file also takes any earlier compacted file of
    the trial (a trial Tune restores after it ended), one row per round (the newest).
    ``written`` (round → the table :func:`write_round` returned in this process) spares
    reading those rounds' files back; only rounds whose file still exists are taken
    from it, so the result equals reading the folder (tested). ``last`` is the trial's
    final row as a table (:func:`row_table`) that was never written on its own: it
    goes straight into this file, the newest row of its round. It is written under a
    dot-name (ignored by readers) and renamed into place before the round files go, so
    a crash leaves at worst duplicate rows, which :func:`tuning.report.load_rounds`
    drops. Returns the file, or None with no rows."""
    folder = rounds_dir(out, algorithm, epsilon)
    target = folder / f"{trial_id}.parquet"
    parts = sorted(folder.glob(f"{trial_id}-round*.parquet"))
    sources = ([target] if target.exists() else []) + parts
    if not sources and last is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    known = written or {}
    tmp = folder / f".{target.name}.tmp"
    round_of = {p: int(p.stem.rsplit("-round", 1)[1]) for p in parts}
    rounds = list(round_of.values())
    tables = [known.get(r) for r in rounds]
    if last is not None:
        rounds.append(int(last.column("round")[0].as_py()))
        tables.append(last)
    if (
        sources == parts
        and all(t is not None for t in tables)
        and rounds == sorted(set(rounds))
        and all(t.schema.equals(tables[0].schema, check_metadata=True) for t in tables)
    ):
        # Every row is in memory, one schema, one row per round in order: the
        # concatenated tables are the file the pandas fold below writes (tested), in
        # 2 ms instead of 11 ms for a 2-round trial.
        import pyarrow as pa
        import pyarrow.parquet as pq

        with writing(target, tmp):
            pq.write_table(pa.concat_tables(tables), tmp)
    else:

        def rows_of(p: Path) -> pd.DataFrame:
            rnd = round_of.get(p)  # None for an earlier compacted file
            return known[rnd].to_pandas() if rnd in known else pd.read_parquet(p)

        frames = [rows_of(p) for p in sources] + ([last.to_pandas()] if last is not None else [])
        frame = pd.concat(frames, ignore_index=True)
        frame = frame.drop_duplicates("round", keep="last").sort_values("round", ignore_index=True)
        with writing(target, tmp):
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
    """The run seed of trial ``index`` of (algorithm, ε): an ``engine.privacy.rng`` stream of its
    own, so no two trials share noise or cohorts (and none shares the experiment's)."""
    from engine.privacy import rng as rngs

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

    def trainable(params: dict[str, Any]) -> None:
        from ray import tune

        ctx = tune.get_context()
        body(params, ctx.get_trial_id(), ctx.get_trial_name(), tune.report)

    body = trial_body(base, algorithm, epsilon, out, columns, space)
    return trainable


def trial_body(
    base: dict,
    algorithm: str,
    epsilon: float,
    out: str,
    columns: dict[str, str] | None = None,
    space: dict[str, Any] | None = None,
) -> Callable[[dict[str, Any], str, str, Callable[[dict[str, Any]], None]], None]:
    """What one trial does, with or without Tune: ``body(params, trial_id, trial_name,
    report)`` runs (or continues, from the trial's own checkpoint) the trial and writes
    its rows; ``report`` receives each round's metrics (Tune's ``tune.report``, or the
    driver runner's bookkeeping). ``columns`` and ``space`` as in :func:`make_trainable`."""
    columns = dict(columns or {})
    for c in hyperparameter_columns():
        columns.setdefault(c, "string" if c in STRING_COLUMNS else "float")

    def body(
        params: dict[str, Any],
        trial_id: str,
        trial_name: str,
        report: Callable[[dict[str, Any]], None],
    ) -> None:
        from engine.config import replace, with_algorithm
        from engine.data import build_dataset
        from engine.privacy import rng as rngs
        from engine.simulation import sampling_spec, simulate

        hps = dict(params)
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
        # The trial's own checkpoint file, written before each row, is never behind a
        # row: a restored or retried trial continues from it.
        own = trial_checkpoint_path(out, trial_id)
        resume = pickle.loads(own.read_bytes()) if own.exists() else None
        names = column_names(list(hps))
        hp_columns = {names[k]: v for k, v in hps.items()}  # the same in every row
        last_acc = {"value": math.nan}

        def on_checkpoint(state: dict, row: dict) -> None:
            """Persist the round's state in the trial's own file before its row is
            released (never recompute a released round)."""
            blob = pickle.dumps(state)
            own.parent.mkdir(parents=True, exist_ok=True)
            tmp = own.with_name(f".{own.name}.tmp")
            with writing(own, tmp):
                tmp.write_bytes(blob)
                os.replace(tmp, own)

        def metrics_of(row: dict) -> dict[str, Any]:
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
            return metrics

        written: dict[int, Any] = {}  # this process's rows (Arrow tables), for compact_trial
        folded: list[bool] = []

        def on_round(row: dict, executor) -> None:
            record = round_record(row, event_columns, trial_id, hp_columns)
            rnd = int(record["round"])
            if rnd == config.rounds:
                # The last row goes straight into the trial's file: one Parquet write
                # less per trial. Its checkpoint is already on disk, so a crash before
                # that file leaves it to be released again from the checkpoint, never
                # recomputed.
                last = row_table(record, columns)
                compact_trial(out, algorithm, epsilon, trial_id, written, last)
                folded.append(True)
            else:
                written[rnd] = write_round(out, record, columns)
            # Reported after the row is on disk: a scheduler may stop the trial at this
            # report (ASHA at its last round), and Tune does not wait for the rest of
            # the function then. No Tune checkpoint: the trial's own file (above, same
            # storage) is the one a restored or retried trial resumes from, and copying
            # it again into Tune's storage cost 9 ms a round, more than a small trial's.
            report(metrics_of(row))

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
        if not folded:  # one file per trial (a run that ended before its last round)
            compact_trial(out, algorithm, epsilon, trial_id, written)

    return body
