"""The round's checkpoint file and Parquet row are written behind the next round when
no caller waits for the release (issue 26), in the same order on disk as before; a
caller's ``on_round`` still sees its row on disk."""

from __future__ import annotations

import threading

import pandas as pd
import pytest

import engine.simulation.callbacks as callbacks
import engine.simulation.runner as runner
from engine.config import load_config
from engine.results import RoundWriter
from engine.simulation import load_run, simulate


def _config(small_overrides, out, *extra: str):
    over = [*small_overrides, "rounds=4", "privacy.noise_multiplier=1.0", *extra]
    return load_config(overrides=[*over, f"out={out}"])


def test_files_are_written_while_the_next_round_runs_in_order(
    monkeypatch, small_overrides, tmp_path
) -> None:
    """Round 1's checkpoint write waits until round 2 has started (it would wait
    forever, here 20 s, if the write were on the loop's path); every write goes
    checkpoint r, row r, checkpoint r + 1, ... from one thread, and the run's files
    equal a run whose writes were not held back."""
    want = simulate(_config(small_overrides, tmp_path / "plain"))
    started: dict[int, threading.Event] = {r: threading.Event() for r in range(6)}
    writes: list[tuple[str, int, str]] = []
    held: dict[str, bool] = {}
    real_make, real_save = runner.make_executor, callbacks.save_checkpoint
    real_append = RoundWriter.append

    def make(*a, **k):
        ex = real_make(*a, **k)
        run_round = ex.run_round

        def tracked(rnd: int) -> dict:
            started[rnd].set()
            return run_round(rnd)

        ex.run_round = tracked
        return ex

    def save(out_dir, state) -> None:
        rnd = int(state["row"]["round"])
        if rnd == 1:  # round 2 is rnd index 1
            held["next round ran meanwhile"] = started[1].wait(timeout=20)
        real_save(out_dir, state)
        writes.append(("checkpoint", rnd, threading.current_thread().name))

    def append(self, row) -> None:
        real_append(self, row)
        writes.append(("row", int(row["round"]), threading.current_thread().name))

    monkeypatch.setattr(runner, "make_executor", make)
    monkeypatch.setattr(callbacks, "save_checkpoint", save)
    monkeypatch.setattr(RoundWriter, "append", append)
    got = simulate(_config(small_overrides, tmp_path / "behind"))
    assert held == {"next round ran meanwhile": True}
    assert [(k, r) for k, r, _ in writes] == [
        (k, r) for r in range(1, 5) for k in ("checkpoint", "row")
    ]
    assert {name for *_, name in writes} == {"dpfl-round-writer"}
    on_disk = pd.read_parquet(tmp_path / "behind" / "rounds.parquet")
    cols = [c for c in on_disk.columns if c != "wall_time_s_nonprivate"]
    pd.testing.assert_frame_equal(on_disk[cols], want.rounds[cols], check_exact=True)
    assert (got.weights == want.weights).all()
    _, state = load_run(tmp_path / "behind")
    assert int(state["server"]["rounds_done"]) == 4 and int(state["row"]["round"]) == 4


def test_a_failed_write_stops_the_run_and_nothing_later_reaches_the_disk(
    monkeypatch, small_overrides, tmp_path
) -> None:
    """The writer's error is raised on the caller's thread; after it no checkpoint and
    no row is written, so the disk holds rows 1..k-1 and the checkpoint of round k."""
    real_append = RoundWriter.append

    def append(self, row) -> None:
        if int(row["round"]) == 2:
            raise OSError(28, "No space left on device", str(self.path))
        real_append(self, row)

    monkeypatch.setattr(RoundWriter, "append", append)
    out = tmp_path / "failed"
    with pytest.raises(OSError, match="No space left"):
        simulate(_config(small_overrides, out))
    assert list(pd.read_parquet(out / "rounds.parquet")["round"]) == [1]
    _, state = load_run(out)
    assert int(state["server"]["rounds_done"]) == 2 and int(state["row"]["round"]) == 2


def test_a_caller_on_round_sees_its_row_on_disk(small_overrides, tmp_path) -> None:
    """With ``on_round`` (Tune's report) the writes stay on the loop's path: the row
    is on disk when the caller hears of it."""
    seen: list[tuple[int, list[int]]] = []
    out = tmp_path / "sync"

    def on_round(row, executor) -> None:
        rows = pd.read_parquet(out / "rounds.parquet")
        seen.append((int(row["round"]), list(rows["round"])))

    simulate(_config(small_overrides, out), on_round=on_round)
    assert seen == [(r, list(range(1, r + 1))) for r in range(1, 5)]
