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
    same trial under Tune. Trial ids are ``<crc of the cell>_<k:05d>``, fixed, so a
    resumed experiment finds its trials: one whose file holds the last round's row is
    done; any other continues from its own checkpoint (none: from the start), and a
    checkpointed row that was never written is released from the checkpoint. A fresh
    start removes the cell's rows and its trials' checkpoints first. ``errors``, if
    given, receives each failed trial's last error (``Type: message``)."""
    import pyarrow.parquet as pq

    from tuning.trial import trial_checkpoint_path

    name = experiment_name(algorithm, epsilon)
    prefix = f"{zlib.crc32(name.encode()):08x}"[:5]
    ids = [f"{prefix}_{k:05d}" for k in range(n_trials)]
    if not resume:
        shutil.rmtree(rounds_dir(out, algorithm, epsilon), ignore_errors=True)
        for trial_id in ids:
            trial_checkpoint_path(out, trial_id).unlink(missing_ok=True)
    statuses: dict[str, str] = {}
    folder = rounds_dir(out, algorithm, epsilon)
    for k, trial_id in enumerate(ids):
        done = folder / f"{trial_id}.parquet"
        if (
            done.exists()
            and not any(folder.glob(f"{trial_id}-round*.parquet"))
            and max(pq.read_table(done, columns=["round"]).column("round").to_pylist()) >= rounds
        ):  # every round's row is in the trial's file
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
                print(
                    f"{name}: trial {trial_id} failed (attempt {attempt + 1} of 2): "
                    f"{type(err).__name__}: {err}",
                    file=sys.stderr,
                    flush=True,
                )
    return statuses
