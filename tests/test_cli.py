"""The dpfl command line: privacy calculator, algorithms list, run, errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from engine import calibrate_noise, epsilon
from engine.cli import main


def test_privacy_calibrates_and_accounts(capsys) -> None:
    assert (
        main(
            [
                "privacy",
                "--epsilon",
                "4",
                "--delta",
                "0.002",
                "--sampling-rate",
                "0.1",
                "--rounds",
                "300",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(1.6882, abs=2e-4)  # notes: RDP 1.6882
    assert out["epsilon"] <= 4
    assert out["noise_multiplier"] == pytest.approx(calibrate_noise(4, 0.002, 0.1, 300))
    assert (
        main(
            [
                "privacy",
                "--noise-multiplier",
                "0.95",
                "--delta",
                "0.002",
                "--sampling-rate",
                "0.1",
                "--rounds",
                "200",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(8.5786, abs=1e-3)
    assert out["epsilon"] == epsilon(0.95, 0.1, 200, 0.002)
    assert out["adjacency"] == "add_remove" and out["accountant"] == "rdp"


def test_privacy_errors_exit_2_with_one_line(capsys) -> None:
    assert (
        main(
            ["privacy", "--epsilon", "4", "--delta", "2", "--sampling-rate", "0.1", "--rounds", "3"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpfl: error: --delta=2") and "\n" not in err


def test_algorithms_lists_every_recipe_once(capsys) -> None:
    from algorithms import RECIPES
    from engine.config import ALGORITHMS

    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(RECIPES) == list(ALGORITHMS)
    assert all(line.rstrip().endswith("]") for line in out)  # each names its paper


def test_run_prints_accuracy_and_epsilon(capsys, small_overrides, tmp_path) -> None:
    args = ["run", "-q"]
    for o in [*small_overrides, "privacy.epsilon=3", f"out={tmp_path}/r"]:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out
    df = pd.read_parquet(tmp_path / "r" / "rounds.parquet")
    assert f"final test_accuracy={df['test_accuracy'].iloc[-1]:.4f}" in out
    assert f"epsilon={df['epsilon'].iloc[-1]:.4g} (budget 3)" in out
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["privacy"]["final_epsilon"] == df["epsilon"].iloc[-1] <= 3
    assert cfg["config"]["rounds"] == 3


def test_run_bad_key_exits_2(capsys) -> None:
    assert main(["run", "--set", "privacy.clip_norm=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dpfl: error: privacy.clip_norm=0.0: must be > 0"


def test_compare_prints_one_table_best_first(capsys, small_overrides, tmp_path) -> None:
    args = ["compare", "-q", "--algorithms", "fedavg,dp_fedavg", "--out", str(tmp_path / "c")]
    for o in [*small_overrides, "privacy.noise_multiplier=5", "rounds=4"]:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    table = pd.read_parquet(tmp_path / "c" / "compare.parquet")
    assert set(table["algorithm"]) == {"fedavg", "dp_fedavg"}
    best = table.sort_values("final_accuracy", ascending=False)["algorithm"].iloc[0]
    assert out[1].split()[0] == best  # first data row is the best
    for name in ("fedavg", "dp_fedavg"):
        assert (tmp_path / "c" / name / "rounds.parquet").is_file()
    assert main(["compare", "--algorithms", "nope"]) == 2
