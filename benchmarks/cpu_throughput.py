"""Client updates per second of a small model on the CPU: dense steps on and off.

Usage (from the repository root)::

    python -m benchmarks.cpu_throughput [--rounds 100] [--repeats 2] [--phase-rounds 8]
        [--json FILE] [--quick]

The workload is Fashion-MNIST (the real files, ``dataset.root`` default
``/usr/share/datasets/fashion-mnist``) with the MLP (199k parameters), 1,000 IID
clients of 60 images, Poisson q = 0.05, one local epoch of B = 10, DP-FedAvg at
``dpfl run``'s defaults otherwise (2 client workers, ε = the default budget,
evaluation every 5 rounds)::

    dpfl run -q --set dataset.name=fashion_mnist --set model.name=mlp
        --set dataset.num_clients=1000 --set sampling.rate=0.05 --set local.epochs=1
        --set local.batch_size=10 --set rounds=100

Each side is that whole command, spawned here, ``--repeats`` times, the two sides
alternating: **after** as the checkout runs it, **before** with ``DPFL_DENSE_STEPS=0``
(dense models trained through autograd and the trainer chosen as before
:mod:`engine.federated.dense_training`: the code path of the commit before it). A
checkout without dense steps ignores the variable, and both sides are then the same
code. Printed per run: client updates, the round loop's seconds (the last row's
``wall_time_s_nonprivate``), updates/s over the round loop and over the whole
process, final test accuracy, and the load average; then the medians and the ratio
after / before, and the largest difference of the two sides' final test accuracy.

Then a per-phase table of ``--phase-rounds`` rounds of the same workload, each side in
this process (``benchmarks/round_phases.py``'s recorder, the Ray executor with its two
workers): where a round's time goes, before and after. The two in-process runs' final
models are compared (relative L2 difference: float rounding only, the same clients,
batches, clipping and noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.measure import cpu_model, load_average, timed_command, usable_cores

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = [
    "dataset.name=fashion_mnist",
    "model.name=mlp",
    "dataset.num_clients=1000",
    "sampling.rate=0.05",
    "local.epochs=1",
    "local.batch_size=10",
]
SWITCH = "DPFL_DENSE_STEPS"  # engine.federated.dense_steps.ENV
TARGET = 2.0


def dpfl_run(tmp: Path, tag: str, sets: list[str], dense: bool) -> dict[str, Any]:
    import pandas as pd

    exe = Path(sys.executable).with_name("dpfl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "engine.cli"]
    out = tmp / f"run-{tag}"
    cmd += ["run", "-q", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env[SWITCH] = "1" if dense else "0"
    res = timed_command(cmd, REPO_ROOT, env)
    if res["returncode"] != 0:
        raise RuntimeError(f"dpfl run exited {res['returncode']}:\n{res['output']}")
    rows = pd.read_parquet(out / "rounds.parquet")
    updates = int(rows["realised_cohort_size_nonprivate"].sum())
    loop = float(rows["wall_time_s_nonprivate"].iloc[-1])
    acc = rows["test_accuracy"].dropna()
    res.update(
        updates=updates,
        loop_s=loop,
        per_s_loop=updates / loop,
        per_s_whole=updates / res["wall_s"],
        accuracy=float(acc.iloc[-1]) if len(acc) else float("nan"),
    )
    return res


def phase_tables(rounds: int, sets: list[str]) -> dict[str, Any]:
    """Per-phase tables of both sides in this process; their final models compared."""
    import numpy as np
    import ray

    from benchmarks import round_phases

    results = {}
    for side, dense in (("before", False), ("after", True)):
        os.environ[SWITCH] = "1" if dense else "0"  # before ray.init: the workers inherit it
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            over = [*sets, f"rounds={rounds}", "ray.executor=ray"]
            rec, wall, result = round_phases.run(None, None, "ray", 2, False, "background", over)
            round_phases.report(f"fashion_mnist mlp, {side} ({SWITCH}={int(dense)})", rec, wall)
            results[side] = result
        finally:
            os.environ.pop(SWITCH, None)
            ray.shutdown()
    a, b = (np.asarray(results[s].weights, dtype=np.float64) for s in ("before", "after"))
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
    return {
        "weights_rel_diff": rel,
        "accuracy": {s: results[s].final_accuracy for s in results},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--phase-rounds", type=int, default=8, help="0: no per-phase tables")
    p.add_argument("--quick", action="store_true", help="10 rounds, 1 repeat, 3 phase rounds")
    p.add_argument("--set", action="append", default=[], help="extra override (both sides)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.repeats, a.phase_rounds = 10, 1, 3
    sets = [*WORKLOAD, f"rounds={a.rounds}", *a.set]
    print("== CPU throughput: Fashion-MNIST MLP, dense steps off (before) and on (after) ==")
    print(
        f"machine: {cpu_model()}, {usable_cores()} usable cores; dpfl from "
        f"{os.environ.get('PYTHONPATH') or 'the installed package'}; load average "
        f"{load_average()}\ndpfl run -q --set " + " --set ".join(sets)
    )
    tmp = Path(tempfile.mkdtemp(prefix="dpfl-cpu-throughput-"))
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for r in range(a.repeats):
        for side, dense in (("before", False), ("after", True)):
            res = dpfl_run(tmp, f"{side}-{r}", sets, dense)
            runs[side].append(res)
            print(
                f"[{r + 1}/{a.repeats}] {side:6s}: {res['updates']} client updates; round loop "
                f"{res['loop_s']:.2f} s = {res['per_s_loop']:.0f}/s; whole process "
                f"{res['wall_s']:.2f} s = {res['per_s_whole']:.0f}/s; test_accuracy "
                f"{res['accuracy']:.4f}  [load {res['load']}]",
                flush=True,
            )
    med = {
        s: {k: statistics.median(x[k] for x in runs[s]) for k in ("per_s_loop", "per_s_whole")}
        for s in runs
    }
    loop_ratio = med["after"]["per_s_loop"] / med["before"]["per_s_loop"]
    whole_ratio = med["after"]["per_s_whole"] / med["before"]["per_s_whole"]
    acc_diff = max(
        abs(x["accuracy"] - y["accuracy"]) for x, y in zip(runs["before"], runs["after"])
    )
    print(
        f"\nclient updates/s (medians): round loop {med['before']['per_s_loop']:.0f} -> "
        f"{med['after']['per_s_loop']:.0f} = {loop_ratio:.2f}x (target >= {TARGET}: "
        f"{'met' if loop_ratio >= TARGET else 'missed'}); whole process "
        f"{med['before']['per_s_whole']:.0f} -> {med['after']['per_s_whole']:.0f} = "
        f"{whole_ratio:.2f}x; final test accuracy differs by at most {acc_diff:.4f}"
    )
    summary: dict[str, Any] = {"medians": med, "loop_ratio": loop_ratio, "whole_ratio": whole_ratio}
    if a.phase_rounds:
        phases = phase_tables(a.phase_rounds, [s for s in sets if not s.startswith("rounds=")])
        summary["phases"] = phases
        print(
            f"\nin-process runs of {a.phase_rounds} rounds: final models differ by "
            f"{phases['weights_rel_diff']:.2e} (relative L2); test accuracy "
            f"{phases['accuracy']}"
        )
    print(f"load average at end: {load_average()}")
    if a.json is not None:
        a.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
