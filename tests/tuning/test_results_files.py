"""Tune results on disk: one file per round while a trial runs, one file per trial
after it ends, the same rows either way (issue 16)."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from tuning.report import load_rounds
from tuning.rounds import compact_cell, compact_trial, rounds_dir, write_round

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
    from benchmarks import results_io

    res = results_io.measure(tmp_path, trials=12, rounds=6, sample=3)
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


def reference_trials_table(out, statuses: dict, metric: str) -> pd.DataFrame:
    """The oracle: the former ``trials_table``, one trial at a time from every column."""
    import math

    from tuning.rounds import hyperparameter_columns

    rounds = load_rounds(out)
    skip = ("personal_accuracy_nonprivate", "mia_auc_nonprivate")
    hp_cols = [c for c in hyperparameter_columns() if c in rounds and c not in skip]
    rows = []
    for trial_id, g in rounds.groupby("trial_id", sort=True):
        g = g.sort_values("round")
        last = g.iloc[-1]
        evaluated = g[metric].dropna() if metric in g else pd.Series(dtype=float)
        row = {
            "trial_id": trial_id,
            "algorithm": last["algorithm"],
            "epsilon_budget": float(last["epsilon_budget"]),
            "status": statuses.get(trial_id, "UNKNOWN"),
            "rounds_done": int(last["round"]),
            "noise_multiplier": float(last["noise_multiplier"]),
            "epsilon": float(last["epsilon"]),
            f"final_{metric}": float(evaluated.iloc[-1]) if len(evaluated) else math.nan,
            f"best_{metric}": float(evaluated.max()) if len(evaluated) else math.nan,
            "wall_time_s_nonprivate": float(last["wall_time_s_nonprivate"]),
            "trial_seed": int(last["trial_seed"]) if "trial_seed" in g else -1,
        }
        for c in hp_cols:
            row[c] = last[c]
        rows.append(row)
    return pd.DataFrame(rows)


@pytest.mark.parametrize("metric", ["test_accuracy", "personal_accuracy_nonprivate"])
def test_trials_table_equals_the_per_trial_reference(tmp_path, metric: str) -> None:
    """``trials_table`` reads only the columns it shows and folds all trials in one
    pass; the table equals the former one-trial-at-a-time table from every column, for
    compacted and per-round files, a metric evaluated in some rounds only, and one
    never evaluated (all NaN)."""
    import math

    import tuning.trials_table as trials_table_module
    from tuning.rounds import hyperparameter_columns

    columns = {
        c: ("string" if c in ("ls_scope", "ls_local") else "float")
        for c in hyperparameter_columns()
    }
    for k, rounds in enumerate((3, 4, 2)):
        for r in range(rounds, 0, -1) if k == 1 else range(1, rounds + 1):
            row = {
                "algorithm": "dp_fedavg",
                "epsilon_budget": 4.0 if k < 2 else 8.0,
                "trial_id": f"t_{k:05d}",
                "round": r,
                "epsilon": 0.1 * r,
                "noise_multiplier": 1.5,
                "test_accuracy": math.nan if r % 2 else 0.1 * r + k,
                "wall_time_s_nonprivate": 0.01 * r,
                "trial_seed": 100 + k,
                "lr": 0.1 * (k + 1),
                "clip_norm": 1.0,
                "ls_scope": "tensor" if k else None,
                "unshown_nonprivate": 3.0,
            }
            write_round(tmp_path, row, columns)
    compact_trial(tmp_path, "dp_fedavg", 4.0, "t_00000")  # one compacted, two not
    statuses = {"t_00000": "TERMINATED", "t_00001": "ERROR"}
    table = trials_table_module.trials_table(tmp_path, statuses, metric)
    assert len(table) == 3 and list(table["status"]) == ["TERMINATED", "ERROR", "UNKNOWN"]
    pd.testing.assert_frame_equal(table, reference_trials_table(tmp_path, statuses, metric))
