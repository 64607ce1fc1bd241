"""Client updates per second with 1, 2, 4, 8 dpfl workers per GPU, with and without
vectorised client groups.

For each workload (``cnn``, ``resnet18_gn`` of ``bench.py``), each number k of
workers per GPU and each group setting (``1``: one client after another; ``auto``: the
engine's choice from memory; or a fixed size), runs ``simulate`` with
``ray.num_workers = k × GPUs`` workers of ``ray.num_gpus_per_worker = 1/k`` on one
Ray instance and prints:

* steady clients/s: client updates of rounds 2..R over their wall time (round 1
  pays CUDA initialisation and kernel selection and is reported separately);
* the device the workers trained on (read from a worker, not assumed);
* each worker's peak GPU memory (``torch.cuda.max_memory_reserved`` in the worker);
* final accuracy and ε (the same ε for every configuration of a workload: σ,
  sampling and rounds do not depend on the packing).

Measured, never asserted. ``--device cpu`` runs the same sweep without GPU shares
(workers on the CPU): the CI smoke test uses it with ``--quick``.

    python -m benchmarks.gpu_scaling                       # cnn and resnet18_gn, k = 1 2 4 8
    python -m benchmarks.gpu_scaling --workloads cnn --groups 1,auto,16 --rounds 8
    python -m benchmarks.gpu_scaling --quick --device cpu  # smoke run (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import dpfl_side, measure, workloads
from engine.config import load_config
from engine.simulation import simulate


class WorkerProbe:
    """``simulate(on_round=...)``: at the last round, ask every worker where it trained
    and its peak GPU memory (before the executor closes the actors)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.devices: list[str] = []
        self.gpu_peak_mb: list[float] = []

    def __call__(self, row: dict, executor: Any) -> None:
        if int(row["round"]) != self.rounds:
            return
        import ray

        def peak(worker) -> float:
            import torch

            if worker.device.type != "cuda":
                return None
            return torch.cuda.max_memory_reserved(worker.device) / 2**20

        workers = list(executor.pool.workers)  # engine.runtime.ray_pool.RayWorkerPool
        self.devices = ray.get([w.device_name.remote() for w in workers])
        peaks = ray.get([w.__ray_call__.remote(peak) for w in workers])
        self.gpu_peak_mb = [float(v) for v in peaks if v is not None]


def steady_rate(rows) -> tuple[float, float, int]:
    """(clients/s over rounds 2..R, seconds of round 1, client updates of rounds 2..R)
    from the rounds table (``wall_time_s_nonprivate`` is cumulative)."""
    wall = rows["wall_time_s_nonprivate"].to_numpy(dtype=float)
    updates = rows["realised_cohort_size_nonprivate"].to_numpy(dtype=float)
    first = float(wall[0])
    if len(wall) < 2:
        rate = float(updates.sum() / first) if first > 0 else float("nan")
        return rate, first, int(updates.sum())
    later = float(wall[-1] - wall[0])
    n = int(updates[1:].sum())
    return (n / later if later > 0 else float("nan")), first, n


