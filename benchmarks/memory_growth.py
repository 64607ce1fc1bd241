"""Does any dpfl process's memory grow with the number of rounds?

Runs one workload of ``bench.py`` through dpfl only (2 CPU workers by default) for
``--rounds`` rounds and reads, at a few rounds spread over the run, the resident set
(``VmRSS``) and its peak so far (``VmHWM``) of the driver, every client-worker and the
server. It prints them and, per process, the growth of the peak between the first
sampled round (after warm-up) and the last. Measured, not asserted: memory on a shared
machine varies by a few MiB between runs.

    python benchmarks/memory_growth.py                 # cnn, 40 rounds
    python benchmarks/memory_growth.py --workload logreg --rounds 80
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402


class RoundSampler:
    """``simulate(on_round=...)``: VmRSS and VmHWM of every run process at ``rounds``."""

    def __init__(self, run_name: str, rounds: list[int]) -> None:
        self.run_name, self.rounds = run_name, set(rounds)
        self.samples: dict[int, dict[str, tuple[float | None, float | None]]] = {}
        self.pids: dict[str, int] = {}

    def __call__(self, row: dict, executor: Any) -> None:
        rnd = int(row["round"])
        if rnd not in self.rounds:
            return
        if not self.pids:
            self.pids = {"driver": os.getpid()}
            self.pids.update(bench.actor_pids(self.run_name, executor)[0])
        self.samples[rnd] = {
            name: (
                bench.mb(bench.read_status_kb(pid, "VmRSS")),
                bench.mb(bench.read_status_kb(pid, "VmHWM")),
            )
            for name, pid in sorted(self.pids.items())
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(bench.WORKLOADS), default="cnn")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    if a.rounds < 4:
        p.error(f"--rounds={a.rounds} must be >= 4")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    w = bench.WORKLOADS[a.workload]
    if w.gpu:
        w = dataclasses.replace(w, **bench.RESNET_CPU)
    w = dataclasses.replace(w, rounds=a.rounds)
    ds = bench.make_dataset(w)
    marks = sorted({max(2, a.rounds // 4), a.rounds // 2, 3 * a.rounds // 4, a.rounds})
    sampler = RoundSampler("memgrowth", marks)
    ray.init(num_cpus=max(2, a.workers), include_dashboard=False, log_to_driver=False)
    try:
        cfg = bench.load_config(overrides=bench.dpfl_overrides(w, a.workers, None, False))
        bench.reset_peak_rss()
        bench.simulate(cfg, dataset=ds, write=False, progress=False, on_round=sampler,
                       run_name="memgrowth")  # fmt: skip
    finally:
        ray.shutdown()
    print(f"workload {w.name}: {a.rounds} rounds, {a.workers} workers; MiB as VmRSS / VmHWM")
    names = sorted(sampler.samples[marks[-1]])
    print(f"{'process':28s}" + "".join(f"{'round ' + str(r):>16s}" for r in marks) + "  HWM growth")
    for name in names:
        cells = []
        for r in marks:
            rss, hwm = sampler.samples.get(r, {}).get(name, (None, None))
            cells.append(f"{bench.fmt(rss, '.0f')} / {bench.fmt(hwm, '.0f')}")
        first = sampler.samples[marks[0]][name][1]
        last = sampler.samples[marks[-1]][name][1]
        growth = "-" if first is None or last is None else f"{last - first:+.0f}"
        print(f"{name:28s}" + "".join(f"{c:>16s}" for c in cells) + f"  {growth:>10s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
