"""A Ctrl-C that CPython drops (its ``KeyboardInterrupt`` raised inside a ``__del__``)
still stops a run, at the latest before its next round (``engine.runtime.interrupt``)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from engine.config import load_config
from engine.runtime import interrupt
from engine.simulation import simulate
from tests.cross_process import TINY


class _InterruptedWhileCollected:
    """Sends this process SIGINT from its ``__del__``: the handler runs inside the
    finaliser, where CPython prints the KeyboardInterrupt and drops it."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # bytecodes for the handler to run between
            pass


def _ctrl_c_that_is_dropped() -> None:
    obj = _InterruptedWhileCollected()
    del obj  # the interrupt is raised and dropped here


@pytest.fixture(autouse=True)
def default_sigint():
    """Python's own SIGINT handler for each test, as in a ``dpfl`` started from a
    terminal (the suite may run with SIGINT ignored, as a background job of a
    non-interactive shell does, or with a handler an earlier test left), the
    previous one after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def dropped(monkeypatch) -> list:
    """The exceptions CPython drops ("Exception ignored in ..."), by type."""
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    return seen


def test_a_dropped_interrupt_is_raised_by_check(dropped) -> None:
    with interrupt.handled():
        _ctrl_c_that_is_dropped()  # returns: CPython dropped the KeyboardInterrupt
        assert dropped == []  # recorded, so not printed as "Exception ignored"
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    interrupt.check()  # outside the block nothing is recorded
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_the_handler_the_same_interrupt_is_lost(dropped) -> None:
    """The oracle for the test above: Python's own handler loses it (CPython reports
    it to the unraisable hook, then goes on), and check() has nothing to raise."""
    _ctrl_c_that_is_dropped()
    assert dropped == [KeyboardInterrupt]
    interrupt.check()


@pytest.mark.parametrize("executor", ["local", "processes"])
def test_a_run_stops_before_the_round_after_a_dropped_interrupt(executor: str, dropped) -> None:
    rows: list[int] = []

    def on_round(row: dict, ex) -> None:
        rows.append(int(row["round"]))
        if len(rows) == 1:
            _ctrl_c_that_is_dropped()

    config = load_config(overrides=[*TINY, "rounds=5", f"ray.executor={executor}"])
    with interrupt.handled(), pytest.raises(KeyboardInterrupt):
        simulate(config, write=False, on_round=on_round)
    assert dropped == []
    assert rows == [1]
