"""The order a pool of processes takes independent runs in: the longest first.

Both pools that run many independent runs at once use it: ``dpfl tune``'s process
runner (:mod:`tuning.trial_pool`, a sweep's trials) and the leaderboard's
(:mod:`tuning.leaderboard.parallel`, a cell's trials and seed runs). When the number of
rounds is searched, a sweep's runs differ in length by 8× or more; a pool that takes
them in the order they were planned can start a long run last while the other
processes sit idle. Taking the costliest first (the classic longest-processing-time
rule) ends the batch sooner. The order changes only when each run ends, never what it
computes: every run's randomness is fixed by its own seed before any run starts, and
nothing here reads a result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def work(rounds: int | float, epochs: int | float, steps: int | float | None) -> float:
    """A run's work, roughly: its rounds times its local passes a round (``steps``, a
    fixed number of local steps, replaces the passes when set)."""
    return float(rounds) * float(steps or epochs)


def longest_first(items: Sequence[T], cost: Callable[[T], float]) -> list[T]:
    """``items`` in the order a pool should take them: the costliest first, ties in the
    given order (a stable sort). A cell of 8 runs of {100, 400, 50, 200, 50, 400, 400,
    400} rounds on two processes ends after 1,200 rounds' time in the given order and
    after 1,000 longest first."""
    return sorted(items, key=cost, reverse=True)
