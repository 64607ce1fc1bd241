"""The dpfl side of ``benchmarks/bench.py``: a workload as ``--set`` overrides, and one
measured ``simulate`` on a local Ray the benchmark started."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks.measure import LastRoundSampler, reset_peak_rss
from benchmarks.workloads import Workload
from engine.config import load_config
from engine.data.federated import FederatedDataset


def dpfl_overrides(
    w: Workload,
    workers: int,
    clients_per_batch: int | None,
    gpu: bool,
    memory_format: str = "auto",
) -> list:
    """``--set`` overrides expressing the workload for dpfl."""
    out = [
        "algorithm=dp_fedavg",
        f"seed={w.seed}",
        f"rounds={w.rounds}",
        f"dataset.name={w.config_dataset}",
        f"dataset.num_clients={w.num_clients}",
        f"model.name={w.model}",
        f"model.memory_format={memory_format}",
        "sampling.mode=poisson",
        f"sampling.rate={w.rate}",
        f"eval.every={w.rounds}",
        "privacy.epsilon=null",
        f"privacy.noise_multiplier={w.noise_multiplier}",
        f"privacy.clip_norm={w.clip_norm}",
        f"local.epochs={w.epochs}",
        f"local.batch_size={w.batch_size}",
        f"local.lr={w.lr}",
        "ray.executor=ray",
        f"ray.num_workers={workers}",
        "ray.num_cpus_per_worker=1",
    ]
    if clients_per_batch is not None:
        out.append(f"ray.clients_per_worker_batch={clients_per_batch}")
    if gpu:
        out.append(f"ray.num_gpus_per_worker={1.0 / workers}")
    return out


def run_dpfl(
    w: Workload, ds: FederatedDataset, overrides: list[str], run_name: str
) -> dict[str, Any]:
    """``simulate`` on the prepared dataset (Ray already started); the measurements."""
    from engine.simulation import simulate

    cfg = load_config(overrides=overrides)
    sampler = LastRoundSampler(run_name, w.rounds)
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    res = simulate(
        cfg, dataset=ds, write=False, progress=False, on_round=sampler, run_name=run_name
    )
    wall = time.perf_counter() - t0
    rows = res.rounds
    return {
        "wall_s": wall,
        "round_loop_s": float(rows["wall_time_s_nonprivate"].iloc[-1]),
        "client_updates": int(rows["realised_cohort_size_nonprivate"].sum()),
        "test_accuracy": res.final_accuracy,
        "mean_update_norm": float(
            (rows["mean_update_norm_nonprivate"] * rows["realised_cohort_size_nonprivate"]).sum()
            / max(1, int(rows["realised_cohort_size_nonprivate"].sum()))
        ),
        "epsilon": res.final_epsilon,
        "delta": float(res.privacy["delta"]),
        "accountant": str(res.privacy["accountant"]),
        "peak_rss_mb": sampler.peak_mb,
        "peak_rss_reset": reset,
        "pids": sampler.pids,
        "pid_source": sampler.pid_source,
        "worker_device": sampler.worker_device,
        "server_placement": sampler.server_placement,
        "_weights": np.asarray(res.weights, dtype=np.float32),
    }
