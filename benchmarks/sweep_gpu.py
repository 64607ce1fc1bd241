"""Sweep throughput on one GPU: total client updates/s of 1, 2, 4 and 8 concurrent trials.

Usage::

    python -m benchmarks.sweep_gpu [--trials 1 2 4 8] [--rounds 60] [--quick]

Each trial is what ``dpfl tune`` runs for a one-worker ``cnn`` trial (``ray.executor=local``
in its own Ray process, ``tune.trial_executor=auto``): ``simulate`` on
``benchmarks/bench.py``'s ``cifar10_pfl`` workload (the CIFAR-shaped ``cnn``, 2.16M
parameters, 1,000 clients of ~50 images, Poisson ~50 per round, one epoch of batch 10),
each trial with its own seed. n trials run at once as Ray tasks holding the GPU share
``dpfl tune`` gives them (:func:`tuning.plan.pack_trials_per_gpu` with
``tune.trials_per_gpu = n``: 1/n of the GPU each). Every trial records the wall-clock
time (``time.time()``) at the end of each of its rounds and the realised cohort size of
each round (its client updates).

Printed per n, on one line:

* **over the wall**: all trials' client updates divided by the sweep's wall time, from
  submitting the n tasks to the last result (Ray task start, torch import, CUDA
  initialisation and executor start-up included).
* **steady**: the rate while all n trials are in steady state at once. The window is
  ``[max over trials of the end of its first round, min over trials of the end of its
  last round]``: every trial is past its first round (start-up and CUDA warm-up) and
  none has finished. For each trial the updates of the rounds that *end* inside the
  window (end time in ``(window start, window end]``) are counted; steady = the counted
  updates of all trials / the window's length. Also printed: the window's length in s
  and how many rounds of each trial ended in it (min-max over trials). Trials start
  staggered (each Ray task imports torch and starts its own executor), so with few
  rounds the window is short or empty: when it is empty or shorter than 3 mean rounds
  (after the first) of the slowest trial, no steady figure is given; the line says the
  window is too short and prints instead the old figure, labelled "span incl.
  start-ups": the updates after each trial's first round over the span from the first
  trial's first round to the last trial's end, which counts other trials' start-ups and
  so understates the concurrent rate. Raise ``--rounds`` then.
* the ratio of the steady figure to one trial's (the ``n = 1`` line), only when both
  are valid.

Without a GPU it runs the same on the CPU (one CPU per trial; ``--quick`` shrinks the
workload) to check the script; the GPU figures need a GPU. Timings are wall-clock: the
load average is printed with each line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from benchmarks import dpfl_side, workloads
from engine.config import load_config
from tuning.plan import pack_trials_per_gpu

MIN_WINDOW_ROUNDS = 3  # the steady window must last this many rounds of the slowest trial


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def trial(ds: Any, overrides: list[str]) -> dict[str, Any]:
    """One trial (in a Ray task): its client updates and the end times of its rounds.

    ``marks[k]`` is the ``time.time()`` at the end of round k and ``round_updates[k]``
    its realised cohort size (client updates)."""
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
    rounds = res.rounds.sort_values("round")
    n = [float(x) for x in rounds["realised_cohort_size_nonprivate"].to_numpy()]
    if len(n) != len(marks):
        raise RuntimeError(f"{len(n)} rounds in the results but {len(marks)} on_round calls")
    return {
        "start": t0,
        "first_round_end": marks[0],
        "end": marks[-1],
        "updates": float(sum(n)),
        "marks": marks,
        "round_updates": n,
    }


class Window(NamedTuple):
    """The steady window of a set of concurrent trials (see the module docstring)."""

    start: float  # max over trials of the end of the first round
    end: float  # min over trials of the end of the last round
    counted: float  # updates of the rounds that end in (start, end], all trials
    rounds_min: int  # fewest rounds of one trial that end in the window
    rounds_max: int  # most rounds of one trial that end in the window
    min_length: float  # MIN_WINDOW_ROUNDS mean steady rounds of the slowest trial

    @property
    def length(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def valid(self) -> bool:
        return self.length > 0 and self.counted > 0 and self.length >= self.min_length

    @property
    def rate(self) -> float | None:
        """Counted updates per second of the window; None when the window is not valid."""
        return self.counted / self.length if self.valid else None


def steady_window(outs: Sequence[dict[str, Any]]) -> Window:
    """The window where every trial is past its first round and not finished, and the
    updates of the rounds that end in it (pure: works on :func:`trial`'s dicts)."""
    start = max(o["first_round_end"] for o in outs)
    end = min(o["end"] for o in outs)
    counted = 0.0
    per_trial: list[int] = []
    slowest = 0.0
    for o in outs:
        marks, ups = o["marks"], o["round_updates"]
        if len(marks) != len(ups):
            raise ValueError(f"{len(marks)} round end times but {len(ups)} round sizes")
        inside = [k for k, t in enumerate(marks) if start < t <= end]
        counted += sum(ups[k] for k in inside)
        per_trial.append(len(inside))
        steady_rounds = len(marks) - 1
        mean_round = (
            (o["end"] - o["first_round_end"]) / steady_rounds if steady_rounds else float("inf")
        )
        slowest = max(slowest, mean_round)
    return Window(start, end, counted, min(per_trial), max(per_trial), MIN_WINDOW_ROUNDS * slowest)


def span_rate(outs: Sequence[dict[str, Any]]) -> float:
    """The old figure: updates after each trial's first round over the span from the
    first trial's first round end to the last trial's end (includes other trials'
    start-ups when they start staggered)."""
    span = max(o["end"] for o in outs) - min(o["first_round_end"] for o in outs)
    steady = sum(sum(o["round_updates"][1:]) for o in outs)
    return steady / span if span > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="tiny workload (CPU check)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    cuda = torch.cuda.is_available()
    w = workloads.WORKLOADS["cifar10_pfl"]
    if args.quick:
        w = workloads.quick_variant(w)
    w = dataclasses.replace(w, rounds=args.rounds)
    ds = workloads.make_dataset(w)
    gpu = torch.cuda.get_device_name(0) if cuda else "none (CPU run: checks the script only)"
    print(f"== sweep throughput, workload {w.name}, GPU {gpu}; load average {load()}")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        data = ray.put(ds)
        base: float | None = None  # the valid steady rate of one trial
        for n in args.trials:
            overrides = [
                o for o in dpfl_side.dpfl_overrides(w, 1, None, False) if not o.startswith("ray.")
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
            win = steady_window(outs)
            where = (
                f"window where all {n} are in steady state {win.length:.2f} s, "
                f"{win.rounds_min}-{win.rounds_max} rounds per trial in it"
            )
            if win.rate is not None:
                if n == 1:
                    base = win.rate
                ratio = f"{win.rate / base:.2f}" if base else "n/a (no valid one-trial figure)"
                steady = f"{win.rate:.1f} steady ({where}); steady ratio to one trial {ratio}"
            else:
                steady = (
                    f"NO steady figure for n={n}: {where}, too short (< {MIN_WINDOW_ROUNDS} "
                    f"rounds of the slowest trial = {win.min_length:.2f} s; raise --rounds); "
                    f"span incl. start-ups (not steady, understates): {span_rate(outs):.1f}"
                )
            print(
                f"{n} concurrent trial(s), GPU share {share:.3f} each: {total:.1f} client "
                f"updates/s over the wall ({wall:.1f} s), {steady}; load average {load()}",
                flush=True,
            )
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
