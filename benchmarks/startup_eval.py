"""Issue 16: time to first round after Ray is up, and evaluation throughput on k workers.

Usage::

    python -m benchmarks.startup_eval [--quick] [--repeats R] [--eval-size 10000]
        [--workers-list 1,2] [--json FILE]

Ray is started once by this script (``ray.init(address="local", num_cpus=2,
include_dashboard=False)``), its start-up is printed and excluded from every figure.

(a) Time to first round (target: ≤ 3 s after Ray is up). The workload is ``dpfl run``'s
default configuration (Synthetic(1, 1), 1000 clients, MLP, Poisson q = 0.1, 2 client
workers of 1 CPU; the server in the driver, as ``ray.server=auto`` places it on
one node), 2 rounds, nothing written. Measured three
times per repeat:

* ``simulate``, cold and warm: wall time from calling :func:`engine.simulation.simulate`
  until its ``on_round`` callback sees round 1's row (and round 2's, for a steady
  round). Cold: the calibration store (``engine.privacy.calibration_store``, here a
  temporary ``DPFL_CACHE_DIR``) and this process's RDP curves are emptied first, so σ
  is searched, as in the first run of a setting on a machine. Warm: the store holds
  the answer, as in every later run and every trial of a sweep at this ε (the
  accountant still re-checks it).
* the same steps called one by one, as ``simulate`` calls them, for the breakdown:
  ``prepare`` (checks, privacy calibration, building the data set), ``make_executor``
  (``ray.put`` of the data set, starting the worker actors, building the server
  and waiting for their ``ping``), round 1 (``Executor.run_round(0)``) and round 2 (a warm round).

  Actor start is then split further with two probe actors started the same way (one
  fresh Ray worker process each): an empty actor (Ray's process start and actor
  creation), and one that imports ``torch`` and then ``engine.federated.client`` and reports both
  import times from inside the process.

(b) Evaluation on k workers (target: ≥ 0.8·k × the plain loop's examples/s). A
``cnn`` model (bench.py's MNIST-shaped 1×28×28 generated data, ``--eval-size`` test
examples) is evaluated

* by a plain single-thread torch loop in this process (``torch.set_num_threads(1)``,
  contiguous tensors, batches of 2048, the sums ``engine.federated.evaluation.evaluate_sums``
  computes: correct count and summed cross-entropy);
* through the Ray executor's evaluation path for k = 1, 2 workers (1 CPU each):
  ``RayWorkerPool.evaluate(pool.current_weights(), plan.test_slices)`` — exactly what
  ``engine.runtime.executors.play_round`` calls on an evaluation round (the slices are
  ``engine.federated.evaluation.eval_slices``), the weights coming from the server.

Each figure is the median of ``--repeats`` timed calls after one warm-up call. Also
printed: the overhead of one evaluation call on an empty slice (Ray round trip, the
weights fetched from the object store and loaded into the model), and the plain loop
in ``channels_last`` (the layout dpfl's CPU workers use for conv models).

The load average (1/5/15 min) is printed at the start, at the end and with each
figure: the machine may be shared and other load skews every timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import load_average, start_local_ray
from benchmarks.parallel_eval import run_eval
from engine.config import load_config
from engine.simulation import make_executor, prepare, simulate

REPO_ROOT = Path(__file__).resolve().parent.parent

FIRST_ROUND_TARGET_S = 3.0


# --------------------------------------------------------------------------- (a)
def startup_overrides(quick: bool) -> list[str]:
    """``dpfl run``'s defaults, 2 rounds (evaluation at each); smaller with --quick."""
    out = ["rounds=2", "eval.every=1", "ray.executor=ray"]
    if quick:
        out += ["dataset.num_clients=200", "ray.num_workers=1"]
    return out


def empty_calibration_store() -> None:
    """Forget every remembered calibration and RDP curve (this process and the
    benchmark's folder): the next run starts as the first run of a setting does."""
    import shutil

    from engine.privacy import accounting, calibration_store

    accounting.forget_remembered()
    folder = calibration_store.store_dir()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def time_simulate(overrides: list[str], run_name: str) -> dict[str, Any]:
    """Wall time from calling simulate to each round's row (on_round timestamps)."""
    cfg = load_config(overrides=overrides)
    stamps: dict[int, float] = {}

    def on_round(row: dict, executor: Any) -> None:
        stamps[int(row["round"])] = time.perf_counter()

    t0 = time.perf_counter()
    res = simulate(cfg, write=False, progress=False, on_round=on_round, run_name=run_name)
    t_end = time.perf_counter()
    return {
        "first_round_s": stamps[1] - t0,
        "second_round_s": stamps[2] - stamps[1] if 2 in stamps else math.nan,
        "simulate_total_s": t_end - t0,
        "final_accuracy": res.final_accuracy,
        "final_epsilon": res.final_epsilon,
    }


