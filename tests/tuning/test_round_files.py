"""A round's Parquet row: the fast one-row builders give the frame (and file) that
casting a pandas frame column by column gives, and the Arrow table that pandas gives."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from tuning.rounds import (
    PARTITIONS,
    STRING_COLUMNS,
    hyperparameter_columns,
    row_frame,
    row_table,
    write_round,
)


def reference_frame(row: dict, columns: dict[str, str]) -> pd.DataFrame:
    """The oracle: a one-row frame cast one column at a time (the former writer)."""
    frame = pd.DataFrame([{k: v for k, v in row.items() if k not in PARTITIONS}])
    for col, kind in columns.items():
        if col not in frame:
            frame[col] = None
        if kind == "string":
            frame[col] = frame[col].astype("string")
        else:
            frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("float64")
    return frame[sorted(frame.columns)]


COLUMNS = {c: ("string" if c in STRING_COLUMNS else "float") for c in hyperparameter_columns()}
BASE = {
    "algorithm": "dp_fedavg",
    "epsilon_budget": 4.0,
    "round": 3,
    "trial_id": "abc_00001",
    "trial_index": 7,
    "epsilon": 1.25,
    "test_accuracy": math.nan,
    "num_clipped": 4,
    "private": True,
    "randomness": "simulation",
    "max_cohort": math.nan,
    "noise_multiplier": np.float64(1.1),
    "loss": np.float32(0.5),
}


#: Rows on top of BASE, by name: typed columns given numbers, text, None, odd values,
#: numpy scalars.
EXTRAS = {
    "no-hyperparameters": {},
    "numbers": {"lr": 0.1, "clip_norm": 2, "ls_scope": "global"},
    "strings-and-none": {"lr": "0.25", "clip_norm": None, "ls_scope": None, "ls_local": "fft"},
    "odd-values": {"lr": True, "clip_norm": "not a number", "rho": math.inf, "ls_scope": math.nan},
    "numpy-scalars": {
        "beta": np.int64(3),
        "sigma_ls": np.float32(0.5),
        "ls_local": "x",
        "note": None,
    },
}


@pytest.mark.parametrize("extra", list(EXTRAS.values()), ids=list(EXTRAS))
def test_row_frame_equals_the_column_by_column_cast(extra, tmp_path) -> None:
    row = {**BASE, **extra}
    fast, ref = row_frame(row, COLUMNS), reference_frame(row, COLUMNS)
    pd.testing.assert_frame_equal(fast, ref)
    fast.to_parquet(tmp_path / "fast.parquet", index=False)
    ref.to_parquet(tmp_path / "ref.parquet", index=False)
    assert pq.read_schema(tmp_path / "fast.parquet").equals(
        pq.read_schema(tmp_path / "ref.parquet"), check_metadata=True
    )
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "fast.parquet"), pd.read_parquet(tmp_path / "ref.parquet")
    )


def _varied(row: dict, k: int) -> dict:
    """Other values of the same Python types (the same layout)."""
    out = {}
    for key, v in row.items():
        if key in PARTITIONS or key == "trial_id":
            out[key] = v
        elif isinstance(v, bool | np.bool_):
            out[key] = type(v)(not v)
        elif isinstance(v, float | np.floating):
            out[key] = type(v)(math.nan if k % 2 else float(v) + 0.5 * k)
        elif isinstance(v, int | np.integer):
            out[key] = type(v)(int(v) + k)
        elif isinstance(v, str):
            out[key] = f"{v}-{k}" if v != "0.25" else "7.5"
        else:
            out[key] = v
    return out


@pytest.mark.parametrize(
    "extra",
    [*EXTRAS.values(), {"shape": [1, 2], "names": ["a", "b"]}],
    ids=[*EXTRAS, "pandas-only"],
)
def test_row_table_equals_pandas_conversion(extra, tmp_path) -> None:
    """Every row of a layout (the first, which teaches the schema, and later ones with
    other values, NaN included) equals ``pyarrow.Table.from_pandas(row_frame(...))``,
    metadata included, and ``write_round``'s file equals ``DataFrame.to_parquet``'s."""
    import pyarrow as pa

    first = {**BASE, **extra}
    for k, row in enumerate([first, first, *(_varied(first, k) for k in range(1, 4))]):
        ref = pa.Table.from_pandas(row_frame(row, COLUMNS), preserve_index=False)
        fast = row_table(row, COLUMNS)
        assert fast.schema.equals(ref.schema, check_metadata=True), k
        assert fast.equals(ref), k
    row = _varied(first, 3)
    written = write_round(tmp_path / "fast", row, COLUMNS)
    (path,) = (tmp_path / "fast").rglob("*.parquet")
    row_frame(row, COLUMNS).to_parquet(tmp_path / "ref.parquet", index=False)
    ref_path = tmp_path / "ref.parquet"
    assert pq.read_schema(path).equals(pq.read_schema(ref_path), check_metadata=True)
    assert pq.read_table(path).equals(pq.read_table(ref_path))
    assert written.equals(pq.read_table(path))
    pd.testing.assert_frame_equal(pd.read_parquet(path), pd.read_parquet(ref_path))
