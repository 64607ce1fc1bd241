"""Benchmark dpfl against a plain single-process PyTorch DP-FedAvg loop on one workload.

Usage::

    python -m benchmarks.bench [--workload cnn|logreg|resnet18_gn] [--rounds N]
        [--workers 2] [--clients-per-batch K] [--repeats R] [--quick] [--json FILE]
        [--num-clients N] [--mean-samples S] [--test-size T]

Issue 16's CNN target (500 clients of ~35 examples, 10,000 test images, 2 workers)::

    python -m benchmarks.bench --workload cnn --mean-samples 35 --test-size 10000

One invocation runs the same workload twice — once through dpfl (``simulate`` with the
Ray executor: ``--workers`` client-worker actors of one CPU each plus the server actor)
and once through the plain loop of :mod:`benchmarks.reference_loop` (one process,
one torch thread) —
and prints wall time, round-loop time, client updates per second, peak memory
(``VmHWM`` of the driver and of every Ray actor process) and final test accuracy of
each, the ratio dpfl / plain, and PASS/MISS against the targets "cnn on 2 CPU
workers: dpfl ≤ 0.75 × plain" and "≤ 0.6 × with dpfl's own speed-ups" (the issue names
vectorised clients and parallel evaluation; for the cnn on a CPU the gain comes from
balanced shards, the ``channels_last`` layout and the lighter clip instead, so the
verdict is printed with the configuration used). dpfl runs with
``model.memory_format=--memory-format`` (default ``auto``), the plain loop in the same
layout (``auto``: ``channels_last`` for convolutions on the CPU, the faster there).
With ``--repeats R`` the two sides run alternately R times and the medians are
reported.

The plain loop is a tight floor (issue 30): the data as tensors once, one model
reused, parameters as views of one flat vector (in-place SGD,
the clip on a flat update, no per-client allocations), batched evaluation under
``no_grad``. It prints its time per local step next to a minimal
forward/backward/update loop's on the same minibatches (its first
``--minimal-rounds`` rounds), and its time outside training. ``--workload w1`` times
the floor and ``dpfl run`` as whole processes (see :func:`benchmarks.w1.w1_main`), and prints, for
each dpfl run, the CPU seconds its processes used from spawn to the rounds' start, by
role (driver, client workers, Ray's dashboard, agents, monitors, GCS and raylet),
next to the machine's busy core-seconds over that span
(:func:`benchmarks.measure.cpu_until_mark`): a start whose cores are busy throughout
can only get shorter by doing less.

The reference loop and what it shares with the engine: :mod:`benchmarks.reference_loop`;
the workloads: :mod:`benchmarks.workloads`; W1: :mod:`benchmarks.w1`.

What is measured
----------------
* ``wall``: plain — model build, all rounds, final evaluation; dpfl — the whole
  ``simulate(...)`` call (checks, ``ray.put`` of the dataset, starting the worker and
  server actors, all rounds, final evaluation, shutting the actors down). Starting Ray
  itself (``ray.init(address="local", num_cpus=max(2, W), include_dashboard=False)``,
  once per invocation) is in neither and is printed as ``ray startup``.
* ``round loop``: plain — the rounds and the final evaluation; dpfl — the last
  round's ``wall_time_s_nonprivate`` (from the first round's start to the end of the last round,
  evaluation included).
* ``time per local step``: plain — the time inside its local-step loops over the
  number of steps; the minimal loop's on the same batches (gathered before its clock);
  ``outside training`` = plain wall − that time.
* ``ratio`` = dpfl wall / plain wall (the PASS/MISS basis); the round-loop ratio is
  printed too. ``client updates/s`` = trained clients / wall (and / round loop).
* Peak memory: ``VmHWM`` from ``/proc/<pid>/status``. The driver's high-water mark is
  reset (``/proc/self/clear_refs``) before each side, so the plain figure is the plain
  loop's peak in the driver and the dpfl figures are sampled in ``simulate``'s
  ``on_round`` callback at the last round, for the driver and for each actor of the
  run (PIDs from ``ray.util.state.list_actors`` when the dashboard's API server
  runs — it does not here —, else from the GCS actor table, else from the actors).
  Each process's figure includes the ~0.8 GiB of imported libraries (torch, Ray).
* Timings are wall-clock on a possibly shared machine: the load average at start and
  end is printed; use ``--repeats`` (alternating sides, medians) to smooth noise.
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
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.dpfl_side import dpfl_overrides, run_dpfl
from benchmarks.measure import fmt, hardware, load_average, start_local_ray
from benchmarks.reference_loop import minimal_loop, run_plain
from benchmarks.w1 import floor_process, w1_main
from benchmarks.workloads import RESNET_CPU, WORKLOADS, make_dataset, quick_variant
from engine.models import build_model

ACCURACY_TOLERANCE = 0.03
TARGET_RATIO = 0.75  # cnn on 2 CPU workers
TARGET_RATIO_VECTORISED = 0.6  # ... with dpfl's own speed-ups (issue: vectorised clients and
# parallel evaluation; on a CPU the cnn gains from its memory format, not from vmap)


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    """Median of ``key`` over repeats."""
    return float(statistics.median(r[key] for r in runs))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats plus the last repeat's non-timing fields (no arrays)."""
    out = {k: v for k, v in runs[-1].items() if not k.startswith("_")}
    out["wall_s"] = median_of(runs, "wall_s")
    out["round_loop_s"] = median_of(runs, "round_loop_s")
    out["updates_per_s"] = out["client_updates"] / out["wall_s"]
    out["updates_per_s_round_loop"] = out["client_updates"] / out["round_loop_s"]
    out["repeats"] = [{k: r[k] for k in ("wall_s", "round_loop_s", "test_accuracy")} for r in runs]
    return out


