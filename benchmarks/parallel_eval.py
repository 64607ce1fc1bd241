"""Evaluation on k client workers against a plain loop (``python -m benchmarks.startup_eval``'s
second part): examples per second of the public test set, the plain loop's and
``RayWorkerPool.evaluate``'s on k = 1, 2, ... workers, and their ratios.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.measure import load_average
from benchmarks.workloads import WORKLOADS, make_template_data
from engine.config import load_config
from engine.models import build_model
from engine.privacy import rng as rngs
from engine.simulation import make_executor, prepare

EVAL_TARGET_FACTOR = 0.8  # dpfl on k workers >= 0.8 k x plain examples/s


@torch.no_grad()
def plain_eval(model: nn.Module, x: np.ndarray, y: np.ndarray, layout: str) -> tuple:
    """(correct, loss sum, n): the plain loop's evaluation, batches of 2048."""
    model.eval()
    correct, loss = 0, 0.0
    for s in range(0, len(y), 2048):
        xb = torch.from_numpy(np.ascontiguousarray(x[s : s + 2048]))
        if layout == "channels_last":
            xb = xb.contiguous(memory_format=torch.channels_last)
        yb = torch.from_numpy(np.ascontiguousarray(y[s : s + 2048]))
        out = model(xb)
        loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    return correct, loss, len(y)


def median_time(fn, repeats: int) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls after one warm-up call; the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def eval_dataset(size: int):
    w = dataclasses.replace(
        WORKLOADS["cnn"], num_clients=20, mean_samples=10, test_size=size, seed=0
    )
    return make_template_data(w)


def run_eval(size: int, workers_list: list[int], repeats: int) -> dict[str, Any]:
    """Plain loop vs RayWorkerPool.evaluate on k workers; examples/s and ratios."""
    from engine.federated.evaluation import combine_sums

    ds = eval_dataset(size)
    n = len(ds.y_test)
    torch.set_num_threads(1)
    model = build_model("cnn", ds.input_shape, ds.num_classes, rngs.torch_gen(0, rngs.MODEL_INIT))
    out: dict[str, Any] = {"examples": n, "repeats": repeats}
    t, sums = median_time(lambda: plain_eval(model, ds.x_test, ds.y_test, "contiguous"), repeats)
    out["plain"] = {
        "seconds": t,
        "examples_per_s": n / t,
        "sums": list(sums),
        "load": load_average(),
    }
    print(
        f"  plain loop (1 thread, contiguous): {t:.3f} s, {n / t:,.0f} examples/s, "
        f"accuracy {sums[0] / n:.4f}  [load {out['plain']['load']}]",
        flush=True,
    )
    model_cl = model.to(memory_format=torch.channels_last)
    t, sums_cl = median_time(
        lambda: plain_eval(model_cl, ds.x_test, ds.y_test, "channels_last"), repeats
    )
    out["plain_channels_last"] = {"seconds": t, "examples_per_s": n / t, "sums": list(sums_cl)}
    print(
        f"  plain loop (1 thread, channels_last, for reference): {t:.3f} s, "
        f"{n / t:,.0f} examples/s",
        flush=True,
    )
    out["ray"] = []
    for k in workers_list:
        cfg = load_config(
            overrides=[
                "algorithm=dp_fedavg",
                "dataset.name=mnist",
                f"dataset.num_clients={ds.num_clients}",
                "model.name=cnn",
                "privacy.epsilon=null",
                "privacy.noise_multiplier=1.0",
                "ray.executor=ray",
                f"ray.num_workers={k}",
                "ray.num_cpus_per_worker=1",
                "rounds=1",
            ]
        )
        prep = prepare(cfg, ds)
        t_start = time.perf_counter()
        ex = make_executor(prep, run_name=f"evalbench-k{k}")
        start_s = time.perf_counter() - t_start
        try:
            pool, slices = ex.pool, ex.plan.test_slices
            empty = [(0, 0)] * k

            def full(pool=pool, slices=slices) -> list:
                return pool.evaluate(pool.current_weights(), slices)

            def nothing(pool=pool, empty=empty) -> list:
                return pool.evaluate(pool.current_weights(), empty)

            t, parts = median_time(full, repeats)
            t_empty, _ = median_time(nothing, repeats)
        finally:
            ex.close()
        acc, loss = combine_sums(parts)
        row = {
            "workers": k,
            "seconds": t,
            "examples_per_s": n / t,
            "speedup_vs_plain": (n / t) / out["plain"]["examples_per_s"],
            "target_speedup": EVAL_TARGET_FACTOR * k,
            "empty_call_s": t_empty,
            "actor_start_s": start_s,
            "slices": [list(s) for s in slices],
            "correct": int(sum(p[0] for p in parts)),
            "n": int(sum(p[2] for p in parts)),
            "accuracy": acc,
            "loss": loss,
            "load": load_average(),
        }
        row["ratio_to_target"] = row["speedup_vs_plain"] / row["target_speedup"]
        row["status"] = "PASS" if row["ratio_to_target"] >= 1.0 else "MISS"
        out["ray"].append(row)
        print(
            f"  dpfl RayWorkerPool.evaluate, k={k}: {t:.3f} s, {n / t:,.0f} examples/s, "
            f"{row['speedup_vs_plain']:.2f}x plain (target >= {row['target_speedup']:.1f}x: "
            f"{row['status']}, ratio to target {row['ratio_to_target']:.2f}); "
            f"empty-slice call {t_empty * 1000:.0f} ms; accuracy {acc:.4f}  [load {row['load']}]",
            flush=True,
        )
    return out