def time_steps(overrides: list[str], run_name: str) -> dict[str, Any]:
    """``simulate``'s steps one by one: prepare, make_executor, round 1, round 2."""
    cfg = load_config(overrides=overrides)
    t0 = time.perf_counter()
    prep = prepare(cfg)
    t1 = time.perf_counter()
    ex = make_executor(prep, run_name=run_name)
    t2 = time.perf_counter()
    try:
        ex.run_round(0)
        t3 = time.perf_counter()
        ex.run_round(1)
        t4 = time.perf_counter()
    finally:
        ex.close()
    return {
        "prepare_s": t1 - t0,
        "actors_s": t2 - t1,
        "round1_s": t3 - t2,
        "round2_s": t4 - t3,
        "to_first_round_s": t3 - t0,
    }


def probe_actor_start() -> dict[str, float]:
    """Start an empty actor, then one importing torch and engine.federated.client (1 CPU each,
    as a client worker is declared); wall times and in-process import times."""
    import ray

    # Defined here, so that they are pickled by value: a worker unpickling them imports
    # nothing of this file (whose module level imports torch and the engine).
    class _Empty:
        def ping(self) -> int:
            return os.getpid()

    class _Importer:
        def __init__(self) -> None:
            import time as _time

            t = _time.perf_counter()
            import torch  # noqa: F401

            self.torch_s = _time.perf_counter() - t
            t = _time.perf_counter()
            import engine.federated.client  # noqa: F401

            self.engine_s = _time.perf_counter() - t

        def times(self) -> tuple[float, float]:
            return self.torch_s, self.engine_s

    t = time.perf_counter()
    a = ray.remote(_Empty).options(num_cpus=1).remote()
    ray.get(a.ping.remote())
    empty = time.perf_counter() - t
    ray.kill(a)
    t = time.perf_counter()
    b = ray.remote(_Importer).options(num_cpus=1).remote()
    torch_s, engine_s = ray.get(b.times.remote())
    importer = time.perf_counter() - t
    ray.kill(b)
    return {
        "empty_actor_s": empty,
        "importer_actor_s": importer,
        "import_torch_s": torch_s,
        "import_engine_client_s": engine_s,
    }


IN_PROCESS_SNIPPET = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import engine.federated.client, engine.federated.server, engine.simulation
t2 = time.perf_counter()
from engine.config import load_config
from engine.simulation import make_executor, prepare
cfg = load_config(overrides=sys.argv[1:] + ["ray.executor=local"])
t3 = time.perf_counter()
prep = prepare(cfg)
t4 = time.perf_counter()
ex = make_executor(prep)
t5 = time.perf_counter()
ex.run_round(0)
t6 = time.perf_counter()
ex.run_round(1)
t7 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "import_engine_s": t2 - t1,
                  "prepare_s": t4 - t3, "executor_s": t5 - t4,
                  "round1_s": t6 - t5, "round2_s": t7 - t6}))
