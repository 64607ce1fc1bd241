"""Measuring whole processes and the machine they run on: load, hardware, wall time of
a command, the process tree below a PID and each process's peak memory.

Figures here are read from the operating system (``/proc``) or the clock; nothing
imports dpfl, so a benchmark can time one checkout of dpfl from another."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_average() -> str:
    """``/proc/loadavg``'s 1/5/15-minute load (other work on the machine skews timings)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def usable_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc/<pid>/task/*/children``)."""
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return kids


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def timed_command(
    cmd: list[str],
    cwd: str | Path,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    every_s: float = 0.25,
) -> dict[str, Any]:
    """Run ``cmd`` to its end: wall seconds from spawn to exit, exit status, the load
    average before and after, the tail of its output, and ``cpu_s``: the CPU seconds
    (user + system) of the command and every process below it, each process's last
    reading from ``/proc`` sampled every ``every_s`` (a process that lives shorter
    than that, or its last fraction of a sample, is missed). CPU seconds compare
    commands on a loaded machine, where wall time also counts waiting for a core."""
    import tempfile

    load0 = load_average()
    t0 = time.perf_counter()
    seen: dict[int, float] = {}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=out, text=True)
        while proc.poll() is None:
            for pid in descendants(proc.pid):
                got = _proc_cpu(pid)
                if got is not None:
                    seen[pid] = got[0]
            if timeout is not None and time.perf_counter() - t0 > timeout:
                proc.kill()
            time.sleep(every_s)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read()
    return {
        "wall_s": wall,
        "cpu_s": sum(seen.values()),
        "returncode": proc.returncode,
        "load": f"{load0} -> {load_average()}",
        "output": text[-4000:],
    }


