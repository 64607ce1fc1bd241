"""Evaluation beside the next round's training (``ray.overlap_evaluation``): the round
loop with it on and off, in one run, on the same data, and the two runs' results
compared bit for bit.

Usage::

    python -m benchmarks.eval_overlap [--workload cnn] [--workers 1 2] [--rounds 8]
        [--every 1] [--pairs 2] [--test-size N] [--quick]

For each worker count, ``--pairs`` alternating pairs of ``simulate`` runs (Ray
executor, ``benchmarks/bench.py``'s workload and data, the model evaluated every
``--every`` rounds) with the overlap off and on. Printed per run: the round loop
(from round 1's release to the last round's, per round, so Ray's start and round 1
are left out), the whole ``simulate`` call, and the mean time of the evaluation
itself (the off run's ``evaluation`` phase, timed by the engine's phase timer, which
changes no computation), the driver's wait for an evaluation's sums beside the next
round (on) and its wait for the shards (on: what is left of the training once those
sums are in; so on's two waits together are a round's training with the evaluation
beside it, off's shard wait plus its evaluation the same work in line); then the
medians and on/off ratios. Every pair's weights
and rows (timing column aside) must be equal, or the script exits 1.

What to expect: the overlap hides an evaluation behind the next round's training
only where that training leaves room — a free core (fewer workers than cores) or a
GPU's idle time. With the cores already filled by training, the evaluation thread
only takes turns with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

import engine.simulation.runner as sim
from benchmarks import dpfl_side, workloads
from engine.config import load_config
from engine.telemetry.phases import PhaseTimer


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def one_run(w, ds, workers: int, every: int, overlap: bool, gpu: bool) -> dict[str, Any]:
    """One ``simulate`` run; its round loop, wall, evaluation phase, rows and weights."""
    overrides = dpfl_side.dpfl_overrides(w, workers, None, gpu)
    overrides = [o for o in overrides if not o.startswith("eval.every=")]
    overrides += [f"eval.every={every}", f"ray.overlap_evaluation={str(overlap).lower()}"]
    timer = PhaseTimer()
    original = sim.make_executor
    seen: dict[str, Any] = {}

    def make(prep, *a, **k):
        ex = original(prep, *a, **k)
        ex.set_timer(timer)
        seen["overlaps"] = bool(ex.pool.overlaps_evaluation)
        return ex

    sim.make_executor = make
    try:
        t0 = time.perf_counter()
        result = sim.simulate(load_config(overrides=overrides), dataset=ds, write=False)
        wall = time.perf_counter() - t0
    finally:
        sim.make_executor = original
    times = result.rounds["wall_time_s_nonprivate"].to_numpy()
    phases = timer.take()
    evaluated = int(result.rounds["test_accuracy"].notna().sum())
    return {
        "overlap": overlap,
        "overlaps": seen["overlaps"],
        "loop": float(times[-1] - times[0]) / max(1, len(times) - 1),
        "wall": wall,
        # the off run evaluates on the loop's path; the on run only waits for the sums
        "evaluation": phases.get("evaluation", 0.0) / max(1, evaluated),
        "evaluation_wait": phases.get("evaluation_wait", 0.0) / max(1, evaluated),
        # the driver's wait for the shards (on: after the evaluation's sums were in)
        "train_wait": phases.get("train_wait", 0.0) / max(1, len(times)),
        "rows": result.rounds.drop(columns=["wall_time_s_nonprivate"]),
        "weights": result.weights,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="cnn", choices=sorted(workloads.WORKLOADS))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--every", type=int, default=1, help="eval.every")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument(
        "--test-size", type=int, default=None, help="test examples (default: the workload's)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    cuda = torch.cuda.is_available()
    w, gpu = workloads.workload_for(args.workload, cuda, args.quick, args.rounds)
    if args.test_size is not None:
        w = dataclasses.replace(w, test_size=args.test_size)
    ds = workloads.make_dataset(w)
    print(
        f"== evaluation beside the next round; workload {w.name} ({len(ds.y_test)} test "
        f"examples), {w.rounds} rounds, eval.every={args.every}; torch {torch.__version__}, "
        f"CUDA {cuda}, {os.cpu_count()} CPUs; load average {load()}"
    )
    ray.init(num_cpus=max(2, *args.workers), include_dashboard=False, log_to_driver=False)
    same = True
    try:
        for workers in args.workers:
            runs: list[dict[str, Any]] = []
            for k in range(args.pairs):
                order = (False, True) if k % 2 == 0 else (True, False)
                pair = [one_run(w, ds, workers, args.every, o, gpu) for o in order]
                off, on = sorted(pair, key=lambda r: r["overlap"])
                equal = np.array_equal(off["weights"], on["weights"]) and off["rows"].equals(
                    on["rows"]
                )
                same = same and equal and on["overlaps"] and not off["overlaps"]
                for r in pair:
                    print(
                        f"workers {workers} pair {k + 1} overlap {'on ' if r['overlap'] else 'off'}"
                        f": round loop {r['loop']:.3f} s a round, simulate {r['wall']:.2f} s, "
                        f"evaluation {r['evaluation']:.3f} s, waiting for an evaluation "
                        f"behind {r['evaluation_wait']:.3f} s (per evaluated round), "
                        f"waiting for the shards {r['train_wait']:.3f} s a round; "
                        f"load average {load()}"
                    )
                print(f"workers {workers} pair {k + 1}: same weights and rows: {equal}")
                runs += pair
            med = {
                o: {
                    key: statistics.median(r[key] for r in runs if r["overlap"] == o)
                    for key in ("loop", "wall", "evaluation")
                }
                for o in (False, True)
            }
            print(
                f"== workers {workers}, medians of {args.pairs}: round loop off "
                f"{med[False]['loop']:.3f} s, on {med[True]['loop']:.3f} s (on/off "
                f"{med[True]['loop'] / med[False]['loop']:.3f}); simulate off "
                f"{med[False]['wall']:.2f} s, on {med[True]['wall']:.2f} s (on/off "
                f"{med[True]['wall'] / med[False]['wall']:.3f}); the evaluation itself "
                f"{med[False]['evaluation']:.3f} s a round"
            )
    finally:
        ray.shutdown()
    print(f"all pairs bit-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