"""


def in_process_breakdown(overrides: list[str]) -> dict[str, float]:
    """The same steps with ``ray.executor=local`` in a fresh Python process: what a
    process pays for imports, ``prepare``, building a server and a client worker
    (the cost each actor pays in its own process) and the first rounds."""
    import subprocess

    ov = [o for o in overrides if not o.startswith("ray.executor=")]
    proc = subprocess.run(
        [sys.executable, "-c", IN_PROCESS_SNIPPET, *ov],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes for CI (< 60 s)")
    p.add_argument("--repeats", type=int, default=None, help="(a) runs and (b) timed calls")
    p.add_argument("--eval-size", type=int, default=None, help="test examples for (b)")
    p.add_argument("--workers-list", default="1,2", help="k for (b), comma-separated")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    a = p.parse_args(argv)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.eval_size = a.eval_size or (1000 if a.quick else 10000)
    a.workers = [int(k) for k in a.workers_list.split(",") if k.strip()]
    if a.repeats < 1 or a.eval_size < 1 or not a.workers or min(a.workers) < 1:
        p.error("--repeats, --eval-size and every k must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    rep: dict[str, Any] = {"quick": args.quick, "load_average_at_start": load_average()}
    print(f"== startup and evaluation benchmark{' (quick)' if args.quick else ''} ==")
    print(
        f"load average (1/5/15 min) at start: {rep['load_average_at_start']}; "
        f"{os.cpu_count()} cores; torch {torch.__version__}, ray {ray.__version__}"
    )
    # The calibration store lives in a temporary folder, emptied for each cold run.
    import tempfile

    os.environ["DPFL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpfl-bench-cache-")
    rep["ray_startup_s"] = start_local_ray(2)
    print(f"ray startup (ray.init, excluded from every figure): {rep['ray_startup_s']:.2f} s")
    try:
        overrides = startup_overrides(args.quick)
        print(f"\n(a) time to first round, config: dpfl run defaults + {overrides}")
        runs = []
        for r in range(args.repeats):
            empty_calibration_store()
            cold = time_simulate(overrides, f"startup-cold{r}")
            s = time_simulate(overrides, f"startup-sim{r}")
            s["cold_first_round_s"] = cold["first_round_s"]
            s["cold_final_epsilon"] = cold["final_epsilon"]
            s["cold_final_accuracy"] = cold["final_accuracy"]
            s.update(time_steps(overrides, f"startup-steps{r}"))
            s["load"] = load_average()
            runs.append(s)
            print(
                f"  [{r + 1}/{args.repeats}] simulate -> round 1 row: cold "
                f"{s['cold_first_round_s']:.2f} s, warm {s['first_round_s']:.2f} s "
                f"(round 2 +{s['second_round_s']:.2f} s); warm steps: prepare "
                f"{s['prepare_s']:.2f} s, "
                f"actor start {s['actors_s']:.2f} s, round 1 {s['round1_s']:.2f} s, "
                f"round 2 {s['round2_s']:.2f} s (sum to round 1 {s['to_first_round_s']:.2f} s)"
                f"  [load {s['load']}]",
                flush=True,
            )
        probe = probe_actor_start()
        probe["load"] = load_average()
        print(
            f"  actor-start probe: empty actor {probe['empty_actor_s']:.2f} s; actor importing "
            f"torch + engine.federated.client "
            f"{probe['importer_actor_s']:.2f} s (inside it: import torch "
            f"{probe['import_torch_s']:.2f} s, import engine.federated.client "
            f"{probe['import_engine_client_s']:.2f} s)  [load {probe['load']}]",
            flush=True,
        )
        fresh = in_process_breakdown(overrides)
        fresh["load"] = load_average()
        print(
            f"  same steps in a fresh process, ray.executor=local: import torch "
            f"{fresh['import_torch_s']:.2f} s, import engine {fresh['import_engine_s']:.2f} s, "
            f"prepare {fresh['prepare_s']:.2f} s, server + client worker "
            f"{fresh['executor_s']:.2f} s, round 1 {fresh['round1_s']:.2f} s, round 2 "
            f"{fresh['round2_s']:.2f} s  [load {fresh['load']}]",
            flush=True,
        )
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "load"}
        ratio = med["first_round_s"] / FIRST_ROUND_TARGET_S
        cold_ratio = med["cold_first_round_s"] / FIRST_ROUND_TARGET_S
        rep["first_round"] = {
            "overrides": overrides,
            "runs": runs,
            "median": med,
            "probe": probe,
            "in_process_fresh": fresh,
            "target_s": FIRST_ROUND_TARGET_S,
            "ratio": ratio,
            "status": "PASS" if ratio <= 1.0 else "MISS",
            "cold_ratio": cold_ratio,
            "cold_status": "PASS" if cold_ratio <= 1.0 else "MISS",
        }
        print(
            f"  median time to first round, warm: {med['first_round_s']:.2f} s = {ratio:.2f} x "
            f"the {FIRST_ROUND_TARGET_S:g} s target: {rep['first_round']['status']}; cold "
            f"(sigma searched): {med['cold_first_round_s']:.2f} s = {cold_ratio:.2f} x: "
            f"{rep['first_round']['cold_status']}"
        )
        print(
            f"\n(b) evaluation, cnn on {args.eval_size} MNIST-shaped examples, median of "
            f"{args.repeats} call(s) after a warm-up"
        )
        rep["evaluation"] = run_eval(args.eval_size, args.workers, args.repeats)
    finally:
        ray.shutdown()
        empty_calibration_store()
    rep["load_average_at_end"] = load_average()
    print("\n== ratios ==")
    fr = rep["first_round"]
    print(
        f"time to first round / {FIRST_ROUND_TARGET_S:g} s: warm {fr['ratio']:.3f} "
        f"({fr['status']}), cold {fr['cold_ratio']:.3f} ({fr['cold_status']})"
    )
    for row in rep["evaluation"]["ray"]:
        print(
            f"eval k={row['workers']}: speed-up {row['speedup_vs_plain']:.3f} / target "
            f"{row['target_speedup']:.1f} = {row['ratio_to_target']:.3f} ({row['status']})"
        )
    print(
        f"load average (1/5/15 min): {rep['load_average_at_start']} at start, "
        f"{rep['load_average_at_end']} at end"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=2, default=str))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
