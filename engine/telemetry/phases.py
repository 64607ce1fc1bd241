"""Optional per-phase wall-clock timing of a round (``benchmarks/round_phases.py``).

The executor, the server and the client workers each hold a timer; by default it is
:data:`OFF`, whose :meth:`NullTimer.phase` returns one shared do-nothing context
manager, so instrumentation changes no computation and costs a method call per phase
(a few per round, never per client or per coordinate). A benchmark installs a
:class:`PhaseTimer` (``Executor.set_timer``) to see where a round's time goes. Timing
reads only the clock: it touches no random stream and no value that is released.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class NullTimer:
    """The timer that records nothing (the default everywhere)."""

    enabled = False
    _null = contextlib.nullcontext()

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return self._null

    def add(self, name: str, seconds: float) -> None:
        pass

    def take(self) -> dict[str, float]:
        return {}


#: The shared do-nothing timer.
OFF = NullTimer()


class PhaseTimer(NullTimer):
    """Accumulates seconds per phase name until :meth:`take` returns and clears them.

    Safe to use from several threads at once (the server's noise thread and the
    checkpoint writer add to the loop's timer): each phase's start is local to its
    ``with``, and :meth:`add` and :meth:`take` hold one lock, so no addition is lost
    or counted twice. Timers stay in their process (a Ray worker makes its own)."""

    enabled = True

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:  # type: ignore[override]
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.seconds)
            self.seconds.clear()
        return out


def timed(items: Iterable[T], timer: NullTimer, name: str) -> Iterable[T]:
    """``items`` with the time spent producing each one added to ``timer``'s ``name``
    (a generator's work between yields); ``items`` itself when the timer is off."""
    if not timer.enabled:
        return items

    def gen() -> Iterator[T]:
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                timer.add(name, time.perf_counter() - t0)
                return
            timer.add(name, time.perf_counter() - t0)
            yield item

    return gen()
