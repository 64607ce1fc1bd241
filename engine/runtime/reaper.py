"""Stopping this process's own local Ray after the process has gone (``dpfl run``).

``ray.shutdown()`` stops Ray's processes one type after another and waits for each:
1.2–1.8 s on 2 cores at the end of every ``dpfl run``, after its results are on disk
(issue 30: "don't wait for Ray's processes to exit once results are on disk"). The
``dpfl`` executable instead hands them to this script, started detached (its own
session, no terminal, no pipes), and exits at once:

* the processes are the driver's descendants, found in ``/proc`` before the driver
  exits: Ray's GCS and raylet, the dashboard and its modules, the log and autoscaler
  monitors, the raylet's agents and the client workers. Each is named by its PID *and*
  its start time, so a PID the kernel hands to another process later is never signalled;
* the GCS, the raylet and the processes the driver started die with the thread that
  started them (Ray sets their parent-death signal); the raylet's dashboard and
  runtime-environment agents do not (measured: still running 15 s later). This script
  sends every listed process that is still alive SIGTERM, waits up to
  :data:`GRACE_S` seconds for them to end, then sends the rest SIGKILL.

Only processes the driver started (its descendants) are ever signalled: never a Ray
cluster the run attached to (``ray.address``), never another run's Ray. Run as a
script it imports nothing but the standard library and ``site`` is skipped, so it
starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

#: Seconds between SIGTERM and SIGKILL for processes still alive: the graceful timeout
#: ``ray.shutdown()`` gives each process. The two agents do not end on SIGTERM without
#: their raylet (measured: both still alive 4.9 s after a 5 s grace began), so a longer
#: grace only keeps them around longer.
GRACE_S = 1.0
_POLL_S = 0.05


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent PID, start time in clock ticks, state) of ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(root: int) -> list[tuple[int, int]]:
    """(PID, start time) of every living descendant of ``root``, from ``/proc``."""
    parent: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[2] != "Z":
                parent[int(name)] = (st[0], st[1])
    found: dict[int, int] = {}
    frontier = {root}
    while frontier:
        nxt = {p for p, (pp, _) in parent.items() if pp in frontier and p not in found}
        for p in nxt:
            found[p] = parent[p][1]
        frontier = nxt
    return sorted(found.items())


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip().replace(" ", "_") or "?"
    except OSError:
        return "?"


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] != "Z"


def _signal(targets: list[tuple[int, int]], sig: int) -> None:
    for pid, start in targets:
        if _alive(pid, start):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def reap(targets: list[tuple[int, int]], grace_s: float = GRACE_S) -> list[tuple[int, int]]:
    """SIGTERM every target still alive, wait up to ``grace_s``, SIGKILL the rest;
    returns the targets that had to be killed."""
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        left = [t for t in targets if _alive(*t)]
        if not left:
            return []
        time.sleep(_POLL_S)
    left = [t for t in targets if _alive(*t)]
    _signal(left, signal.SIGKILL)
    return left


def hand_off(root: int | None = None) -> int:
    """Start this script, detached, on ``root``'s (default: this process's) living
    descendants; returns how many it was given. The caller then exits."""
    targets = descendants(os.getpid() if root is None else root)
    if not targets:
        return 0
    from engine.runtime.switches import REAPER_LOG_ENV  # the driver side imports dpfl

    log = os.environ.get(REAPER_LOG_ENV)
    if log:
        with open(log, "w", encoding="utf-8") as f:
            for pid, start in targets:
                f.write(f"{pid} {start} {_name(pid)}\n")
    args = [sys.executable, "-S", os.path.abspath(__file__)]
    args += [f"{pid}:{start}" for pid, start in targets]
    subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return len(targets)


def main(argv: list[str]) -> int:
    targets = []
    for a in argv:
        pid, start = a.split(":")
        targets.append((int(pid), int(start)))
    reap(targets)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
