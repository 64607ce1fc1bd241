"""``rounds.parquet`` as :class:`engine.results.RoundWriter` writes it (through pyarrow)
reads back as the same table as pandas' ``DataFrame(rows).to_parquet`` would give:
columns, order, dtypes and values, for engine rows and for the awkward mixes a row
can hold (None, NaN, keys missing in some rows, ints beside floats, numpy scalars)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from engine.config import load_config
from engine.results import RoundWriter
from engine.simulation import simulate


def _pandas_oracle(rows: list[dict], tmp_path) -> pd.DataFrame:
    path = tmp_path / "oracle.parquet"
    pd.DataFrame(rows).to_parquet(path, index=False)
    return pd.read_parquet(path)


def _written(rows: list[dict], tmp_path) -> pd.DataFrame:
    writer = RoundWriter(tmp_path / "run")
    for row in rows:
        writer.append(row)
    return pd.read_parquet(writer.path)


def test_awkward_rows_read_back_as_pandas_writes_them(tmp_path) -> None:
    rows = [
        {"round": 1, "loss": 0.5, "acc": None, "name": "a", "flag": True, "n": 3},
        {"round": 2, "loss": math.nan, "acc": 0.25, "name": None, "flag": None, "n": 4.5},
        {"round": 3, "loss": np.float64(0.125), "name": "c", "extra": 7, "n": np.int64(2)},
        {"round": 4, "loss": 1.0, "acc": math.nan, "flag": False, "n": None},
    ]
    for row in rows:
        row["all_nan"], row["all_none"] = math.nan, None
    got, want = _written(rows, tmp_path), _pandas_oracle(rows, tmp_path)
    assert list(got.columns) == [
        "round",
        "loss",
        "acc",
        "name",
        "flag",
        "n",
        "all_nan",
        "all_none",
        "extra",
    ]
    pd.testing.assert_frame_equal(got, want, check_dtype=True)


@pytest.mark.parametrize("algorithm", ["dp_fedavg", "dp2_fedsam"])
def test_engine_rows_read_back_as_pandas_writes_them(algorithm, small_overrides, tmp_path):
    cfg = load_config(overrides=[*small_overrides, f"algorithm={algorithm}", "rounds=3"])
    rows: list[dict] = []
    simulate(cfg, write=False, on_round=lambda row, _ex: rows.append(dict(row)))
    assert len(rows) == 3
    got, want = _written(rows, tmp_path), _pandas_oracle(rows, tmp_path)
    pd.testing.assert_frame_equal(got, want, check_dtype=True)
