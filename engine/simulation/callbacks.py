"""dpfl's own per-round side effects of :func:`engine.simulation.simulate`, each a
:class:`engine.simulation.round_end.Callback` (the public interface users extend; it
is re-exported here with :class:`RoundEnd` and :class:`EarlyStopping`).

After every round the loop hands the round to its callbacks, always in this order
(:func:`round_callbacks` builds them so; absent ones are skipped):

1. :class:`Checkpoint` — ``checkpoint.pkl`` (model, server and client state, and the
   row) and the caller's ``on_checkpoint`` (Tune persists its own checkpoint there);
2. the user's callbacks (``simulate(callbacks=...)``, the config's ``callbacks:``):
   each receives the round's public :class:`RoundEnd` only, may add public columns
   and may stop the run;
3. :class:`Metrics` — the dashboard's Ray metrics (:mod:`engine.telemetry.metrics`);
4. :class:`ParquetRows` — the row appended to ``rounds.parquet``: the release;
5. :class:`CallerOnRound` — the caller's ``on_round(row, executor)`` (Tune's report);
6. :class:`Progress` — the progress bar.

dpfl's own callbacks are :class:`OwnCallback`: besides the public :class:`RoundEnd`
the runner gives them, at construction, privileged access to the run (:class:`RunAccess`:
the whole row, non-public columns included, the executor and the round's checkpoint),
which a user callback never receives.

Checkpoint before the row: a crash after the release resumes from this round's
state, so a released round is never computed again (its noise need not be
reproducible bit for bit on a GPU); a crash between the two leaves the row inside the
checkpoint, released on resume (``RoundState.replayed``: only the user's callbacks, the
Parquet row, if it is not on disk yet, and the caller's ``on_round`` see it). A user
callback that stops the run stops it after the round's callbacks. When the run ends, in
success or failure, each callback's ``on_end`` runs, in the same order, after the
executor has closed.

When no caller waits for the release (no ``on_checkpoint``, no ``on_round``, no user
callback: ``dpfl run`` and ``simulate(write=True)``), 1 and 4 are one
:class:`BackgroundWrites`: the
round's checkpoint is taken (copied) on the loop's thread, and pickling it, writing
``checkpoint.pkl`` and then the row run in one writer thread, in round order, while
the next round trains (issue 26: for an 11M-parameter model about 0.25 s a round on
the CPU). The order on disk is the same (every row on disk is at or before the
checkpoint on disk), so a crash at any point resumes exactly as before; rows still
queued when the process dies are computed again on resume, with the same values. A
write error stops the writer (nothing later is written) and is raised on the loop's
thread at the next round or when the run ends.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.results import RoundWriter
from engine.runtime.executors import Executor
from engine.simulation.checkpoint import save_checkpoint
from engine.simulation.round_end import Callback, EarlyStopping, RoundEnd, load_callbacks
from engine.telemetry.metrics import RunMetrics

__all__ = ["Callback", "EarlyStopping", "RoundEnd", "load_callbacks"]  # the public interface

Row = dict[str, Any]


@dataclass
class RoundState:
    """What a callback sees of the run besides the row."""

    executor: Executor
    #: ``time.perf_counter()`` when the round started, or the previous row was released
    #: if later (NaN for a replayed row)
    started: float = math.nan
    #: the latest evaluated test accuracy (NaN before the first evaluation)
    last_accuracy: float = math.nan
    #: the row is the copy a checkpoint holds, released on resume (not computed now)
    replayed: bool = False
    #: the state after the row's round (``Executor.run_rounds``; None: the executor's now)
    checkpoint: Callable[[], dict] | None = None


@dataclass
class RunAccess:
    """What dpfl's own callbacks see of the run (set by the runner before each round's
    callbacks): the whole row and the run's state. Never handed to a user callback."""

    row: Row
    state: RoundState


class OwnCallback(Callback):
    """One of dpfl's own side effects: :meth:`on_round` reads the privileged
    :class:`RunAccess` the runner gave it (:func:`round_callbacks`)."""

    access: RunAccess

    def on_round_end(self, end: RoundEnd) -> None:
        self.on_round(self.access.row, self.access.state)

    def on_round(self, row: Row, state: RoundState) -> None:
        """Called once per finished round (and once for a replayed row)."""

    def on_end(self) -> None:
        """Called once when the run ends (also after a failure)."""


class Checkpoint(OwnCallback):
    """Writes ``checkpoint.pkl`` (if ``out_dir``) and calls ``on_checkpoint`` with the
    checkpoint (``Executor.checkpoint()`` plus ``"row"``) and the row, before the row
    is released."""

    def __init__(
        self, out_dir: Path | None, on_checkpoint: Callable[[dict, dict], None] | None
    ) -> None:
        self.out_dir = out_dir
        self.on_checkpoint = on_checkpoint

    def take(self, row: Row, state: RoundState) -> dict | None:
        """The round's checkpoint (copies: ``Executor.checkpoint()`` plus ``"row"``);
        None for a replayed row, whose checkpoint is already on disk."""
        if state.replayed:
            return None
        taken = state.checkpoint() if state.checkpoint is not None else state.executor.checkpoint()
        return {**taken, "row": dict(row)}

    def write(self, checkpoint: dict, row: Row) -> None:
        """``checkpoint.pkl`` (if ``out_dir``), then the caller's ``on_checkpoint``."""
        if self.out_dir is not None:
            save_checkpoint(self.out_dir, checkpoint)
        if self.on_checkpoint is not None:
            self.on_checkpoint(checkpoint, row)

    def on_round(self, row: Row, state: RoundState) -> None:
        checkpoint = self.take(row, state)
        if checkpoint is not None:
            self.write(checkpoint, row)

    def on_end(self) -> None:
        pass


