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
docs/explanation/privacy.md).
"""

from __future__ import annotations

import math
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.base.atomic import atomic_write
from engine.config import config_from_dict
from tuning.rounds import (
    STRING_COLUMNS,
    column_names,
    compact_trial,
    hyperparameter_columns,
    row_table,
    write_round,
)

TUNE_STREAM = 9  # rng stream of random-search samples


def trial_seed(experiment_seed: int, algorithm: str, epsilon: float, index: int) -> int:
    """The run seed of trial ``index`` of (algorithm, ε): an ``engine.privacy.rng`` stream of its
    own, so no two trials share noise or cohorts (and none shares the experiment's)."""
    from engine.privacy import rng as rngs

    key = zlib.crc32(f"{algorithm}|{epsilon:g}".encode())
    return rngs.derive_seed(experiment_seed, rngs.TRIAL_SEED, key, int(index))


def sampled_params(
    space: dict[str, Any], experiment_seed: int, algorithm: str, epsilon: float, index: int
) -> dict[str, Any]:
    """Trial ``index``'s hyperparameters under random search: a draw from ``space`` with
    the generator of (seed, algorithm, ε, index), a function of nothing else (so the
    draws are known before any trial runs, as a total budget needs)."""
    from engine.privacy import rng as rngs
    from tuning.spaces import sample

    key = zlib.crc32(f"{algorithm}|{epsilon:g}".encode())
    return sample(space, rngs.numpy_rng(experiment_seed, TUNE_STREAM, key, index))


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


#: The experiment's data set in this process: every trial of a sweep tunes on the same
#: clients (built from the experiment seed, not the trial's), so a process that runs
#: several trials (a reused Tune trial actor, a process of the process runner, the
#: driver runner) builds it once. One entry, keyed by the dataset config and the seed.
_DATASET: dict[str, Any] = {}


def experiment_dataset(config) -> Any:
    """``build_dataset`` of ``config.dataset`` from the experiment seed (``config.seed``,
    stream DATA), built once per process and reused while the key is the same. The
    data set is only read by a simulation, never changed."""
    from engine.data import build_dataset
    from engine.privacy import rng as rngs

    key = repr((config.dataset, config.seed))
    if key not in _DATASET:
        _DATASET.clear()  # one data set at a time: a process serves one experiment
        _DATASET[key] = build_dataset(config.dataset, rngs.numpy_rng(config.seed, rngs.DATA))
    return _DATASET[key]


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
    noise: list[tuple[dict[str, Any], float]] | None = None,
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

    body = trial_body(base, algorithm, epsilon, out, columns, space, noise)
    return trainable


def trial_body(
    base: dict,
    algorithm: str,
    epsilon: float,
    out: str,
    columns: dict[str, str] | None = None,
    space: dict[str, Any] | None = None,
    noise: list[tuple[dict[str, Any], float]] | None = None,
) -> Callable[[dict[str, Any], str, str, Callable[[dict[str, Any]], None]], None]:
    """What one trial does, with or without Tune: ``body(params, trial_id, trial_name,
    report)`` runs (or continues, from the trial's own checkpoint) the trial and writes
    its rows; ``report`` receives each round's metrics (Tune's ``tune.report``, or the
    driver runner's bookkeeping). ``columns`` and ``space`` as in :func:`make_trainable`.
    ``noise`` (a total budget, :mod:`tuning.budget`): (grid-key values, σ) of each
    configuration; the trial runs with the σ of the configuration it drew, set as
    ``privacy.noise_multiplier`` (``epsilon`` then names the cell's total budget)."""
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
        from engine.simulation import sampling_spec, simulate

        hps = dict(params)
        index = trial_index(hps, trial_id)
        seed = trial_seed(int(base["seed"]), algorithm, epsilon, index)
        if space is not None:
            hps = sampled_params(space, int(base["seed"]), algorithm, epsilon, hps["sample"])
        config = with_algorithm(
            config_from_dict(base),
            algorithm,
            **{"privacy.epsilon": epsilon, "privacy.noise_multiplier": None},
            **hps,
        )
        if noise is not None:  # a total budget: the σ solved for the drawn configuration
            fits = [z for keys, z in noise if all(hps.get(k, v) == v for k, v in keys.items())]
            if not fits:
                raise ValueError(f"no solved noise multiplier for the trial's draw {hps}")
            sigma = fits[0]
            config = replace(config, **{"privacy.epsilon": None, "privacy.noise_multiplier": sigma})
        # Same clients for every trial (experiment seed), own randomness (trial seed).
        dataset = experiment_dataset(config)
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
            with atomic_write(own) as tmp:
                tmp.write_bytes(blob)

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
