"""W1: the tight floor and ``dpfl run`` as whole processes (``python -m benchmarks.bench
--workload w1``), alternately; the phases of each from ``DPFL_TIMELINE`` marks, and
dpfl's CPU seconds by process from spawn to the rounds' start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.dpfl_side import dpfl_overrides
from benchmarks.measure import cpu_until_mark, load_average, read_timeline, timed_process
from benchmarks.reference_loop import run_plain
from benchmarks.streams import DATA, numpy_stream
from benchmarks.workloads import Workload, make_template_data

REPO_ROOT = Path(__file__).resolve().parent.parent


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    """Median of ``key`` over repeats."""
    import statistics

    return float(statistics.median(r[key] for r in runs))


#: W1: the held-out workload of issue 30 (MNIST-shaped images, 500 clients of 34–35
#: examples, all trained on, Poisson q = 0.1, the cnn, 20 rounds, 10,000 test images
#: evaluated once at the end). Both sides run as whole processes from the same IDX
#: files; every figure is whole-process wall time or a phase of it.
W1 = Workload(
    name="w1",
    model="cnn",
    data="idx",
    config_dataset="mnist",
    num_clients=500,
    mean_samples=35,  # 17,250 examples: 250 clients of 35, 250 of 34
    input_shape=(1, 28, 28),
    num_classes=10,
    test_size=10000,
    rate=0.1,
    rounds=20,
    epochs=1,
    batch_size=10,
    lr=0.05,
    clip_norm=1.0,
    noise_multiplier=1.0,
)
W1_TRAIN = 17250


def write_idx(path: Path, array: np.ndarray) -> None:
    """``array`` (uint8) as an IDX file (the MNIST format: magic, dims, bytes)."""
    magic = bytes([0, 0, 8, array.ndim])
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(magic + dims + np.ascontiguousarray(array, np.uint8).tobytes())


def write_w1_files(w: Workload, root: Path, n_train: int = W1_TRAIN) -> Path:
    """MNIST-format files under ``root/MNIST/raw`` holding ``n_train`` training and
    ``w.test_size`` test images of :func:`make_template_data`'s generator, scaled to
    bytes; what ``dataset.name=mnist dataset.root=root`` reads."""
    one = dataclasses.replace(w, data="templates", num_clients=1, mean_samples=n_train)
    ds = make_template_data(one, sizes_given=np.array([n_train]))
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def to_bytes(x: np.ndarray) -> np.ndarray:
        return np.clip(np.rint((x[:, 0] / 6.0 + 0.5) * 255.0), 0, 255).astype(np.uint8)

    write_idx(raw / "train-images-idx3-ubyte", to_bytes(ds.x_train[:n_train]))
    write_idx(raw / "train-labels-idx1-ubyte", ds.y_train[:n_train].astype(np.uint8))
    write_idx(raw / "t10k-images-idx3-ubyte", to_bytes(ds.x_test))
    write_idx(raw / "t10k-labels-idx1-ubyte", ds.y_test.astype(np.uint8))
    return root


def w1_overrides(
    w: Workload, root: Path, workers: int, memory_format: str, executor: str = "ray"
) -> list[str]:
    """``dpfl run --set`` overrides for W1: dpfl's defaults otherwise. Every client's
    examples are trained on: ``dataset.client_test_fraction=0`` explicitly (the
    default holds out a share of each client for personal metrics)."""
    out = dpfl_overrides(w, workers, None, False, memory_format)
    out = [o for o in out if not o.startswith(("dataset.name=", "ray.executor="))]
    return out + [
        f"ray.executor={executor}",
        "dataset.name=mnist",
        f"dataset.root={root}",
        "dataset.partition=iid",
        "dataset.client_test_fraction=0",
    ]


def floor_process(args: argparse.Namespace) -> int:
    """``--floor-process FILE``: the tight floor as a whole process (what the parent
    times from spawn to exit): load W1's files with the engine's reader, run the
    plain loop, write the phase marks (``time.time()``) to FILE."""
    from engine.config import load_config
    from engine.data import build_dataset

    t_imports = time.time()
    w = dataclasses.replace(W1, seed=args.seed, rounds=args.rounds or W1.rounds)
    cfg = load_config(overrides=w1_overrides(w, args.data_root, 2, args.memory_format))
    ds = build_dataset(cfg.dataset, numpy_stream(w.seed, DATA))
    t_data = time.time()
    pr = run_plain(w, ds, torch.device("cpu"), args.memory_format)
    t_end = time.time()
    pr.pop("_batches")
    weights = pr.pop("_weights")
    pr.update(
        imports_done=t_imports,
        data_done=t_data,
        end=t_end,
        data_s=t_data - t_imports,
        client_sizes=[int(ds.client_sizes().min()), int(ds.client_sizes().max())],
        weights_norm=float(np.linalg.norm(weights)),
    )
    args.floor_process.write_text(json.dumps(pr, default=str))
    return 0


def run_w1_floor(args: argparse.Namespace, root: Path, tmp: Path, tag: str) -> dict[str, Any]:
    """One whole-process run of the tight floor; its phases (seconds)."""
    out = tmp / f"floor-{tag}.json"
    cmd = [sys.executable, "-m", "benchmarks.bench", "--floor-process", str(out)]
    cmd += ["--data-root", str(root), "--seed", str(args.seed)]
    cmd += ["--memory-format", args.memory_format]
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    t0, t1, rc, tail = timed_process(cmd, dict(os.environ))
    if rc != 0:
        raise RuntimeError(f"floor process exited {rc}:\n{tail}")
    f = json.loads(out.read_text())
    loop = f["round_loop_s"] - f["eval_s"]
    # the floor's choice of Linear forms is a measurement of the machine, not the loop's
    whole = t1 - t0 - f["linear_probe_s"]
    return {
        "whole_s": whole,
        "round_loop_s": loop,
        "eval_s": f["eval_s"],
        "fixed_s": whole - loop - f["eval_s"],
        "breakdown": {
            "interpreter + imports": f["imports_done"] - t0,
            "data": f["data_s"],
            "model + flat buffers": f["wall_s"] - f["round_loop_s"],
            "exit": t1 - f["end"],
            "(choosing Linear forms, left out)": f["linear_probe_s"],
        },
        "step_ms": f["step_ms"],
        "train_s": f["train_s"],
        "steps": f["steps"],
        "client_updates": f["client_updates"],
        "test_accuracy": f["test_accuracy"],
        "client_sizes": f["client_sizes"],
        "layout": f["layout"],
        "linear_forms": f["linear_forms"],
    }


#: ``--before``: the environment of dpfl's "before" side, the code path the cnn took
#: before its hand-written head (engine.federated.head_training): autograd, one client
#: at a time (``DPFL_DENSE_STEPS=0`` switches every hand-written trainer off).
BEFORE_ENV = {"DPFL_DENSE_STEPS": "0"}


def run_w1_dpfl(
    args: argparse.Namespace,
    root: Path,
    tmp: Path,
    tag: str,
    executor: str = "ray",
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One whole ``dpfl run -q`` process under ``ray.executor=executor`` (with
    ``extra_env`` set); its phases from ``DPFL_TIMELINE``."""
    import pandas as pd

    w = dataclasses.replace(W1, seed=args.seed, rounds=args.rounds or W1.rounds)
    name = executor + ("-before" if extra_env else "")
    timeline = tmp / f"timeline-{name}-{tag}.jsonl"
    out = tmp / f"dpfl-{name}-{tag}"
    exe = Path(sys.executable).with_name("dpfl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "engine.cli"]
    cmd += ["run", "-q", "--out", str(out)]
    for o in w1_overrides(w, root, args.workers, args.memory_format, executor):
        cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(extra_env or {})
    env["DPFL_TIMELINE"] = str(timeline)
    # sampled until a Ray client worker runs its first shard (its title names the
    # method); forked workers keep their parent's title, so sampled to the end
    t0, t1, rc, tail, cpu = cpu_until_mark(
        cmd, env, timeline, "rounds start", stop_title="train_shard" if executor == "ray" else None
    )
    if rc != 0:
        raise RuntimeError(f"dpfl run exited {rc}:\n{tail}")
    m = read_timeline(timeline)
    rows = pd.read_parquet(out / "rounds.parquet")
    first, last = m["rounds start"], m[f"round {w.rounds}"]
    ev = m["eval end"] - m["eval start"]
    loop = last - first - ev
    whole = t1 - t0

    def span(a: str, b: str) -> float:
        return m[b] - m[a] if a in m and b in m else math.nan

    # The driver's path to round 1 is a sequence; Ray starts in its own thread from
    # before the imports (engine.runtime.ray_start), so its span overlaps that path and
    # only what the driver waited for it after "prepared" is on the path.
    # Without Ray (ray.executor=processes) the workers start right after "prepared".
    ray_ready = max(m["prepared"], m["ray.init done"]) if "ray.init done" in m else m["prepared"]
    return {
        "whole_s": whole,
        "round_loop_s": loop,
        "eval_s": ev,
        "fixed_s": whole - loop - ev,
        "start_to_round1_s": m["round 1"] - t0,
        "last_round_to_exit_s": t1 - last,
        "breakdown": {
            "interpreter + imports": m.get("imports done", m["main"]) - t0,
            "config + checks": span("imports done", "privacy start"),
            "sigma calibration": span("privacy start", "privacy done"),
            "data": span("privacy done", "data done"),
            "model + pipeline": span("data done", "prepared"),
            "waiting for ray.init": ray_ready - m["prepared"],
            "workers + server start": m["workers ready"] - ray_ready
            if "workers ready" in m
            else math.nan,
            "until the first round": span("workers ready", "rounds start"),
            "first round": m["round 1"] - first,
            "final evaluation": ev,
            "last round's callbacks": span(f"round {w.rounds}", "closing"),
            "closing actors + ray.shutdown": span("closing", "executor closed"),
            "queued writes + config.json": span("executor closed", "results written"),
            "printing + exit": t1 - m.get("results written", last),
        },
        # not on the path above: Ray's start in its thread, overlapping the imports,
        # the calibration and the data
        "concurrent": {"ray.init (own thread)": span("ray.init start", "ray.init done")},
        "cpu_to_rounds": cpu,
        "marks": {k: v - t0 for k, v in sorted(m.items(), key=lambda kv: kv[1])},
        "client_updates": int(rows["realised_cohort_size_nonprivate"].sum()),
        "test_accuracy": float(rows["test_accuracy"].iloc[-1]),
        "epsilon": float(rows["epsilon"].iloc[-1]),
    }


def w1_main(args: argparse.Namespace) -> int:
    """``--workload w1``: the tight floor and ``dpfl run`` as whole processes,
    alternately ``--repeats`` times; prints the phases and the ratios (medians)."""

    w = dataclasses.replace(W1, seed=args.seed, rounds=args.rounds or W1.rounds)
    print(f"== dpfl benchmark: W1, whole processes ({args.repeats} alternating pair(s)) ==")
    print(
        f"workload: cnn, MNIST-format files of generated images, {w.num_clients} clients of "
        f"34-35 examples (dataset.client_test_fraction=0), Poisson q={w.rate}, "
        f"{w.rounds} rounds, 1 epoch of batch {w.batch_size}, lr {w.lr}, C={w.clip_norm}, "
        f"z={w.noise_multiplier}, {w.test_size} test images at the end; dpfl run -q with "
        f"{args.workers} workers, model.memory_format={args.memory_format}; floor: "
        f"the tight plain loop, 1 thread; load average {load_average()}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="dpfl-w1-"))
    root = write_w1_files(w, tmp / "data")
    floors: list[dict[str, Any]] = []
    # each executor's dpfl runs; with --before also its runs on the former code path
    variants = [(e, None) for e in args.executors]
    if args.before:
        variants += [(e, BEFORE_ENV) for e in args.executors]
    before = " ".join(f"{k}={v}" for k, v in BEFORE_ENV.items())
    labels = {(e, bool(env)): f"{e}, before ({before})" if env else e for e, env in variants}
    dpfls: dict[str, list[dict[str, Any]]] = {labels[e, bool(env)]: [] for e, env in variants}
    for r in range(args.repeats):
        sides = [("floor", lambda *a: run_w1_floor(*a), floors)]
        sides += [
            (
                f"dpfl ({labels[e, bool(env)]})",
                lambda *a, e=e, env=env: run_w1_dpfl(*a, executor=e, extra_env=env),
                dpfls[labels[e, bool(env)]],
            )
            for e, env in variants
        ]
        for side, fn, runs in sides:
            load0 = load_average()
            res = fn(args, root, tmp, f"{r}")
            res["load"] = f"{load0} -> {load_average()}"
            runs.append(res)
            print(
                f"[{r + 1}/{args.repeats}] {side}: whole {res['whole_s']:.2f} s = fixed "
                f"{res['fixed_s']:.2f} + round loop {res['round_loop_s']:.2f} + final "
                f"evaluation {res['eval_s']:.2f}; {res['client_updates']} client updates, "
                f"test_accuracy={res['test_accuracy']:.4f} [load {res['load']}]",
                flush=True,
            )
            print("    " + ", ".join(f"{k} {v:.2f}" for k, v in res["breakdown"].items()))
            cpu = res.get("cpu_to_rounds")
            if cpu and "by_role" in cpu:
                print(
                    f"    CPU from spawn to the rounds' start ({cpu['span_s']:.2f} s): "
                    f"{cpu['total_cpu_s']:.2f} CPU-s in dpfl's processes ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in cpu["by_role"].items())
                    + f"); the machine's cores busy {cpu['machine_busy_core_s']:.2f} of "
                    f"{cpu['machine_core_s']:.2f} core-s"
                )
            if res.get("concurrent"):
                print(
                    "    overlapping the above: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in res["concurrent"].items())
                )
    # whole process: the sweep-speed target (<= 0.58 of the one-thread loop on 2 cores)
    targets = {"whole_s": 0.58, "round_loop_s": 0.55, "eval_s": 0.55}
    names = {
        "whole_s": "whole process",
        "round_loop_s": "round loop",
        "eval_s": "final evaluation",
        "fixed_s": "fixed costs",
    }
    for executor, runs in dpfls.items():
        print(f"\n== W1, ray.executor={executor}, against the tight floor "
              f"(medians of {args.repeats}) ==")  # fmt: skip
        for k, label in names.items():
            f, d = median_of(floors, k), median_of(runs, k)
            tgt = targets.get(k)
            verdict = f" (target <= {tgt}: {'met' if d / f <= tgt else 'missed'})" if tgt else ""
            print(f"{label:18s} floor {f:7.2f} s  dpfl {d:7.2f} s  ratio {d / f:.3f}{verdict}")
        fixed = median_of(runs, "fixed_s")
        print(
            f"dpfl fixed costs: start to round 1 {median_of(runs, 'start_to_round1_s'):.2f} s "
            f"(first round included), last round to exit "
            f"{median_of(runs, 'last_round_to_exit_s'):.2f} s (final evaluation included); "
            f"outside rounds and final evaluation {fixed:.2f} s (target <= 4 s: "
            f"{'met' if fixed <= 4.0 else 'missed'})"
        )
    if args.before:
        print(f"\n== W1, after / before (the same executor; medians of {args.repeats}) ==")
        for e in args.executors:
            new, old = dpfls[labels[e, False]], dpfls[labels[e, True]]
            print(
                f"ray.executor={e}: "
                + ", ".join(
                    f"{names[k]} {median_of(new, k) / median_of(old, k):.3f}"
                    for k in ("whole_s", "round_loop_s")
                )
            )
    print(
        f"floor time per local step {median_of(floors, 'step_ms'):.2f} ms "
        f"({floors[-1]['steps']} steps, layout {floors[-1]['layout']}, Linear forms "
        f"{floors[-1]['linear_forms']}); "
        f"load average at end {load_average()}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"floor": floors, "dpfl": dpfls}, indent=2))
        print(f"json: {args.json}")
    return 0