def read_status_kb(pid: int | str, field_name: str = "VmHWM") -> int | None:
    """A ``/proc/<pid>/status`` field in kB (None if the process or field is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mb(kb: int | None) -> float | None:
    """kB → MiB (None stays None)."""
    return None if kb is None else kb / 1024.0


def actor_pids(run_name: str, executor: Any) -> tuple[dict[str, int], str]:
    """PIDs of this run's ALIVE actors (names ``<run>:…``) and how they were found.

    ``ray.util.state.list_actors`` needs the dashboard's API server, which the
    benchmark does not start; then the GCS actor table is read instead, and as a
    last resort each actor handle of the executor reports ``os.getpid()``.
    """
    import ray

    prefix = f"{run_name}:"
    try:
        from ray.util.state import list_actors

        found = {
            a.name: int(a.pid)
            for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, timeout=5)
            if a.name and a.name.startswith(prefix) and a.pid
        }
        if found:
            return found, "ray.util.state.list_actors"
    except Exception:  # noqa: BLE001 - no API server without the dashboard
        pass
    try:
        from ray._private import state as gcs_state

        found = {
            v["Name"]: int(v["Pid"])
            for v in gcs_state.actors().values()
            if v.get("State") == "ALIVE" and str(v.get("Name", "")).startswith(prefix)
        }
        if found:
            return found, "gcs actor table (ray._private.state.actors)"
    except Exception:  # noqa: BLE001 - private API may change
        pass
    found = {}
    pool = executor.pool  # engine.runtime.ray_pool.RayWorkerPool
    server = None if getattr(pool, "server_in_driver", False) else getattr(pool, "server", None)
    handles = [*getattr(pool, "workers", []), server]
    for i, h in enumerate(handles):
        if h is None:
            continue
        name = f"{prefix}server" if i == len(handles) - 1 else f"{prefix}client-worker-{i}"
        found[name] = int(ray.get(h.__ray_call__.remote(lambda self: os.getpid())))
    return found, "actor.__ray_call__(os.getpid)"


class LastRoundSampler:
    """``simulate(on_round=...)`` callback: at the last round, record VmHWM of the
    driver and of every actor of the run (before the executor closes them)."""

    def __init__(self, run_name: str, rounds: int) -> None:
        self.run_name = run_name
        self.rounds = rounds
        self.peak_mb: dict[str, float | None] = {}
        self.pids: dict[str, int] = {}
        self.pid_source = ""
        self.worker_device = "unknown"
        self.server_placement = "unknown"

    def __call__(self, row: dict, executor: Any) -> None:
        if int(row["round"]) != self.rounds:
            return
        # ray.server=auto keeps the server in the driver on one node: then "driver"
        # is the driver plus the server, and there is no server actor.
        in_driver = bool(getattr(executor.pool, "server_in_driver", False))
        self.server_placement = "driver" if in_driver else "actor"
        self.pids = {"driver": os.getpid()}
        self.peak_mb = {"driver": mb(read_status_kb("self"))}
        try:
            pids, self.pid_source = actor_pids(self.run_name, executor)
        except Exception as e:  # noqa: BLE001 - memory is reported best-effort
            pids, self.pid_source = {}, f"failed: {type(e).__name__}: {e}"
        for name in sorted(pids):
            self.pids[name] = pids[name]
            self.peak_mb[name] = mb(read_status_kb(pids[name]))
        workers = getattr(executor.pool, "workers", [])  # Ray actors; none in process
        if workers:
            try:
                import ray

                self.worker_device = str(
                    ray.get(
                        workers[0].__ray_call__.remote(
                            lambda self: str(next(self.model.parameters()).device)
                        )
                    )
                )
            except Exception:  # noqa: BLE001 - engine internals may change
                self.worker_device = "unknown"


def timed_process(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """Run ``cmd``; (spawn time, exit time, exit status, its output's tail)."""
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    t1 = time.time()
    return t0, t1, proc.returncode, (proc.stdout + proc.stderr)[-3000:]


#: Ray's processes by role, from their command lines (first match wins).
CPU_ROLES = (
    ("ClientWorker", "client workers"),  # ray::<run>:client-worker-<i>:ClientWorker...
    (":Server", "server actor"),
    ("dashboard_agent", "Ray dashboard agent"),
    ("DashboardAgent", "Ray dashboard agent"),
    ("ray-dashboard-", "Ray dashboard"),
    ("dashboard.py", "Ray dashboard"),
    ("multiprocessing", "Ray dashboard"),  # the dashboard head's helper processes
    ("runtime_env_agent", "Ray runtime-env agent"),
    ("RuntimeEnvAgent", "Ray runtime-env agent"),
    ("log_monitor", "Ray monitors"),
    ("monitor.py", "Ray monitors"),
    ("default_worker", "Ray idle workers"),  # before "raylet": in its arguments
    ("ray::", "Ray idle workers"),
    ("gcs_server", "Ray GCS + raylet"),
    ("raylet", "Ray GCS + raylet"),
)


def _proc_cpu(pid: int) -> tuple[float, str] | None:
    """(user + system CPU seconds, command line) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), cmd


def _machine_busy() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the machine since boot, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def cpu_until_mark(
    cmd: list[str],
    env: dict[str, str],
    timeline: Path,
    label: str,
    every_s: float = 0.1,
    stop_title: str | None = None,
) -> tuple[float, float, int, str, dict[str, Any]]:
    """:func:`timed_process`, also sampling ``/proc`` every ``every_s`` while it runs;
    afterwards, from the sample last before the ``DPFL_TIMELINE`` mark ``label`` (the
    marks are written at exit): the CPU seconds (user + system) the process and each
    of its descendants had used since spawn, summed by role (:data:`CPU_ROLES`), and
    the machine's busy core-seconds over the same span (every process, from
    ``/proc/stat``). A process that exited before the mark keeps its last reading.
    Sampling stops once a descendant's command line contains ``stop_title`` (a Ray
    worker's title names the method it runs: something that happens only after the
    mark), so that it does not compete with what follows. Linux only."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out:
        busy0 = _machine_busy()
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=out, text=True)
        samples: list[tuple[float, tuple[int, int], dict[int, tuple[float, str]]]] = []
        sampling = True
        while sampling and proc.poll() is None:
            now = {}
            for pid in descendants(proc.pid):
                got = _proc_cpu(pid)
                if got is not None:
                    now[pid] = got
            samples.append((time.time(), _machine_busy(), now))
            sampling = stop_title is None or not any(stop_title in c for _, c in now.values())
            time.sleep(every_s)
        proc.wait()
        t1 = time.time()
        out.seek(0)
        tail = out.read()[-3000:]
    marks = read_timeline(timeline) if timeline.exists() else {}
    t_mark = marks.get(label, math.nan)
    before = [smp for smp in samples if smp[0] <= t_mark]
    usage: dict[str, Any] = {"span_s": t_mark - t0, "samples": len(before)}
    if not before:
        return t0, t1, proc.returncode, tail, usage
    seen: dict[int, tuple[float, str]] = {}
    for _, _, now in before:  # each process's last reading and command line
        for pid, (cpu, line) in now.items():
            seen[pid] = (cpu, line or (seen[pid][1] if pid in seen else ""))
    by_role: dict[str, float] = {}
    for pid, (cpu, line) in seen.items():
        role = "driver"
        if pid != proc.pid:
            role = next((r for key, r in CPU_ROLES if key in line), "other")
        by_role[role] = by_role.get(role, 0.0) + cpu
    busy1, hz = before[-1][1], os.sysconf("SC_CLK_TCK")
    jiffies = busy1[0] - busy0[0]
    usage.update(
        span_s=before[-1][0] - t0,
        by_role=dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
        total_cpu_s=sum(by_role.values()),
        machine_busy_core_s=(jiffies - (busy1[1] - busy0[1])) / hz,
        machine_core_s=jiffies / hz,
    )
    return t0, t1, proc.returncode, tail, usage


def read_timeline(path: Path) -> dict[str, float]:
    """``DPFL_TIMELINE``'s marks (label → time.time()); a repeated label keeps its
    first time, except round and evaluation marks (the last)."""
    marks: dict[str, float] = {}
    for line in path.read_text().splitlines():
        label, t = json.loads(line)
        if label not in marks or label.startswith(("round", "eval")):
            marks[label] = float(t)
    return marks


def hardware() -> dict[str, Any]:
    """CPU model, core counts, GPU, library versions."""
    import ray
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable = os.cpu_count() or 1
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "load_average_at_start": load_average(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "gpu": gpu,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
    }


def start_local_ray(num_cpus: int = 2) -> float:
    """A fresh local Ray for a benchmark (no dashboard, workers' output off the
    console); returns its start-up seconds, which no benchmark figure includes."""
    import ray

    t = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    return time.perf_counter() - t


def fmt(v: float | None, spec: str = ".2f") -> str:
    """Format a number or '-'."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
