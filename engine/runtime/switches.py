"""The environment switches the command line sets and :func:`.ray_start.ensure_ray`
reads: plain strings, so that commands that start no Ray (``dpfl algorithms``,
``dpfl privacy``) can name them without importing the executors and torch."""

from __future__ import annotations

#: "1" (``dpfl ... -q``): the dashboard's address is not printed.
QUIET_ENV = "DPFL_QUIET"
#: "0" (any command without ``--verbose``): workers' output is not forwarded to the
#: console; it stays in Ray's session logs.
LOG_TO_DRIVER_ENV = "DPFL_RAY_LOG_TO_DRIVER"
#: A file path (tests): :func:`.reaper.hand_off` writes there the processes it hands
#: to the detached helper, one ``PID START_TICKS NAME`` line each.
REAPER_LOG_ENV = "DPFL_REAPER_LOG"
