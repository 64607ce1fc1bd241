"""Vectorised client groups against one client at a time, in one worker, same cohort.

Builds one :class:`engine.federated.client.ClientWorker` in this process (no Ray) per group
size G, on ``--device`` (cuda by default), and times ``train_shard`` on the same
cohort of ``--cohort`` clients of a benchmark workload (``cnn``: MNIST-shaped;
``resnet18_gn``: CIFAR-shaped; data from ``bench.py``). For each G it prints:

* clients/s of ``train_shard`` (median over ``--repeats`` timed rounds after one
  warm-up round; the device is synchronised before the clock stops) and the ratio
  to G = 1 — the number issue "vectorised clients on the GPU" asks about;
* the largest relative difference of the shard's summed clipped update from the
  G = 1 run, ‖sum_G − sum_1‖ / ‖sum_1‖ (float32 rounding only: the minibatches of
  every client are the same, and each update is clipped on its own);
* the worker's peak GPU memory (``torch.cuda.max_memory_allocated``).

Measured, never asserted. ``--device cpu --quick`` is the CI smoke run.

    python -m benchmarks.gpu_vectorized                         # cnn, G = 1 8 16 32 64
    python -m benchmarks.gpu_vectorized --models cnn,resnet18_gn --groups 1,16,50
    python -m benchmarks.gpu_vectorized --device cpu --quick     # smoke run (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from algorithms import build_pipeline
from benchmarks import measure, workloads
from engine.config import AlgoConfig
from engine.federated.client import ClientWorker, LocalSpec


def make_worker(
    w: workloads.Workload, ds, group: int, device: str, steps: int | None = None
) -> ClientWorker:
    spec = LocalSpec(
        seed=w.seed,
        model_name=w.model,
        epochs=w.epochs,
        batch_size=w.batch_size,
        lr=w.lr,
        lr_decay=1.0,
        momentum=0.0,
        weight_decay=0.0,
        pipeline=build_pipeline(
            "dp_fedavg", AlgoConfig(), w.clip_norm, w.noise_multiplier, w.model
        ),
        num_threads=max(1, min(4, os.cpu_count() or 1)),
        clients_per_batch=group,
        memory_format="auto",
        device=device,
        gpu_share=1.0 if device == "cuda" else 0.0,
        steps=steps,
    )
    return ClientWorker(ds, spec)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_group(
    w, ds, group: int, device: str, cohort: np.ndarray, repeats: int, steps: int | None = None
) -> dict:
    worker = make_worker(w, ds, group, device, steps)
    if group > 1 and worker.vectorized is None:
        return {"group": group, "skipped": worker.vectorized_note}
    dev = worker.device
    weights = torch.cat([p.detach().reshape(-1) for p in worker.params]).cpu().numpy()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    worker.train_shard(weights, 1, cohort)  # warm-up: kernel selection, caches
    times, out = [], None
    for r in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        out = worker.train_shard(weights, 2 + r, cohort)
        sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
    # The compared sum: round 2 (the first timed round) for every G.
    ref = worker.train_shard(weights, 2, cohort).update_sum if repeats > 1 else out.update_sum
    return {
        "group": group,
        "note": worker.vectorized_note,
        "seconds": statistics.median(times),
        "clients_per_s": len(cohort) / statistics.median(times),
        "steps": int(out.num_steps),
        "gpu_peak_mb": peak,
        "_sum": np.asarray(ref, dtype=np.float64),
    }


def profile_round(w, ds, group: int, device: str, cohort: np.ndarray) -> None:
    """Where one ``train_shard`` spends its time: cProfile (host) and torch.profiler."""
    import cProfile
    import pstats

    worker = make_worker(w, ds, group, device)
    weights = torch.cat([p.detach().reshape(-1) for p in worker.params]).cpu().numpy()
    worker.train_shard(weights, 1, cohort)
    sync(worker.device)
    prof = cProfile.Profile()
    prof.enable()
    worker.train_shard(weights, 2, cohort)
    sync(worker.device)
    prof.disable()
    print(f"-- cProfile of one train_shard, G={group} ({worker.vectorized_note})")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if worker.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        worker.train_shard(weights, 3, cohort)
        sync(worker.device)
    key = "self_cuda_time_total" if worker.device.type == "cuda" else "self_cpu_time_total"
    print(tp.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=50))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn", help="workloads of bench.py, comma-separated")
    p.add_argument("--groups", default="1,8,16,32,64", help="group sizes; 1 = one by one")
    p.add_argument("--cohort", type=int, default=64, help="clients in the shard")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny workload (smoke run)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--local-steps", type=int, default=None, help="local steps (default: 1 epoch)")
    p.add_argument(
        "--cpu-reference",
        action="store_true",
        help="also train G=1 on the CPU and print every run's difference from it",
    )
    p.add_argument("--profile", type=int, default=0, help="profile one round at this group size")
    a = p.parse_args(argv)
    a.models = [s for s in a.models.split(",") if s]
    for m in a.models:
        if m not in workloads.WORKLOADS:
            p.error(f"--models: unknown {m!r}; known: {', '.join(sorted(workloads.WORKLOADS))}")
    try:
        a.groups = [int(s) for s in a.groups.split(",") if s]
    except ValueError:
        p.error(f"--groups={a.groups!r} must be integers, e.g. 1,8,16")
    if not a.groups or min(a.groups) < 1:
        p.error(f"--groups={a.groups} must be integers >= 1")
    if 1 not in a.groups:
        a.groups = [1, *a.groups]  # the baseline every ratio is taken against
    if a.cohort < 1 or a.repeats < 1:
        p.error(f"--cohort={a.cohort} and --repeats={a.repeats} must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_vectorized: --device cuda but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    hw = measure.hardware()
    print(f"== dpfl vectorised groups vs one by one ({a.device}) ==")
    print(f"hardware: CPU {hw['cpu']}, GPU {hw['gpu'] or 'none'}; torch {hw['torch']}")
    results: list[dict[str, Any]] = []
    for name in a.models:
        w = workloads.WORKLOADS[name]
        if a.device == "cpu" and w.gpu:
            w = dataclasses.replace(w, **workloads.RESNET_CPU)
        if a.quick:
            w = workloads.quick_variant(w)
        w = dataclasses.replace(w, num_clients=max(w.num_clients, a.cohort))
        ds = workloads.make_dataset(w)
        cohort = np.arange(min(a.cohort, w.num_clients), dtype=np.int64)
        print(
            f"workload {w.name}: model={w.model} input={w.input_shape} cohort={len(cohort)} "
            f"clients of ~{w.mean_samples} examples, batch {w.batch_size}, {w.epochs} epoch"
        )
        if a.profile:
            profile_round(w, ds, a.profile, a.device, cohort)
        base = None
        cpu_sum = None
        if a.cpu_reference:
            cpu_sum = time_group(w, ds, 1, "cpu", cohort, 1, a.local_steps)["_sum"]
        for g in a.groups:
            r = time_group(w, ds, g, a.device, cohort, a.repeats, a.local_steps)
            r["workload"] = w.name
            if "skipped" in r:
                print(f"  G={g:>3}: not vectorised ({r['skipped']})")
                results.append(r)
                continue
            s = r.pop("_sum")
            if base is None:
                base = (r, s)
            r["speedup_vs_one_by_one"] = r["clients_per_s"] / base[0]["clients_per_s"]
            r["rel_diff_vs_one_by_one"] = float(
                np.linalg.norm(s - base[1]) / max(np.linalg.norm(base[1]), 1e-30)
            )
            if cpu_sum is not None:
                r["rel_diff_vs_cpu"] = float(
                    np.linalg.norm(s - cpu_sum) / max(np.linalg.norm(cpu_sum), 1e-30)
                )
            results.append(r)
            vs_cpu = f"  vs CPU {r['rel_diff_vs_cpu']:.1e}" if cpu_sum is not None else ""
            peak = "-" if r["gpu_peak_mb"] is None else f"{r['gpu_peak_mb']:.0f}"
            print(
                f"  G={g:>3}: {r['clients_per_s']:9.1f} clients/s  "
                f"x{r['speedup_vs_one_by_one']:5.2f}"
                f"  |sum-sum1|/|sum1|={r['rel_diff_vs_one_by_one']:.1e}  "
                f"steps {r['steps']}  peak MiB {peak}{vs_cpu}",
                flush=True,
            )
        if not math.isfinite(base[0]["clients_per_s"]):
            return 1
    if a.json is not None:
        a.json.write_text(json.dumps({"hardware": hw, "results": results}, indent=2))
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
