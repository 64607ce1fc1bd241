"""A SIGKILLed client-worker or server costs a retry, not the run, and changes nothing.

``fault_run.py`` runs in its own Ray (with the dashboard, which the state API needs):
an uninterrupted run and runs whose ``client-worker-1`` or ``server`` actor is found
through ``ray.util.state.list_actors`` and SIGKILLed 0.1 s after round 2 ends
(in round 3, or a later round on a machine fast enough to finish round 3 first). The killed
runs must equal the uninterrupted ones bit for bit — weights, every round's ε and
metrics — and a run allowed no restarts must stop with a clear error, leaving its
completed rounds on disk.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("fault_run.py")
SCENARIOS = [
    "dp_fedavg:3:0:none",
    "dp_fedavg:3:1:client-worker-1",
    "dp_fedavg:3:1:server",
    "dp2_fedsam:3:0:none",
    "dp2_fedsam:3:1:client-worker-1",
    "dp_fedavg:0:1:client-worker-1",
]
IGNORED = ("actor_retries_nonprivate",)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("faults")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *SCENARIOS],
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = out / "result.json"
    assert proc.returncode == 0 and result.exists(), (
        f"exit {proc.returncode}\nstdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    )
    return json.loads(result.read_text()), out


def _same_values(a: list, b: list) -> bool:
    """Element-wise equality of one column: strings exactly, numbers exactly with NaN
    equal to NaN (bit-identical runs; independent of pytest.approx's rules for text)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y):
            continue
        if type(x) is not type(y) and not (
            isinstance(x, (int, float)) and isinstance(y, (int, float))
        ):
            return False
        if x != y:
            return False
    return True


def _same_run(clean: dict, faulty: dict) -> None:
    assert faulty["error"] is None
    assert faulty["kills"] == 1 and faulty["retries"] == 1  # the loss was seen and survived
    assert np.array_equal(np.array(clean["weights"]), np.array(faulty["weights"]))
    assert set(faulty["rows"]) == set(clean["rows"])
    for col, values in clean["rows"].items():
        if col not in IGNORED:
            assert _same_values(values, faulty["rows"][col]), (col, values, faulty["rows"][col])


def test_same_values_compares_text_and_nan() -> None:
    assert _same_values(["dp_fedavg", 1.0, float("nan")], ["dp_fedavg", 1.0, float("nan")])
    assert not _same_values(["dp_fedavg"], ["fedavg"])
    assert not _same_values([1.0, float("nan")], [1.0, 2.0])
    assert not _same_values([1.0], [1.0 + 1e-15])
    assert not _same_values(["1"], [1])


@pytest.mark.parametrize(
    ("clean", "faulty"),
    [
        ("dp_fedavg:3:0:none", "dp_fedavg:3:1:client-worker-1"),
        ("dp_fedavg:3:0:none", "dp_fedavg:3:1:server"),
        ("dp2_fedsam:3:0:none", "dp2_fedsam:3:1:client-worker-1"),
    ],
)
def test_killed_actor_gives_identical_run(outcomes, clean: str, faulty: str) -> None:
    results, _ = outcomes
    _same_run(results[clean], results[faulty])
    assert results[faulty]["rows"]["epsilon"] == results[clean]["rows"]["epsilon"]


def test_no_restarts_left_stops_with_rounds_intact(outcomes) -> None:
    results, out = outcomes
    spec = "dp_fedavg:0:1:client-worker-1"
    stopped = results[spec]
    assert stopped["error"].startswith("WorkerLostError")
    assert "ray.max_worker_restarts=0" in stopped["error"]
    # The kill lands 0.1 s after round 2 ends: in round 3, or later on a fast machine.
    died_in = int(re.match(r"WorkerLostError: round (\d+):", stopped["error"]).group(1))
    assert died_in >= 3
    rows = pd.read_parquet(out / f"run{SCENARIOS.index(spec)}" / "rounds.parquet")
    clean = results["dp_fedavg:3:0:none"]["rows"]
    # The message counts the released rounds: round died_in - 1 too, unless its
    # evaluation (overlapped with round died_in's training) died with the worker.
    done = int(re.search(r"The (\d+) completed rounds are intact", stopped["error"]).group(1))
    assert done in (died_in - 1, died_in - 2)
    assert list(rows["round"]) == list(range(1, done + 1))  # every released round, no more
    assert list(rows["epsilon"]) == clean["epsilon"][:done]
    assert list(rows["test_accuracy"]) == clean["test_accuracy"][:done]


def test_restart_cost_is_reported(outcomes) -> None:
    """The executor measures the wall time a loss cost (restart plus re-run)."""
    results, _ = outcomes
    for spec in ("dp_fedavg:3:1:client-worker-1", "dp_fedavg:3:1:server"):
        assert 0 < results[spec]["retry_seconds"] < results[spec]["seconds"]


def test_lost_evaluation_is_counted_as_unreleased() -> None:
    """A worker lost in round t+1 while round t's evaluation was held leaves t - 1 rows:
    the message must say so, not count round t as intact."""
    from engine.runtime.executors import WorkerLostError, with_released

    lost = WorkerLostError("round 4: w died 1 times; stopping. The 3 completed rounds are intact.")
    text = str(with_released(lost, 2))
    assert "The 2 completed rounds are intact; round 3 is computed again on resume." in text
    assert "The 3 completed" not in text
