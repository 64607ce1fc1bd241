"""Issue 30: the ``dpfl`` executable leaves its own Ray to a detached helper at exit.

* the helper (``engine.runtime.reaper``) finds every descendant of a process, stops
  them (SIGTERM, then SIGKILL after the grace period for one that ignores SIGTERM) and
  never signals a PID whose start time is not the recorded one (a reused PID);
* a whole ``python -m engine.cli run`` exits with its results on disk, and every
  process it handed over (Ray's GCS, raylet, agents, workers) is gone within the
  grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from engine.runtime import reaper
from engine.runtime.switches import REAPER_LOG_ENV

REPO = Path(__file__).resolve().parents[2]

# A grandchild that ignores SIGTERM, and a child that starts it and prints both PIDs.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)
TREE = f"""
import os, subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", {STUBBORN!r}], stdout=subprocess.PIPE, text=True)
g.stdout.readline()
print(os.getpid(), g.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, start: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not reaper._alive(pid, start):
            return True
        time.sleep(0.05)
    return False


def test_descendants_are_found_and_stopped_sigkill_after_the_grace() -> None:
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        child, grandchild = map(int, parent.stdout.readline().split())
        found = dict(reaper.descendants(os.getpid()))
        assert child in found and grandchild in found
        targets = [(child, found[child]), (grandchild, found[grandchild])]
        t0 = time.monotonic()
        killed = reaper.reap(targets, grace_s=0.5)
        waited = time.monotonic() - t0
        assert killed == [(grandchild, found[grandchild])]  # it ignored SIGTERM
        assert 0.5 <= waited < 5.0
        assert _gone(child, found[child], 5.0) and _gone(grandchild, found[grandchild], 5.0)
    finally:
        parent.kill()
        parent.wait()


def test_a_reused_pid_is_never_signalled() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = dict(reaper.descendants(os.getpid()))[proc.pid]
        # the same PID with another start time: a different process for the helper
        assert reaper.reap([(proc.pid, start + 1)], grace_s=0.2) == []
        assert proc.poll() is None
        assert reaper.reap([(proc.pid, start)], grace_s=2.0) == []  # SIGTERM ends it
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dpfl_run_exits_and_its_ray_processes_stop_behind_it(tmp_path) -> None:
    log, out = tmp_path / "handed.txt", tmp_path / "run"
    env = {**os.environ, REAPER_LOG_ENV: str(log)}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "engine.cli", "run", "-q", "--out", str(out)]
    cmd += ["--set", "rounds=2", "--set", "ray.num_workers=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(pd.read_parquet(out / "rounds.parquet")) == 2  # results on disk first
    handed = [line.split() for line in log.read_text().splitlines()]
    names = {n for _, _, n in handed}
    assert {"gcs_server", "raylet"} <= names, names
    assert sum(n.startswith("ray::") for n in names) >= 1, names  # agents or workers
    for pid, start, name in handed:
        assert _gone(int(pid), int(start), reaper.GRACE_S + 5.0), f"{name} ({pid}) still runs"


def test_only_a_local_ray_this_process_started_is_left_for_the_exit(monkeypatch) -> None:
    """``release_ray`` in the executable: its own local Ray is left up for the hand-off;
    a cluster it attached to (``ray.address``) is disconnected at once and never
    handed off (its processes are not this run's)."""
    import ray

    from engine.runtime import ray_start

    calls: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append("shutdown"))
    monkeypatch.setattr(ray_start, "_started_local", ray_start._started_local)  # restored after
    monkeypatch.setattr(ray_start, "_stop_at_exit", True)
    for local, left, shut in ((False, False, ["shutdown"]), (True, True, [])):
        calls.clear()
        monkeypatch.setattr(ray_start, "_left_for_exit", False)
        ray_start._note_start({"address": "local" if local else "127.0.0.1:6379"})
        ray_start.release_ray()
        assert (ray_start._left_for_exit, calls) == (left, shut)
    monkeypatch.setattr(ray_start, "_stop_at_exit", False)  # simulate() from Python
    monkeypatch.setattr(ray_start, "_left_for_exit", False)
    calls.clear()
    ray_start.release_ray()
    assert (ray_start._left_for_exit, calls) == (False, ["shutdown"])
