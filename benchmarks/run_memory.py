"""Peak memory of a whole ``dpfl run``, per process (driver, client workers, Ray's
raylet with its object store, GCS and the rest), against the size of the examples.

    python -m benchmarks.run_memory                  # issue 30: 10^6 clients, logreg
    python -m benchmarks.run_memory --quick          # 20,000 clients (CI smoke run)
    python -m benchmarks.run_memory -- --set ray.num_workers=1   # extra dpfl run args

The run is issue 30's held-out check (``dpfl run -q --set dataset.num_clients=1000000
--set dataset.synthetic_mean_samples=8 --set model.name=logreg --set
sampling.rate=0.0001 --set rounds=10 --set eval.every=10 --set privacy.epsilon=4``),
started as a subprocess. Every ``--interval`` seconds this script reads
``/proc/<pid>/status`` of the driver and of every process descended from it (Ray's
processes are its children; the raylet hosts the object store, whose shared memory
every process that maps an object counts in its RSS), keeping each process's
largest ``VmHWM`` (peak resident set) and the largest ``RssAnon`` (private) and
``RssShmem`` (shared memory: object-store pages this process touched) seen. A
process that lives shorter than one interval can be missed; Ray's processes and the
workers live for the whole run.

A generated population's examples live in one shared-memory file (``memfd``, see
``engine/data/shared.py``) that the driver writes and the workers map: each process
counts in its ``RssShmem`` only the pages it touched, and the file exists once on the
machine. Its size (the pages it holds, from the driver's descriptors ``/memfd:dpfl-*``)
is printed too, so that memory is never missed by a per-process figure.

The data's size is the example arrays' (``x_train``, ``y_train``, ``x_test``,
``y_test``) nbytes, computed from the same config in this process after the run
(the run's own data is never touched). The target (issue 30): every process's peak
≤ 1.5 × data + 1 GiB. The load average is printed at the start and the end:
other load on the machine skews the wall time, not the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.measure import descendants

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
MIB = 2**20

ISSUE_RUN = [
    "--set",
    "dataset.num_clients=1000000",
    "--set",
    "dataset.synthetic_mean_samples=8",
    "--set",
    "model.name=logreg",
    "--set",
    "sampling.rate=0.0001",
    "--set",
    "rounds=10",
    "--set",
    "eval.every=10",
    "--set",
    "privacy.epsilon=4",
]


def load_average() -> str:
    """The 1/5/15-minute load average."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def status_kb(pid: int) -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssShmem`` of ``pid`` in kB ({} if gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem"):
                    out[key] = int(line.split()[1])
    except OSError:
        return {}
    return out


