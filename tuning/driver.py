"""The driver runner (``tune.runner: driver``): a cell's trials one after another in
the ``dpfl tune`` process, without Ray Tune, each one the same
:func:`tuning.trial.trial_body` a Tune trial runs.
"""

from __future__ import annotations

import errno
import shutil
import sys
import zlib
from pathlib import Path

from tuning.plan import experiment_name
from tuning.rounds import rounds_dir

#: File-system errors that stop a driver-runner sweep instead of failing one trial:
#: the next trial would meet them too (a full disk, a read-only or forbidden folder).
STOPPING_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM")
    if hasattr(errno, name)
)


def cell_trial_ids(algorithm: str, epsilon: float, n_trials: int) -> list[str]:
    """The fixed ids of the cell's trials under the driver and process runners,
    ``<crc of the cell>_<k:05d>``: a resumed experiment finds its trials by them."""
    prefix = f"{zlib.crc32(experiment_name(algorithm, epsilon).encode()):08x}"[:5]
    return [f"{prefix}_{k:05d}" for k in range(n_trials)]


def start_cell(out: Path, algorithm: str, epsilon: float, ids: list[str], resume: bool) -> None:
    """A fresh start removes the cell's rows and its trials' checkpoints first."""
    from tuning.trial import trial_checkpoint_path

    if not resume:
        shutil.rmtree(rounds_dir(out, algorithm, epsilon), ignore_errors=True)
        for trial_id in ids:
            trial_checkpoint_path(out, trial_id).unlink(missing_ok=True)


def trial_finished(folder: Path, trial_id: str, rounds: int) -> bool:
    """Whether the trial's own file holds every round's row (nothing left to run)."""
    import pyarrow.parquet as pq

    done = folder / f"{trial_id}.parquet"
    return (
        done.exists()
        and not any(folder.glob(f"{trial_id}-round*.parquet"))
        and max(pq.read_table(done, columns=["round"]).column("round").to_pylist()) >= rounds
    )


def report_failure(name: str, trial_id: str, attempt: int, why: str) -> None:
    print(
        f"{name}: trial {trial_id} failed (attempt {attempt + 1} of 2): {why}",
        file=sys.stderr,
        flush=True,
    )


def run_cell_in_driver(
    out: Path,
    algorithm: str,
    epsilon: float,
    n_trials: int,
    rounds: int,
    body,
    resume: bool,
    errors: dict[str, str] | None = None,
) -> dict[str, str]:
    """Trials 0..n-1 of (algorithm, ε), one after another in this process; their
    statuses by trial id (``TERMINATED``, or ``ERROR`` after a retry, as Tune's
    ``FailureConfig(max_failures=1)``).

    Each trial is :func:`tuning.trial.trial_body`, the function a Tune trial runs, so
    its hyperparameters, seed, rows, checkpoints and compacted file are those of the
    same trial under Tune. Trial ids are fixed (:func:`cell_trial_ids`), so a resumed
    experiment finds its trials: one whose file holds the last round's row is done;
    any other continues from its own checkpoint (none: from the start), and a
    checkpointed row that was never written is released from the checkpoint. A fresh
    start removes the cell's rows and its trials' checkpoints first. ``errors``, if
    given, receives each failed trial's last error (``Type: message``)."""
    name = experiment_name(algorithm, epsilon)
    ids = cell_trial_ids(algorithm, epsilon, n_trials)
    start_cell(out, algorithm, epsilon, ids, resume)
    statuses: dict[str, str] = {}
    folder = rounds_dir(out, algorithm, epsilon)
    for k, trial_id in enumerate(ids):
        if trial_finished(folder, trial_id, rounds):
            statuses[trial_id] = "TERMINATED"
            continue
        for attempt in range(2):
            try:
                body({"sample": k}, trial_id, f"{name}-{trial_id}", lambda metrics: None)
                statuses[trial_id] = "TERMINATED"
                if errors is not None:
                    errors.pop(trial_id, None)
                break
            except Exception as err:  # noqa: BLE001 - reported like a Tune trial error
                if isinstance(err, OSError) and err.errno in STOPPING_ERRNOS:
                    # a full disk or a read-only/forbidden folder stops the sweep (the
                    # CLI prints one line naming the file); --resume continues it
                    raise
                statuses[trial_id] = "ERROR"
                if errors is not None:
                    errors[trial_id] = f"{type(err).__name__}: {err}"
                report_failure(name, trial_id, attempt, f"{type(err).__name__}: {err}")
    return statuses