class BackgroundWrites(OwnCallback):
    """A :class:`Checkpoint` (without ``on_checkpoint``) and :class:`ParquetRows` run
    by one writer thread: the checkpoint is taken on the caller's thread
    (:meth:`Checkpoint.take`: copies, which nothing mutates afterwards), then written
    and the row released by the thread, in round order, while the next round runs
    (module docstring)."""

    #: rounds that may wait for the writer: bounds the checkpoints held in memory
    PENDING = 2

    def __init__(self, checkpoint: Checkpoint, rows: ParquetRows) -> None:
        self.checkpoint = checkpoint
        self.rows = rows
        self._queue: queue.Queue = queue.Queue(maxsize=self.PENDING)
        self._error: BaseException | None = None
        self._raised = False
        self._thread = threading.Thread(target=self._work, name="dpfl-round-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # after a failed write nothing later reaches the disk
            checkpoint, row, replayed = item
            try:
                if checkpoint is not None:
                    self.checkpoint.write(checkpoint, row)
                self.rows.release(row, replayed)
            except BaseException as e:  # noqa: BLE001 - raised on the loop's thread
                self._error = e

    def _raise_error(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def on_round(self, row: Row, state: RoundState) -> None:
        self._raise_error()
        self._queue.put((self.checkpoint.take(row, state), dict(row), state.replayed))

    def flush(self) -> None:
        """Wait until every queued round is on disk (or the writer failed)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def on_end(self) -> None:
        self.flush()
        self._raise_error()


class Metrics(OwnCallback):
    """Records the round in the dashboard's metrics (a no-op without Ray); its time
    is the round's, the checkpoint's snapshot included (and its file, unless
    :class:`BackgroundWrites` writes it behind the next round)."""

    def __init__(self, metrics: RunMetrics) -> None:
        self.metrics = metrics

    def on_round(self, row: Row, state: RoundState) -> None:
        if state.replayed:
            return
        seconds = time.perf_counter() - state.started
        self.metrics.record({**row, "test_accuracy": state.last_accuracy}, seconds)

    def on_end(self) -> None:
        pass


class ParquetRows(OwnCallback):
    """Appends the row to ``rounds.parquet`` (rewritten atomically): its release. A
    replayed row already on disk is not written twice."""

    def __init__(self, writer: RoundWriter) -> None:
        self.writer = writer

    def release(self, row: Row, replayed: bool) -> None:
        """Append ``row``, unless it is a replayed row already on disk."""
        if replayed and any(int(r["round"]) == int(row["round"]) for r in self.writer.rows):
            return
        self.writer.append(row)

    def on_round(self, row: Row, state: RoundState) -> None:
        self.release(row, state.replayed)

    def on_end(self) -> None:
        pass


class CallerOnRound(OwnCallback):
    """The caller's ``on_round(row, executor)``: the release of the round to it (Tune
    reports the round here)."""

    def __init__(self, on_round: Callable[[dict, Executor], None]) -> None:
        self.on_round_fn = on_round

    def on_round(self, row: Row, state: RoundState) -> None:
        self.on_round_fn(row, state.executor)

    def on_end(self) -> None:
        pass


class Progress(OwnCallback):
    """A tqdm bar of rounds, showing the accuracy and the ε spent; created after the
    executor, so that Ray's start-up lines do not land on the bar's line."""

    def __init__(self, total: int, desc: str, start: int = 0) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="round")
        if start:
            self.bar.update(start)

    def on_round(self, row: Row, state: RoundState) -> None:
        if state.replayed:
            return
        self.bar.set_postfix(acc=f"{state.last_accuracy:.3f}", eps=f"{row['epsilon']:.3g}")
        self.bar.update(1)

    def on_end(self) -> None:
        self.bar.close()


def round_callbacks(
    *,
    metrics: RunMetrics,
    writer: RoundWriter | None,
    out_dir: Path | None,
    on_checkpoint: Callable[[dict, dict], None] | None,
    on_round: Callable[[dict, Executor], None] | None,
    progress: Progress | None,
    access: RunAccess,
    user: list[Callback] | None = None,
) -> list[Callback]:
    """The run's callbacks in their fixed order (module docstring); dpfl's own get
    ``access``. ``out_dir`` is where ``checkpoint.pkl`` goes (None: no file); a
    checkpoint is taken only if it is written or ``on_checkpoint`` wants it. Without
    ``on_checkpoint``, ``on_round`` and user callbacks, the checkpoint file and the row
    are written behind the next round (:class:`BackgroundWrites`)."""
    own: list[OwnCallback] = []
    user = list(user or [])
    behind = out_dir is not None and writer is not None
    behind = behind and on_checkpoint is None and on_round is None and not user
    if behind:  # nobody waits for the release: write behind the next round
        assert out_dir is not None and writer is not None
        own.append(BackgroundWrites(Checkpoint(out_dir, None), ParquetRows(writer)))
    elif out_dir is not None or on_checkpoint is not None:
        own.append(Checkpoint(out_dir, on_checkpoint))
    after: list[OwnCallback] = [Metrics(metrics)]
    if writer is not None and not behind:
        after.append(ParquetRows(writer))
    if on_round is not None:
        after.append(CallerOnRound(on_round))
    if progress is not None:
        after.append(progress)
    for callback in (*own, *after):
        callback.access = access
    return [*own, *user, *after]
