"""One run of a leaderboard (a trial, or a seed run of a selected configuration).

A run is :func:`engine.simulation.simulate` in this process on the leaderboard's one
data set, with two additions per round: the model's accuracy on the public validation
set (``val_accuracy``/``val_loss``, on the rounds whose test accuracy is evaluated; the
validation set is held out of every client, :mod:`engine.data.validation`) and the
run's identity (method, total budget, phase, index, hyperparameters). Files, under
``OUT/runs/<run id>/``: ``checkpoint.pkl`` (the round's state, written before its row)
and ``rows.parquet`` (every row so far, rewritten atomically after each round). A run
whose rows reach its last round is finished and its checkpoint removed; a resumed run
continues from its checkpoint and never computes a written round again
(:func:`check_run` refuses a folder that would).
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.base.atomic import atomic_write
from engine.config import ConfigError, RunConfig

TRIAL, SEED = "trial", "seed"


@dataclass(frozen=True)
class PlannedRun:
    """A run: its id, cell, phase (``trial`` k or ``seed`` run j), hyperparameters (config
    key → value) and complete config (method, seed, σ)."""

    run_id: str
    method: str
    total: float  # the cell's total budget; inf for a non-private reference
    phase: str
    index: int
    params: dict[str, Any]
    config: RunConfig

    def identity(self, validation_source: str) -> dict[str, Any]:
        """The columns every row of the run carries besides the engine's."""
        from engine.simulation import sampling_spec

        spec = sampling_spec(self.config)
        return {
            "run_id": self.run_id,
            "method": self.method,
            "total_epsilon_budget": self.total,
            "phase": self.phase,
            "index": self.index,
            "num_clients": spec.num_clients,
            "max_cohort": spec.max_cohort if spec.max_cohort is not None else math.nan,
            "rounds_planned": self.config.rounds,
            "validation_source": validation_source,
            **{hp_column(k): v for k, v in self.params.items()},
        }


def hp_column(key: str) -> str:
    """The column of a searched key: ``local.lr`` → ``hp_local_lr``."""
    return "hp_" + key.replace(".", "_")


def folder(out: Path, run_id: str) -> Path:
    return Path(out) / "runs" / run_id


class ValidationEval:
    """Accuracy and mean loss of a flat weight vector on the public validation set."""

    def __init__(self, config: RunConfig, dataset: Any) -> None:
        from engine.models import build_model

        if dataset.x_val is None:
            raise ConfigError("dataset.validation_size: the leaderboard needs a validation set")
        self.model = build_model(config.model.name, dataset.input_shape, dataset.num_classes)
        self.x, self.y = dataset.x_val, dataset.y_val

    def __call__(self, weights: Any) -> tuple[float, float]:
        import torch

        from engine.federated.evaluation import evaluate
        from engine.federated.worker_model import load_flat_

        load_flat_(self.model, torch.from_numpy(np.asarray(weights, dtype=np.float32)))
        return evaluate(self.model, self.x, self.y)


def read_rows(out: Path, run_id: str) -> pd.DataFrame | None:
    path = folder(out, run_id) / "rows.parquet"
    return pd.read_parquet(path) if path.is_file() else None


def _refuse(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"--resume: {path}: {what}; the leaderboard cannot continue this run without "
        "computing written rows again (start a new leaderboard in another folder; nothing "
        "was changed)"
    )


def check_run(out: Path, run: PlannedRun) -> str:
    """``done``, ``partial`` (continues from its checkpoint) or ``new``; ConfigError (one
    line naming the file) for a folder that cannot continue without computing a
    written round again or losing one."""
    where = folder(out, run.run_id)
    rows_path, ckpt = where / "rows.parquet", where / "checkpoint.pkl"
    got: list[int] = []
    if rows_path.exists():
        try:
            got = sorted(int(r) for r in pd.read_parquet(rows_path, columns=["round"])["round"])
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise _refuse(rows_path, f"damaged ({type(e).__name__})") from None
        if got != list(range(1, len(got) + 1)):
            raise _refuse(rows_path, f"rounds {got[:3]}... are not 1..{len(got)}")
    if got and got[-1] >= run.config.rounds:
        return "done"
    if not ckpt.exists():
        if got:
            raise _refuse(ckpt, f"missing while {rows_path} holds {len(got)} rounds")
        return "new"
    try:
        state = pickle.loads(ckpt.read_bytes())
        done = int(state["server"]["rounds_done"])
        pending = state.get("row")
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is a damaged file
        raise _refuse(ckpt, f"damaged ({type(e).__name__})") from None
    m = len(got)
    if m > done:
        raise _refuse(rows_path, f"holds {m} rounds but {ckpt} is at round {done}")
    if m < done - 1 or (m == done - 1 and (pending is None or int(pending["round"]) != done)):
        raise _refuse(ckpt, f"is at round {done} but {rows_path} holds only {m} rounds")
    return "partial"


def execute(out: Path, run: PlannedRun, dataset: Any, evaluator: ValidationEval) -> pd.DataFrame:
    """Run (or continue) ``run`` to its last round; its rows (also on disk)."""
    from engine.simulation import simulate

    where = folder(out, run.run_id)
    where.mkdir(parents=True, exist_ok=True)
    rows_path, ckpt = where / "rows.parquet", where / "checkpoint.pkl"
    before = read_rows(out, run.run_id)
    rows: list[dict[str, Any]] = [] if before is None else before.to_dict("records")
    state = pickle.loads(ckpt.read_bytes()) if ckpt.exists() else None
    # the weights of the round whose row comes next (a replayed row: the checkpoint's)
    held: dict[str, Any] = {"weights": None if state is None else state["server"]["weights"]}
    identity = run.identity(dataset.meta.get("validation_source", "public"))

    def on_checkpoint(checkpoint: dict, row: dict) -> None:
        held["weights"] = checkpoint["server"]["weights"]
        with atomic_write(ckpt) as tmp:
            tmp.write_bytes(pickle.dumps(checkpoint))

    def on_round(row: dict, _executor: Any) -> None:
        if any(int(r["round"]) == int(row["round"]) for r in rows[-1:]):
            return  # a replayed row already written before the crash
        record = dict(row)
        val = (math.nan, math.nan)
        if not math.isnan(record.get("test_accuracy", math.nan)):
            val = evaluator(held["weights"])
        record["val_accuracy"], record["val_loss"] = val
        record.update(identity)
        rows.append(record)
        with atomic_write(rows_path) as tmp:
            pd.DataFrame(rows).to_parquet(tmp, index=False)

    simulate(
        run.config,
        write=False,
        dataset=dataset,
        resume=state,
        on_round=on_round,
        on_checkpoint=on_checkpoint,
        run_name=run.run_id,
    )
    ckpt.unlink(missing_ok=True)  # the rows hold every round: nothing to continue
    return pd.DataFrame(rows)
