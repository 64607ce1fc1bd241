"""A Ctrl-C that a run cannot lose.

CPython runs a signal's Python handler between bytecodes of the main thread, and that
includes code run from a ``__del__`` method or a garbage-collection callback. A
``KeyboardInterrupt`` raised there is printed as "Exception ignored in ..." and
dropped, and the run goes on as if nothing had been pressed (``tests/engine/
test_interrupt.py`` provokes it).

:func:`handled` (the command line installs it for the command's duration) replaces the
default handler by one that also *records* the request, and :func:`check` (called by
the round loop before each round) raises ``KeyboardInterrupt`` again if the request
was recorded but the run is still going. An interrupt is therefore acted on where it
arrives or, at the latest, when the round under way ends; the dropped raise is not
printed (it is not an error: the run stops for it). Nothing else changes: a
process that installed its own SIGINT handler (Ray Tune, a notebook) keeps it, one
that ignores SIGINT (``nohup``, a background job of a non-interactive shell) still
ignores it, and :func:`check` without :func:`handled` never raises.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_requested = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt


@contextmanager
def handled() -> Iterator[None]:
    """Record every SIGINT while the block runs (only in the main thread, and only
    where SIGINT still has Python's default handler); the previous handler after it."""
    global _requested
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    _requested = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    hook = sys.unraisablehook

    def quiet_when_recorded(unraisable: sys.UnraisableHookArgs) -> None:
        # the dropped raise of a recorded Ctrl-C: check() raises it again, so
        # CPython's "Exception ignored in ... KeyboardInterrupt" would only alarm
        if not (_requested and unraisable.exc_type is KeyboardInterrupt):
            hook(unraisable)

    sys.unraisablehook = quiet_when_recorded
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
        _requested = False


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT was recorded (its own raise may have
    been dropped: module docstring)."""
    if _requested:
        raise KeyboardInterrupt
