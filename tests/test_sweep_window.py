"""benchmarks/sweep_gpu.py: the steady rate of concurrent trials is taken over the window
where every trial is past its first round and none has finished, not over the span that
includes other trials' start-ups."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.benchmark_scripts import load_benchmark


def _load_sweep() -> ModuleType:
    return load_benchmark("sweep_gpu.py")


def _trial(marks: list[float], ups: list[float]) -> dict:
    return {
        "start": marks[0] - 3.0,
        "first_round_end": marks[0],
        "end": marks[-1],
        "updates": float(sum(ups)),
        "marks": marks,
        "round_updates": ups,
    }


def test_staggered_trials_count_the_rounds_ending_in_the_common_window() -> None:
    sweep = _load_sweep()
    # A: rounds end at 1..10 s; B starts 4 s later, rounds end at 5..14 s.
    a = _trial([float(t) for t in range(1, 11)], [100.0, 10, 11, 12, 13, 14, 15, 16, 17, 18])
    b = _trial([float(t) for t in range(5, 15)], [100.0] + [20.0] * 9)
    win = sweep.steady_window([a, b])
    # Window (5, 10]: A's rounds ending at 6..10 s (14+15+16+17+18 = 80), B's ending at
    # 6..10 s (5 x 20 = 100); B's first round (ending at 5 s) and A's round ending at 5 s
    # are not counted: the window is open at its start.
    assert (win.start, win.end) == (5.0, 10.0)
    assert win.counted == 180.0
    assert (win.rounds_min, win.rounds_max) == (5, 5)
    assert win.length == 5.0
    assert win.min_length == pytest.approx(3.0)  # 3 rounds of 1 s
    assert win.valid
    assert win.rate == pytest.approx(36.0)
    # The old span formula: (126 + 180) updates after round one over 14 - 1 = 13 s.
    old = sweep.span_rate([a, b])
    assert old == pytest.approx(306.0 / 13.0)
    assert old < 0.7 * win.rate


def test_single_trial_window_is_everything_after_its_first_round() -> None:
    sweep = _load_sweep()
    a = _trial([2.0, 4.0, 6.0, 8.0, 10.0], [50.0, 4.0, 6.0, 8.0, 10.0])
    win = sweep.steady_window([a])
    assert (win.start, win.end, win.counted) == (2.0, 10.0, 28.0)
    assert (win.rounds_min, win.rounds_max) == (4, 4)
    assert win.rate == pytest.approx(28.0 / 8.0)


def test_trials_without_overlap_give_no_steady_rate() -> None:
    sweep = _load_sweep()
    a = _trial([1.0, 2.0, 3.0, 4.0, 5.0], [10.0] * 5)
    b = _trial([6.0, 7.0, 8.0, 9.0, 10.0], [10.0] * 5)
    win = sweep.steady_window([a, b])
    assert win.start == 6.0 and win.end == 5.0
    assert win.length == 0.0
    assert win.counted == 0.0 and (win.rounds_min, win.rounds_max) == (0, 0)
    assert not win.valid
    assert win.rate is None


def test_window_shorter_than_three_rounds_of_the_slowest_trial_is_invalid() -> None:
    sweep = _load_sweep()
    a = _trial([float(t) for t in range(1, 11)], [10.0] * 10)  # 1 s rounds
    b = _trial([8.0, 10.0, 12.0, 14.0], [10.0] * 4)  # 2 s rounds
    win = sweep.steady_window([a, b])
    # Window (8, 10]: 2 s with rounds in it (A: 9, 10; B: 10) but under 3 x 2 s.
    assert (win.start, win.end, win.counted) == (8.0, 10.0, 30.0)
    assert (win.rounds_min, win.rounds_max) == (1, 2)
    assert win.min_length == pytest.approx(6.0)
    assert not win.valid and win.rate is None