def run_one(w, ds, k: int, gpus: int, group: str, device: str, cpus: float) -> dict[str, Any]:
    workers = k * max(1, gpus)
    overrides = dpfl_side.dpfl_overrides(w, workers, None, False)
    overrides += [f"ray.num_cpus_per_worker={cpus}", f"eval.every={w.rounds}"]
    if group != "auto":
        overrides.append(f"ray.clients_per_worker_batch={int(group)}")
    if device == "cuda":
        overrides += [f"ray.num_gpus_per_worker={1.0 / k}", "ray.worker_device=auto"]
    else:
        overrides.append("ray.worker_device=cpu")
    probe = WorkerProbe(w.rounds)
    name = f"gpuscale-{w.name}-{k}-{group}"
    t0 = time.perf_counter()
    res = simulate(
        load_config(overrides=overrides),
        dataset=ds,
        write=False,
        progress=False,
        on_round=probe,
        run_name=name,
    )
    wall = time.perf_counter() - t0
    rate, first, n = steady_rate(res.rounds)
    return {
        "workload": w.name,
        "workers_per_gpu": k,
        "workers": workers,
        "group": group,
        "clients_per_s": rate,
        "steady_updates": n,
        "round1_s": first,
        "wall_s": wall,
        "test_accuracy": res.final_accuracy,
        "epsilon": res.final_epsilon,
        "devices": probe.devices,
        "gpu_peak_mb": probe.gpu_peak_mb,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="cnn,resnet18_gn")
    p.add_argument("--workers-per-gpu", default="1,2,4,8")
    p.add_argument("--groups", default="1,auto", help="1, auto or sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--cpus-per-worker", type=float, default=None, help="default: cores / workers")
    p.add_argument("--quick", action="store_true", help="tiny workloads, k = 1 2 (smoke run)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    a.workloads = [s for s in a.workloads.split(",") if s]
    for name in a.workloads:
        if name not in workloads.WORKLOADS:
            known = ", ".join(sorted(workloads.WORKLOADS))
            p.error(f"--workloads: unknown {name!r}; known: {known}")
    try:
        a.workers_per_gpu = [int(s) for s in a.workers_per_gpu.split(",") if s]
    except ValueError:
        p.error(f"--workers-per-gpu={a.workers_per_gpu!r} must be integers, e.g. 1,2,4,8")
    if not a.workers_per_gpu or min(a.workers_per_gpu) < 1:
        p.error(f"--workers-per-gpu={a.workers_per_gpu} must be integers >= 1")
    a.groups = [s for s in a.groups.split(",") if s]
    for g in a.groups:
        if g != "auto" and not (g.isdigit() and int(g) >= 1):
            p.error(f"--groups: {g!r} must be auto or an integer >= 1")
    if a.rounds < 2:
        p.error(f"--rounds={a.rounds} must be >= 2 (round 1 is reported apart)")
    if a.quick:
        a.workers_per_gpu = [k for k in a.workers_per_gpu if k <= 2] or [1]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch

    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if a.device == "cuda" and gpus == 0:
        print(
            "gpu_scaling: --device cuda but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); "
            "use --device cpu for a CPU run",
            file=sys.stderr,
        )
        return 2
    hw = measure.hardware()
    cores = os.cpu_count() or 1
    most = max(a.workers_per_gpu) * max(1, gpus)
    cpus = a.cpus_per_worker or max(0.25, min(2.0, cores / most))
    print(f"== dpfl GPU scaling ({a.device}) ==")
    print(
        f"hardware: CPU {hw['cpu']} ({cores} cores), GPU {hw['gpu'] or 'none'} x {gpus}; "
        f"torch {hw['torch']}, ray {hw['ray']}; {cpus:g} CPU per worker"
    )
    ray.init(
        num_cpus=max(cores, int(most * cpus + 0.999)),
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    results: list[dict[str, Any]] = []
    try:
        for name in a.workloads:
            w = workloads.WORKLOADS[name]
            if a.device == "cpu" and w.gpu:
                w = dataclasses.replace(w, **workloads.RESNET_CPU)
            if a.quick:
                w = workloads.quick_variant(w)
            w = dataclasses.replace(w, rounds=a.rounds)
            ds = workloads.make_dataset(w)
            print(
                f"workload {w.name}: model={w.model} N={w.num_clients} q={w.rate} "
                f"rounds={w.rounds} batch={w.batch_size} epochs={w.epochs}"
            )
            for k in a.workers_per_gpu:
                for group in a.groups:
                    r = run_one(w, ds, k, gpus, group, a.device, cpus)
                    results.append(r)
                    peaks = ", ".join(f"{v:.0f}" for v in r["gpu_peak_mb"]) or "-"
                    print(
                        f"  {k} per GPU ({r['workers']} workers), groups {group:>4}: "
                        f"{r['clients_per_s']:8.1f} clients/s (rounds 2..{w.rounds}, "
                        f"{r['steady_updates']} updates), round 1 {r['round1_s']:.2f} s, "
                        f"acc {r['test_accuracy']:.4f}, eps {r['epsilon']:.4f}, "
                        f"on {sorted(set(r['devices']))}, GPU peak MiB/worker [{peaks}]",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    if a.json is not None:
        a.json.write_text(json.dumps({"hardware": hw, "results": results}, indent=2))
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
