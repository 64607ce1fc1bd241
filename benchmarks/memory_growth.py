"""Does any dpfl process's memory grow with the number of rounds?

Runs one workload of ``bench.py`` through dpfl only (2 CPU workers by default) for
``--rounds`` rounds and reads, at a quarter, half, three quarters and the end of the
run, the resident set (``RssAnon``: private; ``VmRSS``: all, including the pages of
Ray's shared-memory object store the process has touched) and its peak so far
(``VmHWM``) of the driver, every client-worker and the server. The global model is
evaluated at each of those rounds, so every sample includes evaluation's peak. It
prints them and, per process, the growth of the private set and of the peak between
the first sample and the last. Measured, not asserted: glibc's heap and Ray's store
make these numbers move by tens of MiB between samples; a leak of one model-sized
buffer per round would add rounds x 4-8 bytes x d.

    python -m benchmarks.memory_growth                 # cnn, 40 rounds
    python -m benchmarks.memory_growth --workload logreg --rounds 80
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from benchmarks import dpfl_side, measure, workloads
from engine.config import load_config
from engine.simulation import simulate

# Private (anonymous) resident memory, all resident memory (which also counts the
# pages of Ray's shared-memory object store this process has touched), and its peak.
FIELDS = ("RssAnon", "VmRSS", "VmHWM")


class RoundSampler:
    """``simulate(on_round=...)``: VmRSS and VmHWM of every run process at ``rounds``."""

    def __init__(self, run_name: str, rounds: list[int]) -> None:
        self.run_name, self.rounds = run_name, set(rounds)
        self.samples: dict[int, dict[str, tuple[float | None, ...]]] = {}
        self.pids: dict[str, int] = {}

    def __call__(self, row: dict, executor: Any) -> None:
        rnd = int(row["round"])
        if rnd not in self.rounds:
            return
        if not self.pids:
            self.pids = {"driver": os.getpid()}
            self.pids.update(measure.actor_pids(self.run_name, executor)[0])
        self.samples[rnd] = {
            name: tuple(measure.mb(measure.read_status_kb(pid, f)) for f in FIELDS)
            for name, pid in sorted(self.pids.items())
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(workloads.WORKLOADS), default="cnn")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    if a.rounds < 4 or a.rounds % 4:
        p.error(f"--rounds={a.rounds} must be a positive multiple of 4")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    w = workloads.WORKLOADS[a.workload]
    if w.gpu:
        w = dataclasses.replace(w, **workloads.RESNET_CPU)
    w = dataclasses.replace(w, rounds=a.rounds)
    ds = workloads.make_dataset(w)
    q = max(1, a.rounds // 4)
    marks = [q, 2 * q, 3 * q, 4 * q]
    sampler = RoundSampler("memgrowth", marks)
    ray.init(num_cpus=max(2, a.workers), include_dashboard=False, log_to_driver=False)
    try:
        overrides = dpfl_side.dpfl_overrides(w, a.workers, None, False)
        # Evaluate at every sampled round, so each sample's peak includes evaluation's.
        overrides.append(f"eval.every={marks[0]}")
        cfg = load_config(overrides=overrides)
        measure.reset_peak_rss()
        simulate(cfg, dataset=ds, write=False, progress=False, on_round=sampler,
                       run_name="memgrowth")  # fmt: skip
    finally:
        ray.shutdown()
    print(
        f"workload {w.name}: {a.rounds} rounds, {a.workers} workers; MiB as " + " / ".join(FIELDS)
    )
    names = sorted(sampler.samples[marks[-1]])
    head = "".join(f"{'round ' + str(r):>18s}" for r in marks)
    print(f"{'process':26s}{head}  growth (anon, peak)")
    for name in names:
        rows = [sampler.samples.get(r, {}).get(name, (None,) * len(FIELDS)) for r in marks]
        cells = "".join(f"{' / '.join(measure.fmt(v, '.0f') for v in row):>18s}" for row in rows)
        grow = []
        for i in (0, 2):
            first, last = rows[0][i], rows[-1][i]
            grow.append("-" if first is None or last is None else f"{last - first:+.0f}")
        print(f"{name:26s}{cells}  {', '.join(grow)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