def shared_segments(pid: int) -> dict[tuple[int, int], int]:
    """dpfl's shared-memory files that ``pid`` holds open: (dev, inode) -> bytes held."""
    out: dict[tuple[int, int], int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith("/memfd:dpfl-"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return out


def name_of(pid: int, driver: int) -> str:
    """A short role name: driver, a Ray process (gcs_server, raylet, ...) or a worker."""
    if pid == driver:
        return "driver (dpfl run)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "?"
    if comm.startswith("ray::"):
        return comm
    for a in argv:
        base = Path(a).name
        if base in ("raylet", "gcs_server"):
            return f"{base} (object store)" if base == "raylet" else base
        if base.endswith(".py"):
            return base
        if a == "-c":  # python -c "...": Ray's helper processes
            return "python -c " + " ".join(argv[argv.index(a) + 1 :])[:40]
    return " ".join(Path(x).name for x in argv[:2]) if argv else comm


def measure(cmd: list[str], interval: float) -> tuple[dict[int, dict], float, int, str]:
    """Run ``cmd``; per process, the largest figures seen; wall time; exit status. The
    driver's entry also holds ``segments_kB``: the most its shared-memory files held."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    peaks: dict[int, dict] = {}
    while proc.poll() is None:
        segs = sum(shared_segments(proc.pid).values()) // 1024
        drv = peaks.setdefault(proc.pid, {"name": "driver (dpfl run)"})
        drv["segments_kB"] = max(drv.get("segments_kB", 0), segs)
        for pid in descendants(proc.pid):
            s = status_kb(pid)
            if not s:
                continue
            rec = peaks.setdefault(pid, {})
            # Named at every sample: a process forked by the driver carries the
            # driver's command line until it execs, and an actor names itself late.
            name = name_of(pid, proc.pid)
            if name != "?":
                rec["name"] = name
            rec.setdefault("name", "?")
            for k, v in s.items():
                rec[k] = max(rec.get(k, 0), v)
        time.sleep(interval)
    out = proc.stdout.read() if proc.stdout else ""
    return peaks, time.perf_counter() - t0, proc.returncode, out


def data_bytes(run_args: list[str]) -> int:
    """nbytes of the example arrays the run's config builds (built here, after the run)."""
    from engine.config import load_config
    from engine.data import build_dataset
    from engine.privacy import rng as rngs

    sets = [run_args[i + 1] for i, a in enumerate(run_args) if a == "--set"]
    cfg = load_config(overrides=sets)
    ds = build_dataset(cfg.dataset, rngs.numpy_rng(cfg.seed, rngs.DATA))
    return int(sum(a.nbytes for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test)))


def main(argv: list[str] | None = None) -> int:
    """Measure one run; print per-process peaks and the verdict; 1 if the run failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="20,000 clients (seconds)")
    p.add_argument("--interval", type=float, default=0.1, help="sampling period (s)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("extra", nargs="*", help="more dpfl run arguments (after --)")
    a = p.parse_args(argv)
    run_args = list(ISSUE_RUN)
    if a.quick:
        run_args[1] = "dataset.num_clients=20000"
        run_args[5] = "sampling.rate=0.005"
    run_args += a.extra
    exe = Path(sys.executable).with_name("dpfl")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "engine.cli"]
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix="dpfl-run-memory-")) / "run"
    cmd = [*base, "run", "-q", "--out", str(out_dir), *run_args]
    print(f"== whole-run memory: dpfl run -q {' '.join(run_args)} ==")
    print(f"load average at start: {load_average()}", flush=True)
    peaks, wall, rc, out = measure(cmd, a.interval)
    print(out.strip()[-2000:])
    if rc != 0:
        print(f"dpfl run exited {rc}")
        return 1
    data = data_bytes(run_args)
    limit = 1.5 * data + GIB
    print(
        f"wall {wall:.1f} s; examples {data / MIB:,.0f} MiB; target per process "
        f"<= 1.5 x data + 1 GiB = {limit / MIB:,.0f} MiB; load average at end {load_average()}"
    )
    print(
        f"{'process':34s} {'pid':>8s} {'peak RSS':>10s} {'x data':>7s} {'anon':>9s} {'shmem':>9s}"
    )
    rows = sorted(peaks.items(), key=lambda kv: -kv[1].get("VmHWM", 0))
    worst = 0.0
    for pid, r in rows:
        hwm = r.get("VmHWM", 0) * 1024
        if hwm < 40 * MIB and "raylet" not in r["name"]:
            continue
        worst = max(worst, hwm)
        print(
            f"{r['name'][:34]:34s} {pid:>8d} {hwm / MIB:>8,.0f} Mi {hwm / data:>7.2f} "
            f"{r.get('RssAnon', 0) / 1024:>6,.0f} Mi {r.get('RssShmem', 0) / 1024:>6,.0f} Mi"
        )
    segs = max((r.get("segments_kB", 0) for r in peaks.values()), default=0)
    print(
        f"shared-memory files (examples, indices) held by the driver at most: "
        f"{segs / 1024:,.0f} MiB, once on the machine (in RssShmem where touched)"
    )
    verdict = "met" if worst <= limit else "missed"
    print(
        f"largest process peak {worst / MIB:,.0f} MiB = {worst / data:.2f} x data "
        f"(target <= 1.5 x data + 1 GiB: {verdict})"
    )
    if a.json is not None:
        a.json.write_text(
            json.dumps(
                {
                    "wall_s": wall,
                    "data_bytes": data,
                    "processes": {str(k): v for k, v in peaks.items()},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