def print_report(rep: dict[str, Any]) -> None:
    """The final table, ratios and target verdicts."""
    p, d = rep.get("plain"), rep.get("dpfl")
    print(f"\n== results (medians over {rep['repeats']} repeat(s)) ==")
    print(f"{'':28s} {'plain (1 thread)':>18s} {'dpfl (Ray)':>18s}")

    def line(label: str, key: str, spec: str = ".2f") -> None:
        a = fmt(p.get(key) if p else None, spec)
        b = fmt(d.get(key) if d else None, spec)
        print(f"{label:28s} {a:>18s} {b:>18s}")

    line("wall time (s)", "wall_s")
    line("round loop (s)", "round_loop_s")
    line("client updates", "client_updates", "d")
    line("client updates/s (wall)", "updates_per_s")
    line("client updates/s (loop)", "updates_per_s_round_loop")
    line("final test accuracy", "test_accuracy", ".4f")
    eps = "-"
    if d:
        eps = f"{d['epsilon']:.4f}"
    print(f"{'epsilon (dpfl accountant)':28s} {'not accounted':>18s} {eps:>18s}")
    if d:
        print(f"  (dpfl: {d['accountant']} accountant, delta={d['delta']:.3g}; from dpfl only)")
    if p and "minimal_step_ms" in p:
        print(
            f"plain loop (tight floor, {p['layout']}, Linear forms {p['linear_forms']}): "
            f"{p['step_ms']:.2f} ms per local step "
            f"over {p['steps']} steps; on the {p['minimal_steps']} steps of its first rounds "
            f"{p['same_batches_step_ms']:.2f} ms against the minimal loop's "
            f"{p['minimal_step_ms']:.2f} ms (ratio "
            f"{p['same_batches_step_ms'] / p['minimal_step_ms']:.3f}; in CPU time "
            f"{p['same_batches_step_cpu_ms'] / p['minimal_step_cpu_ms']:.3f}, the basis "
            f"on a loaded machine); outside training "
            f"{p['outside_training_s']:.2f} s of {p['wall_s']:.2f} s (last repeat)"
        )
    print(f"ray startup (ray.init, in neither wall time): {rep['ray_startup_s']:.2f} s")
    print(
        f"load average (1/5/15 min): {rep['hardware']['load_average_at_start']} at start, "
        f"{rep['load_average_at_end']} at end"
    )
    print("peak memory, VmHWM (MiB), sampled at the end of each side:")
    if p:
        for name, v in p["peak_rss_mb"].items():
            print(f"  plain  {name:34s} {fmt(v, '.0f'):>8s}")
    if d:
        for name, v in d["peak_rss_mb"].items():
            pid = d["pids"].get(name, "")
            print(f"  dpfl   {name:34s} {fmt(v, '.0f'):>8s}   pid {pid}")
        print(
            f"  (actor pids from: {d['pid_source']}; dpfl workers trained on: "
            f"{d['worker_device']}; server in: {d['server_placement']}; "
            f"plain on: {p['device'] if p else '-'})"
        )
    if rep.get("ratio") is not None:
        r, rl = rep["ratio"], rep["round_loop_ratio"]
        print(f"ratio dpfl/plain: wall {r:.3f}, round loop {rl:.3f}")
    if rep.get("accuracy_diff") is not None:
        flag = "OK" if rep["accuracy_agree"] else "FLAG: DISAGREE"
        print(
            f"accuracy difference dpfl - plain: {rep['accuracy_diff']:+.4f} "
            f"(|diff| <= {ACCURACY_TOLERANCE}: {flag})"
        )
    if rep.get("final_weights_rel_diff") is not None:
        print(
            f"final models: ||w_dpfl - w_plain|| / ||w_plain|| = "
            f"{rep['final_weights_rel_diff']:.2e}; mean client update norm (non-private): "
            f"plain {p['mean_update_norm']:.4f}, dpfl {d['mean_update_norm']:.4f}"
        )
    if rep.get("same_client_updates") is False:
        print("WARNING: the two sides trained different numbers of client updates")
    for t in rep.get("targets", []):
        print(
            f"target {t['name']}: dpfl <= {t['target']} x plain (wall): "
            f"{t['status']} (ratio {t['ratio']:.3f})"
        )
    for e in rep.get("errors", []):
        print(f"ERROR: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workload",
        choices=[*sorted(WORKLOADS), "w1"],
        default="cnn",
        help="w1: the tight floor and dpfl run as whole processes (issue 30's W1 shape)",
    )
    p.add_argument("--rounds", type=int, default=None, help="override the workload's rounds")
    p.add_argument("--num-clients", type=int, default=None, help="override N")
    p.add_argument(
        "--mean-samples",
        type=int,
        default=None,
        help="override the mean training examples per client (issue 16's cnn target: 35)",
    )
    p.add_argument(
        "--test-size", type=int, default=None, help="override the global test set's size"
    )
    p.add_argument("--workers", type=int, default=2, help="dpfl client-worker actors")
    p.add_argument(
        "--executors",
        default="ray",
        help="w1: the ray.executor values dpfl runs under, each against the same floor "
        "runs (e.g. ray,processes)",
    )
    p.add_argument(
        "--before",
        action="store_true",
        help="w1: also run dpfl on the former code path (DPFL_DENSE_STEPS=0: the cnn "
        "through autograd, one client at a time), alternating, and print after / before",
    )
    p.add_argument(
        "--clients-per-batch", type=int, default=None, help="ray.clients_per_worker_batch"
    )
    p.add_argument(
        "--memory-format",
        choices=["auto", "contiguous", "channels_last"],
        default="auto",
        help="dpfl's model.memory_format; the plain loop uses the same layout (auto: "
        "channels_last for convolutions on the CPU, the faster one there)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--minimal-rounds",
        type=int,
        default=2,
        help="replay the plain loop's minibatches of its first N rounds in the minimal "
        "loop and compare their time per local step",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes for CI (< 60 s)")
    p.add_argument("--json", type=Path, default=None, help="write every measured number here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--floor-process", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-root", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.workers < 1 or (a.rounds is not None and a.rounds < 1):
        p.error("--repeats, --workers and --rounds must be >= 1")
    a.executors = [e.strip() for e in a.executors.split(",") if e.strip()]
    if not a.executors or set(a.executors) - {"ray", "processes", "local"}:
        p.error(f"--executors {a.executors}: give ray, processes and/or local")
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the exit status (0 ok, 1 a side failed or accuracies disagree)."""
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.floor_process is not None:
        return floor_process(args)
    if args.workload == "w1":
        return w1_main(args)
    import ray

    w = WORKLOADS[args.workload]
    use_cuda = w.gpu and torch.cuda.is_available()
    if w.gpu and not use_cuda:
        w = dataclasses.replace(w, **RESNET_CPU)
    if args.quick:
        w = quick_variant(w)
    changes: dict[str, Any] = {"seed": args.seed}
    if args.rounds is not None:
        changes["rounds"] = args.rounds
    if args.num_clients is not None:
        changes["num_clients"] = args.num_clients
    if args.mean_samples is not None:
        changes["mean_samples"] = args.mean_samples
    if args.test_size is not None:
        changes["test_size"] = args.test_size
    w = dataclasses.replace(w, **changes)
    device = torch.device("cuda" if use_cuda else "cpu")
    hw = hardware()
    probe = build_model(w.model, w.input_shape, w.num_classes, torch.Generator().manual_seed(0))
    has_conv = any(isinstance(m, nn.Conv2d) for m in probe.modules())
    fmt_used = args.memory_format
    if (
        fmt_used == "auto"
    ):  # the engine's rule (engine.federated.worker_model.resolve_memory_format)
        fmt_used = "channels_last" if has_conv and device.type == "cpu" else "contiguous"
    print(f"== dpfl benchmark: workload {w.name}{' (quick)' if args.quick else ''} ==")
    gpu = hw["gpu"] or "none"
    print(
        f"hardware: CPU {hw['cpu']} ({hw['cores']} cores, {hw['usable_cores']} usable), "
        f"GPU {gpu}; torch {hw['torch']}, ray {hw['ray']}, python {hw['python']}; "
        f"load average {hw['load_average_at_start']}"
    )
    print(
        f"workload: model={w.model} data={w.data} {w.input_shape} N={w.num_clients} "
        f"~{w.mean_samples}/client, Poisson q={w.rate} (expected cohort "
        f"{w.rate * w.num_clients:g}), rounds={w.rounds}, local epochs={w.epochs} "
        f"batch={w.batch_size} lr={w.lr}, C={w.clip_norm}, z={w.noise_multiplier}, "
        f"eval at the end; dpfl workers={args.workers} x 1 CPU, "
        f"clients_per_worker_batch={args.clients_per_batch}, "
        f"model.memory_format={args.memory_format} ({fmt_used} here); "
        f"plain: 1 thread on {device}, {fmt_used}"
    )
    t = time.perf_counter()
    ds = make_dataset(w)
    n_train = int(sum(len(c) for c in ds.client_train))
    print(
        f"data: {n_train} training examples over {ds.num_clients} clients, "
        f"{len(ds.y_test)} test examples ({time.perf_counter() - t:.1f} s to build)"
    )
    overrides = dpfl_overrides(
        w, args.workers, args.clients_per_batch, use_cuda, args.memory_format
    )
    errors: list[str] = []
    startup = start_local_ray(max(2, args.workers))
    print(f"ray startup: {startup:.2f} s")
    plain_runs: list[dict[str, Any]] = []
    dpfl_runs: list[dict[str, Any]] = []
    try:
        for r in range(args.repeats):
            tag = f"[{r + 1}/{args.repeats}]"
            try:
                pr = run_plain(w, ds, device, fmt_used, record_rounds=args.minimal_rounds)
                replay = pr.pop("_batches")
                k = min(args.minimal_rounds, w.rounds)
                pr["same_batches_step_ms"] = (
                    1e3 * sum(pr["round_train_s"][:k]) / max(1, sum(pr["round_steps"][:k]))
                )
                pr["same_batches_step_cpu_ms"] = (
                    1e3 * sum(pr["round_train_cpu_s"][:k]) / max(1, sum(pr["round_steps"][:k]))
                )
                mw, mc = minimal_loop(w, ds, replay, device, pr["layout"], pr["linear_forms"])
                pr["minimal_step_ms"], pr["minimal_step_cpu_ms"] = 1e3 * mw, 1e3 * mc
                pr["minimal_steps"] = len(replay)
                pr["minimal_load"] = load_average()
                plain_runs.append(pr)
                print(
                    f"{tag} plain: wall {pr['wall_s']:.2f} s, round loop {pr['round_loop_s']:.2f}"
                    f" s, {pr['client_updates']} client updates, {pr['steps']} local steps, "
                    f"test_accuracy={pr['test_accuracy']:.4f} [load {load_average()}]",
                    flush=True,
                )
                print(
                    f"{tag} plain: {pr['step_ms']:.2f} ms per local step over the run; on the "
                    f"{len(replay)} steps of round(s) 1..{k}: plain "
                    f"{pr['same_batches_step_ms']:.2f} ms, minimal loop "
                    f"{pr['minimal_step_ms']:.2f} ms (plain/minimal "
                    f"{pr['same_batches_step_ms'] / pr['minimal_step_ms']:.3f}; CPU time "
                    f"{pr['same_batches_step_cpu_ms']:.2f} / {pr['minimal_step_cpu_ms']:.2f} ms "
                    f"= {pr['same_batches_step_cpu_ms'] / pr['minimal_step_cpu_ms']:.3f}); outside "
                    f"training {pr['outside_training_s']:.2f} s of {pr['wall_s']:.2f} s "
                    f"(final evaluation {pr['eval_s']:.2f} s) [load {pr['minimal_load']}]",
                    flush=True,
                )
            except Exception:  # noqa: BLE001 - report and go on with the other side
                errors.append(f"plain loop failed:\n{traceback.format_exc()}")
            try:
                dr = run_dpfl(w, ds, overrides, run_name=f"bench{r}")
                dpfl_runs.append(dr)
                print(
                    f"{tag} dpfl:  wall {dr['wall_s']:.2f} s, round loop {dr['round_loop_s']:.2f}"
                    f" s, {dr['client_updates']} client updates, "
                    f"test_accuracy={dr['test_accuracy']:.4f}, epsilon={dr['epsilon']:.4f}",
                    flush=True,
                )
            except Exception:  # noqa: BLE001
                errors.append(f"dpfl run failed:\n{traceback.format_exc()}")
    finally:
        ray.shutdown()
    rep: dict[str, Any] = {
        "workload": dataclasses.asdict(w),
        "quick": args.quick,
        "repeats": args.repeats,
        "workers": args.workers,
        "clients_per_batch": args.clients_per_batch,
        "memory_format": args.memory_format,
        "hardware": hw,
        "ray_startup_s": startup,
        "dpfl_overrides": overrides,
        "plain": summarise(plain_runs) if len(plain_runs) == args.repeats else None,
        "dpfl": summarise(dpfl_runs) if len(dpfl_runs) == args.repeats else None,
        "accuracy_tolerance": ACCURACY_TOLERANCE,
        "errors": errors,
    }
    p, d = rep["plain"], rep["dpfl"]
    if p and d:
        rep["ratio"] = d["wall_s"] / p["wall_s"]
        rep["round_loop_ratio"] = d["round_loop_s"] / p["round_loop_s"]
        rep["accuracy_diff"] = d["test_accuracy"] - p["test_accuracy"]
        rep["accuracy_agree"] = bool(abs(rep["accuracy_diff"]) <= ACCURACY_TOLERANCE)
        rep["same_client_updates"] = p["client_updates"] == d["client_updates"]
        wp, wd = plain_runs[-1]["_weights"], dpfl_runs[-1]["_weights"]
        rep["final_weights_rel_diff"] = (
            float(np.linalg.norm(wd.astype(np.float64) - wp) / max(np.linalg.norm(wp), 1e-30))
            if wp.shape == wd.shape
            else math.inf
        )
        targets = []
        if w.name == "cnn":
            targets.append(("cnn on 2 CPU workers", TARGET_RATIO))
            targets.append(
                (
                    "cnn with dpfl's own speed-ups (parallel evaluation, balanced shards, "
                    f"memory format {args.memory_format}, clients_per_worker_batch="
                    f"{args.clients_per_batch})",
                    TARGET_RATIO_VECTORISED,
                )
            )
        rep["targets"] = [
            {
                "name": name,
                "target": tgt,
                "ratio": rep["ratio"],
                "status": "PASS" if rep["ratio"] <= tgt else "MISS",
            }
            for name, tgt in targets
        ]
    rep["load_average_at_end"] = load_average()
    status = 0
    if errors or not (p and d):
        status = 1
    elif not args.quick and not rep["accuracy_agree"]:
        status = 1
    rep["exit_status"] = status
    print_report(rep)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=2, default=str))
        print(f"json: {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
