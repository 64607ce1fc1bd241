"""A CPU sweep of small trials against separate runs and against its trials' own work.

Usage (from the repository root)::

    python -m benchmarks.sweep_speed [--trials 8] [--rounds 30] [--separate 2]
        [--runners processes,tune,driver] [--alone] [--repeats 1] [--json FILE] [--quick]

The workload is ``dpfl run``'s default (synthetic MLP, 1,000 clients, q = 0.1, two
workers) at ``--rounds`` rounds and ε = 4. Every figure is the wall time of a whole
``dpfl`` process, spawned here, with the load average before and after it:

* **separate runs**: ``dpfl run -q --set rounds=R --set privacy.epsilon=4``, run
  ``--separate`` times; their median × ``--trials`` is what ``--trials`` separate runs
  cost (each pays its imports, Ray's start, the data, σ's calibration, its workers);
* **sweeps**: ``dpfl tune -a dp_fedavg --epsilons 4 --num-samples T --set rounds=R
  --runner X`` for each runner X of ``--runners`` (a runner the checkout lacks fails and
  is reported so);
* **the trials' own round loops**: each trial's last row's ``wall_time_s_nonprivate``
  (from its first round's start to its last round's end) in the sweep's Parquet rows,
  summed over trials; divided by the cores it is the least time the rounds alone could
  take. With ``--alone`` the same trials also run back to back in one process of this
  benchmark (``ray.executor=local``, data built once, trial k's hyperparameters and
  seed as the sweep draws them), each round loop timed alone: that sum is the reference
  instead (no other trial beside it);
* **outside the round loops**: a sweep's wall − Σ round loops / (trials at a time), the
  sweep machinery's cost; for ``--runner tune`` Tune's own share is read from its
  ``result.json`` files: from the process's start to the first trial's start, the
  trials' span, and from the last trial's end to the exit.

Printed per runner: its wall time, its ratio to the separate runs (target ≤ 0.35) and
to the round loops / cores (target ≤ 1.3), and whether its rows equal the other
runners' (trial k's every row: the runners run the same trials with the same seeds,
so their rows are bit-identical). With ``--repeats`` the measurements alternate
(separate runs, then each runner, per repeat) and medians are reported.

``PYTHONPATH`` picks the dpfl under test: run with ``PYTHONPATH=<a checkout of main>``
for the figures before a change (a runner that checkout lacks is skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import cpu_model, load_average, timed_command, usable_cores

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_SEPARATE = 0.35
TARGET_LOOPS = 1.3
ALGORITHM = "dp_fedavg"
EPSILON = 4.0


def dpfl_command() -> list[str]:
    exe = Path(sys.executable).with_name("dpfl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "engine.cli"]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def separate_run(tmp: Path, tag: str, rounds: int, extra: list[str]) -> dict[str, Any]:
    cmd = [*dpfl_command(), "run", "-q", "--out", str(tmp / f"run-{tag}")]
    cmd += ["--set", f"rounds={rounds}", "--set", f"privacy.epsilon={EPSILON:g}"]
    for o in extra:
        cmd += ["--set", o]
    res = timed_command(cmd, REPO_ROOT, child_env())
    if res["returncode"] != 0:
        raise RuntimeError(f"dpfl run exited {res['returncode']}:\n{res['output']}")
    import pandas as pd

    rows = pd.read_parquet(tmp / f"run-{tag}" / "rounds.parquet")
    res["round_loop_s"] = float(rows["wall_time_s_nonprivate"].iloc[-1])
    return res


def trial_rows(out: Path) -> Any:
    """The sweep's rows, one frame (``tuning.report.load_rounds`` of the tree under test
    would do; read directly so that any checkout's folder layout of rows works)."""
    import pandas as pd

    files = sorted((out / "rounds").rglob("*.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def tune_span(out: Path) -> dict[str, float] | None:
    """First trial's start and last trial's end (time.time()) from Tune's result.json."""
    starts, ends = [], []
    for path in (out / "tune").glob("*/*/result.json"):
        lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
        if lines:
            end = float(lines[-1]["timestamp"])
            starts.append(end - float(lines[-1]["time_total_s"]))
            ends.append(end)
    if not starts:
        return None
    busy = sum(e - s for s, e in zip(starts, ends))
    return {"first_start": min(starts), "last_end": max(ends), "busy_s": busy}


def sweep(
    tmp: Path, tag: str, runner: str, trials: int, rounds: int, extra: list[str]
) -> dict[str, Any]:
    out = tmp / f"sweep-{runner}-{tag}"
    cmd = [*dpfl_command(), "tune", "-a", ALGORITHM, "--epsilons", f"{EPSILON:g}"]
    cmd += ["--num-samples", str(trials), "--set", f"rounds={rounds}", "--out", str(out)]
    cmd += ["--runner", runner]
    for o in extra:
        cmd += ["--set", o]
    t_spawn = time.time()
    res = timed_command(cmd, REPO_ROOT, child_env())
    t_exit = t_spawn + res["wall_s"]
    if res["returncode"] != 0:
        res["error"] = res["output"].strip().splitlines()[-1] if res["output"].strip() else "?"
        return res
    rows = trial_rows(out)
    last = rows.sort_values("round").groupby("trial_index").tail(1).set_index("trial_index")
    res["trials_done"] = int(len(last))
    res["loops_s"] = float(last["wall_time_s_nonprivate"].sum())
    res["rows"] = rows.sort_values(["trial_index", "round"])[
        ["trial_index", "round", "epsilon", "test_accuracy", "train_loss_nonprivate"]
    ].reset_index(drop=True)
    span = tune_span(out) if runner == "tune" else None
    if span is not None:
        res["tune"] = {
            "before_first_trial_s": span["first_start"] - t_spawn,
            "trials_span_s": span["last_end"] - span["first_start"],
            "after_last_trial_s": t_exit - span["last_end"],
            "trials_busy_s": span["busy_s"],
            "at_once": span["busy_s"] / max(span["last_end"] - span["first_start"], 1e-9),
        }
    return res


def alone_loops(trials: int, rounds: int, extra: list[str]) -> dict[str, Any]:
    """The sweep's trials back to back in this process, in-process executor; each
    trial's round loop (its last row's ``wall_time_s_nonprivate``)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import zlib

    from engine.config import config_from_dict, load_config, replace, with_algorithm
    from engine.data import build_dataset
    from engine.privacy import rng as rngs
    from engine.simulation import simulate
    from tuning.spaces import sample, space_for
    from tuning.trial import TUNE_STREAM, trial_seed

    base = load_config(overrides=[f"rounds={rounds}", *extra]).to_dict()
    config0 = config_from_dict(base)
    space = space_for(ALGORITHM, None, config0.recipe)
    key = zlib.crc32(f"{ALGORITHM}|{EPSILON:g}".encode())
    dataset = build_dataset(config0.dataset, rngs.numpy_rng(config0.seed, rngs.DATA))
    loops, cpus = [], []
    load0 = load_average()
    for k in range(trials):
        hps = sample(space, rngs.numpy_rng(base["seed"], TUNE_STREAM, key, k))
        config = with_algorithm(
            config0, ALGORITHM, **{"privacy.epsilon": EPSILON, "privacy.noise_multiplier": None},
            **hps,
        )  # fmt: skip
        seed = trial_seed(int(base["seed"]), ALGORITHM, EPSILON, k)
        config = replace(config, seed=seed, **{"ray.executor": "local"})
        cpu0 = time.process_time()
        res = simulate(config, write=False, dataset=dataset)
        cpus.append(time.process_time() - cpu0)
        loops.append(float(res.rounds["wall_time_s_nonprivate"].iloc[-1]))
    return {
        "loops": loops,
        "sum_s": sum(loops),
        "cpu_s": sum(cpus),
        "load": f"{load0} -> {load_average()}",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--separate", type=int, default=2, help="separate runs timed (median x trials)")
    p.add_argument("--runners", default="processes,tune,driver")
    p.add_argument("--alone", action="store_true", help="time the trials' round loops alone too")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="2 trials of 3 rounds, 200 clients (CI)")
    p.add_argument("--set", action="append", default=[], help="extra config override (all runs)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.trials, a.rounds, a.separate = 2, 3, 1
        a.set = ["dataset.num_clients=200", *a.set]
    a.runners = [r for r in a.runners.split(",") if r]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cores = usable_cores()
    print(f"== sweep of {a.trials} trials x {a.rounds} rounds against separate runs ==")
    print(
        f"machine: {cpu_model()}, {cores} usable cores; dpfl from "
        f"{os.environ.get('PYTHONPATH') or 'the installed package'}; load average "
        f"{load_average()}; overrides {a.set or 'none'}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="dpfl-sweep-speed-"))
    separate: list[dict[str, Any]] = []
    sweeps: dict[str, list[dict[str, Any]]] = {r: [] for r in a.runners}
    for rep in range(a.repeats):
        for s in range(a.separate):
            res = separate_run(tmp, f"{rep}-{s}", a.rounds, a.set)
            separate.append(res)
            print(
                f"[{rep + 1}] separate run {s + 1}: {res['wall_s']:.2f} s, {res['cpu_s']:.1f} "
                f"CPU-s (round loop {res['round_loop_s']:.2f} s)  [load {res['load']}]",
                flush=True,
            )
        for runner in a.runners:
            res = sweep(tmp, str(rep), runner, a.trials, a.rounds, a.set)
            sweeps[runner].append(res)
            if "error" in res:
                print(f"[{rep + 1}] --runner {runner}: failed ({res['error']})", flush=True)
                continue
            print(
                f"[{rep + 1}] --runner {runner}: {res['wall_s']:.2f} s, {res['cpu_s']:.1f} CPU-s, "
                f"{res['trials_done']} trials, their round loops sum to {res['loops_s']:.2f} s"
                f"  [load {res['load']}]",
                flush=True,
            )
    alone = alone_loops(a.trials, a.rounds, a.set) if a.alone else None
    if alone is not None:
        print(
            f"the trials alone, back to back in one process: round loops sum to "
            f"{alone['sum_s']:.2f} s ({', '.join(f'{x:.2f}' for x in alone['loops'])}), "
            f"{alone['cpu_s']:.1f} CPU-s in all  [load {alone['load']}]"
        )
    sep = statistics.median(r["wall_s"] for r in separate) * a.trials
    sep_cpu = statistics.median(r["cpu_s"] for r in separate) * a.trials
    print(
        f"\n{a.trials} separate runs: {sep:.2f} s, {sep_cpu:.1f} CPU-s (median of "
        f"{len(separate)} x {a.trials}; a run's round loop "
        f"{statistics.median(r['round_loop_s'] for r in separate):.2f} s)"
    )
    ok = {r: [x for x in runs if "error" not in x] for r, runs in sweeps.items()}
    ref_name, ref_loops = "", math.nan
    if alone is not None:
        ref_name, ref_loops = "alone", alone["sum_s"]
    elif ok.get("processes"):
        ref_name = "in the processes runner's sweep"
        ref_loops = statistics.median(x["loops_s"] for x in ok["processes"])
    elif ok.get("driver"):
        ref_name = "in the driver runner's sweep"
        ref_loops = statistics.median(x["loops_s"] for x in ok["driver"])
    floor = ref_loops / cores
    print(
        f"the trials' round loops ({ref_name}): {ref_loops:.2f} s, / {cores} cores = {floor:.2f} s"
    )
    summary: dict[str, Any] = {
        "separate_s": sep,
        "separate_cpu_s": sep_cpu,
        "loops_s": ref_loops,
        "cores": cores,
    }
    if alone is not None:
        summary["alone_cpu_s"] = alone["cpu_s"]
        print(
            f"CPU-s: the trials alone {alone['cpu_s']:.1f} (the least a sweep can use), "
            f"{a.trials} separate runs {sep_cpu:.1f}"
        )
    best = None
    print(
        f"{'runner':10s} {'wall':>8s} {'/ separate':>11s} {'/ loops/cores':>14s} "
        f"{'CPU-s':>8s} {'/ separate':>11s}  outside loops"
    )
    for runner, runs in ok.items():
        if not runs:
            print(f"{runner:10s} failed: {sweeps[runner][0].get('error')}")
            continue
        wall = statistics.median(x["wall_s"] for x in runs)
        cpu = statistics.median(x["cpu_s"] for x in runs)
        own = statistics.median(x["loops_s"] for x in runs)
        at_once = 1 if runner == "driver" else min(cores, a.trials)
        if runner == "tune" and runs[-1].get("tune"):
            at_once = runs[-1]["tune"]["at_once"]
        outside = wall - own / at_once
        r_sep, r_loop = wall / sep, wall / floor
        summary[runner] = {
            "wall_s": wall,
            "vs_separate": r_sep,
            "vs_loops": r_loop,
            "cpu_s": cpu,
            "cpu_vs_separate": cpu / sep_cpu,
        }
        print(
            f"{runner:10s} {wall:7.2f}s {r_sep:10.3f}x {r_loop:13.3f}x {cpu:8.1f} "
            f"{cpu / sep_cpu:10.3f}x  {outside:.2f} s (its own round loops {own:.2f} s, "
            f"{at_once:.2f} trials at a time)"
        )
        if runner == "tune" and runs[-1].get("tune"):
            t = runs[-1]["tune"]
            print(
                f"{'':10s} Tune: {t['before_first_trial_s']:.2f} s from spawn to the first "
                f"trial's start, trials' span {t['trials_span_s']:.2f} s, "
                f"{t['after_last_trial_s']:.2f} s from the last trial's end to exit; trials "
                f"busy {t['trials_busy_s']:.2f} s beyond their round loops' {own:.2f} s"
            )
        if best is None or wall < summary[best]["wall_s"]:
            best = runner
    rows = {r: runs[-1]["rows"] for r, runs in ok.items() if runs}
    names = list(rows)
    for other in names[1:]:
        same = rows[names[0]].equals(rows[other])
        print(f"rows of --runner {other} equal to --runner {names[0]}'s: {same}")
    if best is not None:
        v = summary[best]
        print(
            f"fastest: --runner {best}: {v['vs_separate']:.3f}x separate runs (target <= "
            f"{TARGET_SEPARATE}: {'met' if v['vs_separate'] <= TARGET_SEPARATE else 'missed'}), "
            f"{v['vs_loops']:.3f}x the round loops / cores (target <= {TARGET_LOOPS}: "
            f"{'met' if v['vs_loops'] <= TARGET_LOOPS else 'missed'})"
        )
    print(f"load average at end: {load_average()}")
    if a.json is not None:
        a.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
