"""Tune results on disk: one file per round while a trial runs, one file per trial
after it ends, the same rows either way (issue 16)."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from tuning.report import load_rounds
from tuning.trial import compact_cell, compact_trial, rounds_dir, write_round

COLUMNS = {"lr": "float", "ls_scope": "string"}


def _write_trial(out, trial_id: str, rounds: int, eps: float = 4.0, lr: float = 0.1) -> None:
    for r in range(1, rounds + 1):
        row = {
            "algorithm": "dp_fedavg",
            "epsilon_budget": eps,
            "trial_id": trial_id,
            "round": r,
            "epsilon": 0.1 * r,
            "test_accuracy": 0.01 * r + lr,
            "lr": lr,
        }
        if r % 2:
            row["ls_scope"] = "tensor"  # a string column present in some rows only
        write_round(out, row, COLUMNS)


def test_compacting_keeps_every_row_in_one_file_per_trial(tmp_path) -> None:
    _write_trial(tmp_path, "a_00000", 7)
    _write_trial(tmp_path, "a_00001", 5, lr=0.2)
    _write_trial(tmp_path, "b_00000", 3, eps=8.0)
    while_running = load_rounds(tmp_path)
    assert len(while_running) == 15
    folder = rounds_dir(tmp_path, "dp_fedavg", 4.0)
    assert compact_trial(tmp_path, "dp_fedavg", 4.0, "a_00000") == folder / "a_00000.parquet"
    assert sorted(p.name for p in folder.iterdir())[:1] == ["a_00000.parquet"]
    assert not list(folder.glob("a_00000-round*"))  # the round files are gone
    assert compact_cell(tmp_path, "dp_fedavg", 4.0) == 1  # a_00001 was left
    assert compact_cell(tmp_path, "dp_fedavg", 8.0) == 1
    assert compact_cell(tmp_path, "dp_fedavg", 8.0) == 0  # nothing left to do
    files = sorted(p.name for p in (tmp_path / "rounds").rglob("*.parquet"))
    assert files == ["a_00000.parquet", "a_00001.parquet", "b_00000.parquet"]
    pd.testing.assert_frame_equal(load_rounds(tmp_path), while_running)


def test_a_crash_between_rename_and_unlink_leaves_no_duplicate_rows(tmp_path) -> None:
    _write_trial(tmp_path, "a_00000", 4)
    folder = rounds_dir(tmp_path, "dp_fedavg", 4.0)
    saved = tmp_path / "saved"
    shutil.copytree(folder, saved)
    expected = load_rounds(tmp_path)
    compact_trial(tmp_path, "dp_fedavg", 4.0, "a_00000")
    for p in saved.iterdir():  # the round files the crash did not delete
        shutil.copy(p, folder / p.name)
    assert len(pd.read_parquet(tmp_path / "rounds")) == 8  # on disk: twice
    pd.testing.assert_frame_equal(load_rounds(tmp_path), expected)
    # compacting again (a trial Tune restores after it ended) folds them back in
    compact_trial(tmp_path, "dp_fedavg", 4.0, "a_00000")
    assert [p.name for p in folder.iterdir()] == ["a_00000.parquet"]
    pd.testing.assert_frame_equal(load_rounds(tmp_path), expected)


def test_results_benchmark_reads_the_same_rows_from_both_layouts(tmp_path) -> None:
    """benchmarks/results_io.py at a tiny size: the per-round sample and its compacted
    files hold the same rows (checked inside), the sweep is one file per trial."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results_io.py"
    spec = importlib.util.spec_from_file_location("results_io", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.measure(tmp_path, trials=12, rounds=6, sample=3)
    assert res["per_round_files_read"] == 18 and res["compacted_files"] == 12
    files = list((tmp_path / "rounds").rglob("*.parquet"))
    assert len(files) == 12 and not [f for f in files if "-round" in f.name]
    assert res["ratio_compacted_over_per_round"] == pytest.approx(
        res["compacted_read_s"] / res["per_round_layout_whole_sweep_s_extrapolated"]
    )


@pytest.mark.parametrize("note_varies", [True, False], ids=["mixed-types", "one-schema"])
def test_compacting_from_the_rows_written_equals_reading_them_back(
    tmp_path, note_varies: bool
) -> None:
    """``compact_trial(..., written)`` takes the tables ``write_round`` returned instead
    of reading those files back: the compacted file (schema with pandas' metadata, and
    values) equals the one folded from disk by pandas, also for a resumed trial whose
    earlier rounds this process did not write, and for columns typed by inference (int,
    bool, text, None). With one schema for every round the tables are concatenated
    directly (the fast path); with a column that is None in some rounds and text in
    others, pandas folds them."""
    import pyarrow.parquet as pq

    def rows(trial_id: str) -> list[dict]:
        out = []
        for r in range(1, 7):
            row = {
                "algorithm": "dp_fedavg",
                "epsilon_budget": 4.0,
                "trial_id": trial_id,
                "round": r,
                "epsilon": 0.1 * r,
                "test_accuracy": float("nan") if r % 3 else 0.5,
                "trial_index": 2,
                "private": bool(r % 2),
                "note": None if r < 3 and note_varies else f"r{r}",
                "lr": 0.1,
            }
            if r % 2:
                row["ls_scope"] = "tensor"
            out.append(row)
        return out

    results = {}
    for name, keep in (("disk", None), ("memory", range(1, 7)), ("resumed", range(4, 7))):
        out = tmp_path / name
        written = {}
        for row in rows("t_00000"):
            frame = write_round(out, row, COLUMNS)
            if keep is not None and row["round"] in keep:
                written[row["round"]] = frame
        target = compact_trial(out, "dp_fedavg", 4.0, "t_00000", written if keep else None)
        results[name] = pq.read_table(target)
    for name in ("memory", "resumed"):
        assert results[name].schema.equals(results["disk"].schema, check_metadata=True)
        assert results[name].equals(results["disk"])
    assert results["disk"].num_rows == 6
