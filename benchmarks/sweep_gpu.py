"""Sweep throughput on one GPU: total client updates/s of 1, 2, 4 and 8 concurrent trials.

Usage::

    python benchmarks/sweep_gpu.py [--trials 1 2 4 8] [--rounds 30] [--quick]

Each trial is what ``dpfl tune`` runs for a one-worker ``cnn`` trial (``ray.executor=local``
in its own Ray process, ``tune.trial_executor=auto``): ``simulate`` on
``benchmarks/bench.py``'s ``cifar10_pfl`` workload (the CIFAR-shaped ``cnn``, 2.16M
parameters, 1,000 clients of ~50 images, Poisson ~50 per round, one epoch of batch 10),
each trial with its own seed. n trials run at once as Ray tasks holding the GPU share
``dpfl tune`` gives them (:func:`tuning.plan.pack_trials_per_gpu` with
``tune.trials_per_gpu = n``: 1/n of the GPU each). Printed per n: the sweep's client
updates/s over its whole wall time (start-up included) and in steady state (the updates
after each trial's first round over the span from the first trial's first round to the
last trial's end), and the ratio to one trial. Without a GPU it runs the same on the CPU
(one CPU per trial; ``--quick`` shrinks the workload) to check the script; the GPU
figures need a GPU. Timings are wall-clock: the load average is printed with each line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
for p in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench  # noqa: E402

from engine.config import load_config  # noqa: E402
from tuning.plan import pack_trials_per_gpu  # noqa: E402


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def trial(ds: Any, overrides: list[str]) -> dict[str, float]:
    """One trial (in a Ray task): its client updates and the times of its rounds."""
    from engine.simulation import simulate

    marks: list[float] = []
    t0 = time.time()
    res = simulate(
        load_config(overrides=overrides),
        dataset=ds,
        write=False,
        on_round=lambda row, ex: marks.append(time.time()),
        run_name=f"sweep{os.getpid()}",
    )
    n = res.rounds["realised_cohort_size_nonprivate"].to_numpy()
    return {
        "start": t0,
        "first_round_end": marks[0],
        "end": marks[-1],
        "updates": float(n.sum()),
        "steady_updates": float(n[1:].sum()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="tiny workload (CPU check)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    cuda = torch.cuda.is_available()
    w = bench.WORKLOADS["cifar10_pfl"]
    if args.quick:
        w = bench.quick_variant(w)
    w = dataclasses.replace(w, rounds=args.rounds)
    ds = bench.make_dataset(w)
    gpu = torch.cuda.get_device_name(0) if cuda else "none (CPU run: checks the script only)"
    print(f"== sweep throughput, workload {w.name}, GPU {gpu}; load average {load()}")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        data = ray.put(ds)
        base = None
        for n in args.trials:
            overrides = [
                o for o in bench.dpfl_overrides(w, 1, None, False) if not o.startswith("ray.")
            ]
            overrides += ["ray.executor=local", "ray.num_workers=1", "ray.num_cpus_per_worker=1"]
            cfg = load_config(overrides=overrides)
            share = 0.0
            if cuda:
                share = pack_trials_per_gpu(cfg, n, 1.0).ray.num_gpus_per_worker
            task = ray.remote(trial).options(num_cpus=1, num_gpus=share)
            t0 = time.time()
            outs = ray.get(
                [
                    task.remote(data, [*overrides, f"seed={i}", f"ray.num_gpus_per_worker={share}"])
                    for i in range(n)
                ]
            )
            wall = time.time() - t0
            total = sum(o["updates"] for o in outs) / wall
            span = max(o["end"] for o in outs) - min(o["first_round_end"] for o in outs)
            steady = sum(o["steady_updates"] for o in outs) / span
            base = base or steady
            print(
                f"{n} concurrent trial(s), GPU share {share:.3f} each: {total:.1f} client "
                f"updates/s over the wall ({wall:.1f} s), {steady:.1f} steady; steady "
                f"ratio to one trial {steady / base:.2f}; load average {load()}",
                flush=True,
            )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
