"""``dpfl run --resume DIR`` after the driver is SIGKILLed equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from engine.cli import main
from engine.config import load_config
from engine.simulation import simulate
from tests.live_rows import released_rounds


def _overrides(small_overrides: list[str], out: str) -> list[str]:
    return [
        *small_overrides,
        "rounds=12",
        # 80 examples a client (was 200): ~0.25 s of CPU a round instead of ~0.7 s; the
        # 9 rounds after the kill point still leave the 50 ms poll ~2 s to kill in.
        "dataset.synthetic_mean_samples=80",
        "local.epochs=2",
        "privacy.noise_multiplier=1.0",
        f"out={out}",
    ]


@pytest.mark.slow
def test_driver_killed_then_resumed_equals_uninterrupted(small_overrides, tmp_path) -> None:
    full = simulate(load_config(overrides=_overrides(small_overrides, str(tmp_path / "full"))))
    crashed = tmp_path / "crashed"
    args = [sys.executable, "-m", "engine.cli", "run", "-q"]
    for o in _overrides(small_overrides, str(crashed)):
        args += ["--set", o]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if released_rounds(crashed / "rounds.parquet") >= 3:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    done = len(pd.read_parquet(crashed / "rounds.parquet"))
    assert 3 <= done < 12
    assert main(["run", "-q", "--resume", str(crashed)]) == 0
    resumed = pd.read_parquet(crashed / "rounds.parquet")
    cols = [c for c in full.rounds.columns if c != "wall_time_s_nonprivate"]
    assert list(resumed["round"]) == list(range(1, 13))  # none lost, none duplicated
    pd.testing.assert_frame_equal(resumed[cols], full.rounds[cols])


def test_resume_needs_a_run_folder(tmp_path, capsys) -> None:
    assert main(["run", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and "missing" in err


def test_checkpoint_holds_the_server_state(small_overrides, tmp_path) -> None:
    import pickle

    res = simulate(load_config(overrides=_overrides(small_overrides, str(tmp_path / "r"))))
    state = pickle.loads((tmp_path / "r" / "checkpoint.pkl").read_bytes())
    assert state["server"]["rounds_done"] == 12
    assert np.array_equal(state["server"]["weights"], res.weights)
