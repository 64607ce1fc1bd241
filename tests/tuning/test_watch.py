"""``dpfl report --watch``: progress and live figures of a sweep whose folder grows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuning.rounds import write_round
from tuning.watch import LIVE_EPSILON_PNG, LIVE_ROUND_PNG, redraw, write_plan

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def _row(trial: str, rnd: int, rounds: int) -> dict:
    return {
        "algorithm": "dp_fedavg",
        "epsilon_budget": 4.0,
        "trial_id": trial,
        "round": rnd,
        "epsilon": 4.0 * rnd / rounds,
        "test_accuracy": 0.1 * rnd,
        "rounds_planned": rounds,
        "num_clients": 60,
        "sampling_rate": 0.1,
        "delta": 1e-3,
        "dataset": "synthetic",
    }


def test_progress_counts_follow_the_rows_written(tmp_path: Path) -> None:
    """Pending, running, done as round files appear: each count equals the one the
    files imply, and the figures are redrawn once there are rows."""
    write_plan(tmp_path, ["dp_fedavg-eps4"], 3, 2, "compose")
    (tmp_path / "rounds").mkdir()
    assert redraw(tmp_path).line() == "trials: 0 done, 0 running, 3 pending; 0 rows"
    assert not (tmp_path / LIVE_EPSILON_PNG).exists()
    write_round(tmp_path, _row("a", 1, 2), {})
    assert redraw(tmp_path).line() == "trials: 0 done, 1 running, 2 pending; 1 rows"
    assert (tmp_path / LIVE_EPSILON_PNG).read_bytes().startswith(PNG)
    write_round(tmp_path, _row("a", 2, 2), {})
    write_round(tmp_path, _row("b", 1, 2), {})
    assert redraw(tmp_path).line() == "trials: 1 done, 1 running, 1 pending; 3 rows"
    (tmp_path / "trials.parquet").write_bytes(b"")  # the sweep has ended
    state = redraw(tmp_path)
    assert (state.done, state.running, state.pending, state.finished) == (2, 0, 0, True)


def test_pending_under_papernot_steinke_comes_from_the_unreleased_draws(tmp_path: Path) -> None:
    """The plan holds the mean number of trials only; the drawn K is read from the
    operator's unreleased file."""
    import json

    write_plan(tmp_path, ["dp_fedavg-eps4"], 3, 2, "poisson")
    (tmp_path / "rounds").mkdir()
    assert "? pending" in redraw(tmp_path).line()
    (tmp_path / "unreleased").mkdir()
    (tmp_path / "unreleased" / "tuning_draws.json").write_text(
        json.dumps({"num_trials": {"dp_fedavg-eps4": 5}})
    )
    assert redraw(tmp_path).pending == 5


@pytest.mark.slow
def test_watch_follows_a_running_sweep(tmp_path: Path) -> None:
    """``dpfl report --watch`` run beside a ``dpfl tune`` of 4 trials: every progress
    line adds up to 4 trials, done never decreases, the last one shows the sweep
    finished with the rows on disk, and both PNGs are written. (How far the sweep got
    before the watcher's first line depends on the machine's load: the lines in
    between are checked exactly by the next test, which grows the folder itself.)"""
    from tuning.report import load_rounds

    out = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    tune = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "tune", "--algorithms", "dp_fedavg"]
        + ["--epsilons", "4", "--num-samples", "4", "--smoke-test", "--runner", "driver"]
        + ["--set", "rounds=25", "--set", "ray.executor=local", "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # the watcher starts once the sweep's folder is
        while tune.poll() is None and not (out / "tune").is_dir():
            assert time.monotonic() < deadline, "dpfl tune made no folder in 120 s"
            time.sleep(0.2)
        watch = subprocess.run(
            [sys.executable, "-m", "engine.cli", "report", "--watch", str(out)]
            + ["--interval", "0.5", "--iterations", "600"],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert tune.wait(timeout=300) == 0, tune.stderr.read() if tune.stderr else ""
    finally:
        if tune.poll() is None:
            tune.kill()
            tune.wait()
    assert watch.returncode == 0, watch.stderr
    pattern = re.compile(r"trials: (\d+) done, (\d+) running, (\d+|\?) pending; (\d+) rows")
    states = [tuple(m.groups()) for m in map(pattern.search, watch.stdout.splitlines()) if m]
    assert len(states) >= 1, watch.stdout
    done = [int(s[0]) for s in states]
    assert done == sorted(done)
    assert all(int(d) + int(r) + int(p) == 4 for d, r, p, _ in states if p != "?")
    last = watch.stdout.strip().splitlines()[-1]
    rows = len(load_rounds(out))
    assert f"trials: 4 done, 0 running, 0 pending; {rows} rows; sweep finished" in last
    assert rows == 4 * 25
    for name in (LIVE_EPSILON_PNG, LIVE_ROUND_PNG):
        assert (out / name).read_bytes().startswith(PNG)


def test_watch_redraws_as_the_folder_grows(tmp_path: Path) -> None:
    """The ``dpfl report --watch`` process against a folder this test grows: after each
    batch of round files, the second progress line that follows (its read began after
    the write) gives exactly the counts those files imply."""
    write_plan(tmp_path, ["dp_fedavg-eps4"], 2, 3, "compose")
    (tmp_path / "rounds").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "report", "--watch", str(tmp_path)]
        + ["--interval", "0.2", "--iterations", "100000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []

    def after_next_two() -> str:
        for _ in range(2):
            line = proc.stdout.readline()
            assert line, f"the watcher ended: {lines}"
            lines.append(line.strip())
        return lines[-1]

    try:
        assert proc.stdout.readline().startswith("watching ")
        assert after_next_two().endswith("trials: 0 done, 0 running, 2 pending; 0 rows")
        write_round(tmp_path, _row("a", 1, 3), {})
        assert after_next_two().endswith("trials: 0 done, 1 running, 1 pending; 1 rows")
        for rnd in (2, 3):
            write_round(tmp_path, _row("a", rnd, 3), {})
        write_round(tmp_path, _row("b", 1, 3), {})
        assert after_next_two().endswith("trials: 1 done, 1 running, 0 pending; 4 rows")
        for rnd in (2, 3):
            write_round(tmp_path, _row("b", rnd, 3), {})
        (tmp_path / "trials.parquet").write_bytes(b"")
        out, _ = proc.communicate(timeout=120)  # it stops by itself once the sweep ended
        assert (
            out.strip()
            .splitlines()[-1]
            .endswith("trials: 2 done, 0 running, 0 pending; 6 rows; sweep finished")
        )
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / LIVE_ROUND_PNG).read_bytes().startswith(PNG)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--watch", "{dir}/plain"], ["plain", "not a dpfl tune folder"]),
        (["--watch", "{dir}/sweep", "--interval", "0"], ["--interval=0.0"]),
        (["--watch", "{dir}/sweep", "--iterations", "0"], ["--iterations=0"]),
    ],
)
def test_watch_errors_are_one_line_naming_the_value(tmp_path, capsys, args, named) -> None:
    from engine.cli import main

    (tmp_path / "plain").mkdir()
    (tmp_path / "sweep" / "tune").mkdir(parents=True)
    argv = ["report", *[a.format(dir=tmp_path) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpfl: error: ")
    assert all(n in err for n in named), err
    assert not any((tmp_path / "sweep").glob("live_*.png"))
