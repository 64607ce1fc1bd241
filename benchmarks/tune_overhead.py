"""Issue 16: what Ray Tune costs on top of the trials it runs.

Usage::

    python -m benchmarks.tune_overhead [--trials 32] [--quick] [--json FILE]

Target: a sweep of 32 small trials costs ≤ 1.2 × the sum of the same trials run back
to back in one process with the in-process executor (``ray.executor=local``).

The sweep is ``dpfl tune``'s own machinery, :func:`tuning.experiment.run_tune`, with
``--smoke-test`` sizes (2 rounds, 60 Synthetic(1, 1) clients of ~20 examples, the MLP,
one client worker of 0.5 CPU per trial plus the trial's 0.5-CPU head, so two trials run
at a time on 2 cores), ``dp_fedavg`` at ε = 8, random search over its default space,
``--trials`` samples (default 32). Ray is started first by this script
(``ray.init(address="local", num_cpus=2, include_dashboard=False)``) and its start-up
is excluded; the sweep's figure is the wall time of the ``run_tune`` call (Tune's start,
every trial, compaction of the results, the trials table).

The same sweep also runs with ``--runner driver`` (``run_tune(..., runner="driver")``:
the trials one after another in this process, no Ray Tune), timed the same way right
after the baseline, with Ray shut down (its trials need none, and the baseline runs
without it too); the script prints both ratios and which runner was faster, and the
sweep's verdict is the better one's.

The baseline runs the *same* trials — trial k's hyperparameters, drawn by
``tuning.spaces.sample`` from (seed, algorithm, ε, k), its own ``trial_seed``, the data
set built from the experiment seed, as ``tuning.trial.make_trainable`` does — one after
another in this process through :func:`engine.simulation.simulate` with
``ray.executor=local`` (nothing written). Its figure is the sum of the per-trial wall
times (data set built, checks, σ calibrated, executor built, rounds).

dpfl promises that the Ray and in-process executors give bit-identical models for the
same seed and ``num_workers``; the script checks it per trial: the final weights in
the trial's own checkpoint (``OUT/trial_checkpoints/<trial_id>.pkl``) against the
in-process run's, and the final ε and test accuracy of its rows.

Where the time goes is read from Tune's ``result.json`` of every trial: the time from
the trial's start to its first report (round 1: the trainable's set-up, building the
data, calibrating σ, starting the worker and server actors, round 1) and to its last,
the span from the first trial's start to the last trial's end, and the average number
of trials running at once over that span. The load average is printed at the start,
the end and with each figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.measure import load_average, start_local_ray

TARGET_RATIO = 1.2
ALGORITHM = "dp_fedavg"
EPSILON = 8.0


def sweep_overrides(rounds: int | None) -> list[str]:
    """``--set`` overrides on top of ``--smoke-test`` (its sizes are the trials')."""
    return [f"rounds={rounds}"] if rounds is not None else []


def experiment_config(overrides: list[str]):
    """The experiment's config exactly as ``run_tune`` builds it with ``smoke_test``."""
    from engine.config import load_config, set_path
    from tuning.plan import SMOKE

    tree: dict[str, Any] = {}
    for key, value in SMOKE.items():
        set_path(tree, key, value)
    config = load_config(base=tree, overrides=overrides)
    return config


def trial_config(base: dict, index: int):
    """Trial ``index``'s config, as ``tuning.trial.make_trainable``'s trainable builds it
    under random search, plus its data set; the run seed is the trial's seed."""
    from engine.config import config_from_dict, replace, with_algorithm
    from engine.data import build_dataset
    from engine.privacy import rng as rngs
    from tuning.spaces import sample, space_for
    from tuning.trial import TUNE_STREAM, trial_seed

    config0 = config_from_dict(base)
    space = space_for(ALGORITHM, None, config0.recipe)
    key = zlib.crc32(f"{ALGORITHM}|{EPSILON:g}".encode())
    hps = sample(space, rngs.numpy_rng(base["seed"], TUNE_STREAM, key, index))
    config = with_algorithm(
        config0,
        ALGORITHM,
        **{"privacy.epsilon": EPSILON, "privacy.noise_multiplier": None},
        **hps,
    )
    dataset = build_dataset(config.dataset, rngs.numpy_rng(config.seed, rngs.DATA))
    seed = trial_seed(int(base["seed"]), ALGORITHM, EPSILON, index)
    return replace(config, seed=seed, **{"ray.executor": "local"}), dataset, hps


def run_in_process(base: dict, n: int) -> list[dict[str, Any]]:
    """The n trials back to back in this process with ``ray.executor=local``."""
    from engine.simulation import simulate

    out = []
    for k in range(n):
        t0 = time.perf_counter()
        config, dataset, hps = trial_config(base, k)
        res = simulate(config, write=False, dataset=dataset, progress=False)
        out.append(
            {
                "index": k,
                "seconds": time.perf_counter() - t0,
                "weights": np.asarray(res.weights),
                "epsilon": res.final_epsilon,
                "test_accuracy": res.final_accuracy,
                "hps": hps,
            }
        )
    return out


def tune_timeline(out: Path) -> dict[str, Any]:
    """Per trial, from Tune's result.json: start, time to first and last report."""
    trials = []
    for path in sorted((out / "tune").glob("*/*/result.json")):
        lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
        if not lines:
            continue
        first, last = lines[0], lines[-1]
        end = float(last["timestamp"])
        start = end - float(last["time_total_s"])
        trials.append(
            {
                "trial_id": last.get("trial_id"),
                "start": start,
                "end": end,
                "to_first_report_s": float(first["time_total_s"]),
                "to_last_report_s": float(last["time_total_s"]),
            }
        )
    if not trials:
        return {"trials": []}
    span = max(t["end"] for t in trials) - min(t["start"] for t in trials)
    busy = sum(t["to_last_report_s"] for t in trials)
    return {
        "trials": trials,
        "span_s": span,
        "sum_trial_s": busy,
        "mean_concurrency": busy / span if span > 0 else math.nan,
        "median_to_first_report_s": statistics.median(t["to_first_report_s"] for t in trials),
        "median_trial_s": statistics.median(t["to_last_report_s"] for t in trials),
    }


def compare(out: Path, local: list[dict[str, Any]]) -> dict[str, Any]:
    """Each Tune trial's final weights, ε and accuracy against the in-process run's."""
    from tuning.report import load_rounds

    rounds = load_rounds(out)
    last = rounds.sort_values("round").groupby("trial_id").tail(1)
    by_index = {int(r["trial_index"]): r for _, r in last.iterrows()}
    identical, max_rel, eps_equal, acc_equal, missing = 0, 0.0, 0, 0, []
    for run in local:
        row = by_index.get(run["index"])
        ckpt = out / "trial_checkpoints" / f"{row['trial_id']}.pkl" if row is not None else None
        if row is None or ckpt is None or not ckpt.exists():
            missing.append(run["index"])
            continue
        w_tune = np.asarray(pickle.loads(ckpt.read_bytes())["server"]["weights"])
        w_local = run["weights"]
        same = w_tune.shape == w_local.shape and np.array_equal(w_tune, w_local)
        identical += int(same)
        if w_tune.shape == w_local.shape:
            rel = float(
                np.linalg.norm(w_tune.astype(np.float64) - w_local)
                / max(np.linalg.norm(w_local), 1e-30)
            )
            max_rel = max(max_rel, rel)
        else:
            max_rel = math.inf
        eps_equal += int(float(row["epsilon"]) == run["epsilon"])
        acc_equal += int(
            float(row["test_accuracy"]) == run["test_accuracy"]
            or (math.isnan(row["test_accuracy"]) and math.isnan(run["test_accuracy"]))
        )
    return {
        "tune_trials": len(by_index),
        "compared": len(local) - len(missing),
        "missing": missing,
        "weights_identical": identical,
        "max_weights_rel_diff": max_rel,
        "epsilon_equal": eps_equal,
        "accuracy_equal": acc_equal,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=None, help="trials in the sweep (default 32)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per trial (smoke: 2)")
    p.add_argument("--quick", action="store_true", help="4 trials (CI smoke run)")
    p.add_argument("--out", type=Path, default=None, help="sweep folder (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write every number here")
    p.add_argument(
        "--trial-executor",
        choices=("auto", "ray", "local"),
        default="auto",
        help="tune.trial_executor: auto (dpfl's default: local for one worker), ray "
        "(client-worker and server actors per trial) or local (the simulation inside "
        "each trial's own process)",
    )
    a = p.parse_args(argv)
    a.trials = a.trials or (4 if a.quick else 32)
    if a.trials < 1 or (a.rounds is not None and a.rounds < 1):
        p.error("--trials and --rounds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("DPFL_RAY_LOG_TO_DRIVER", "0")
    import ray

    from tuning.experiment import run_tune
    from tuning.plan import SMOKE

    rep: dict[str, Any] = {
        "trials_requested": args.trials,
        "quick": args.quick,
        "load_average_at_start": load_average(),
    }
    overrides = sweep_overrides(args.rounds)
    print(f"== Tune overhead: {args.trials} trials{' (quick)' if args.quick else ''} ==")
    print(
        f"load average (1/5/15 min) at start: {rep['load_average_at_start']}; "
        f"{os.cpu_count()} cores; ray {ray.__version__}"
    )
    print(
        f"trials: {ALGORITHM} at epsilon={EPSILON:g}, --smoke-test sizes {SMOKE} "
        f"+ {overrides}, random search over the recipe's default space"
    )
    tmp = None
    out = args.out
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="dpfl-tune-overhead-")
        out = Path(tmp.name) / "exp"
    rep["ray_startup_s"] = start_local_ray(2)
    print(f"ray startup (ray.init, excluded): {rep['ray_startup_s']:.2f} s")
    print(f"tune.trial_executor={args.trial_executor}")
    rep["trial_executor"] = args.trial_executor
    driver_out = out.with_name(out.name + "-driver")

    def sweep(folder: Path, runner: str):
        return run_tune(
            None,
            [ALGORITHM],
            [EPSILON],
            num_samples=args.trials,
            out=folder,
            smoke_test=True,
            overrides=overrides,
            trial_executor_choice=args.trial_executor,
            runner=runner,
        )

    try:
        t = time.perf_counter()
        trials = sweep(out, "tune")
        tune_s = time.perf_counter() - t
        tune_load = load_average()
    finally:
        ray.shutdown()
    rep["tune_s"] = tune_s
    rep["tune_load"] = tune_load
    rep["tune_statuses"] = {str(k): int(v) for k, v in trials["status"].value_counts().items()}
    timeline = tune_timeline(out)
    rep["timeline"] = {k: v for k, v in timeline.items() if k != "trials"}
    print(
        f"Tune sweep (run_tune): {tune_s:.2f} s for {len(trials)} trials "
        f"{rep['tune_statuses']}  [load {rep['tune_load']}]"
    )
    if timeline["trials"]:
        tl = rep["timeline"]
        print(
            f"  from result.json: first trial start to last trial end {tl['span_s']:.2f} s "
            f"(so {tune_s - tl['span_s']:.2f} s of Tune start/finish outside any trial); "
            f"sum of trial times {tl['sum_trial_s']:.2f} s, mean {tl['mean_concurrency']:.2f} "
            f"trials at once; per trial (median): start to round 1 reported "
            f"{tl['median_to_first_report_s']:.2f} s, start to last round reported "
            f"{tl['median_trial_s']:.2f} s"
        )
    config = experiment_config(overrides)
    base = config.to_dict()
    t = time.perf_counter()
    local = run_in_process(base, args.trials)
    local_wall = time.perf_counter() - t
    local_sum = sum(r["seconds"] for r in local)
    rep["in_process_sum_s"] = local_sum
    rep["in_process_wall_s"] = local_wall
    rep["in_process_median_trial_s"] = statistics.median(r["seconds"] for r in local)
    rep["in_process_first_trial_s"] = local[0]["seconds"]
    rep["in_process_load"] = load_average()
    # The same sweep with --runner driver: the trials one after another in this
    # process, without Ray Tune (the other way the issue proposes). Its trials need no
    # Ray, so like the baseline (just before it) it runs with Ray shut down (unless
    # --trial-executor ray, which starts one).
    try:
        t = time.perf_counter()
        driver_trials = sweep(driver_out, "driver")
        driver_s = time.perf_counter() - t
    finally:
        ray.shutdown()
    rep["driver_load"] = load_average()
    print(
        f"in process, back to back (ray.executor=local): sum {local_sum:.2f} s over "
        f"{len(local)} trials (first {local[0]['seconds']:.2f} s, median "
        f"{rep['in_process_median_trial_s']:.2f} s)  [load {rep['in_process_load']}]"
    )
    rep["identity"] = compare(out, local)
    rep["driver_identity"] = compare(driver_out, local)
    for label, idn in (("Tune", rep["identity"]), ("driver runner", rep["driver_identity"])):
        print(
            f"{label} vs in process, same trials: {idn['compared']} compared, final weights "
            f"bit-identical in {idn['weights_identical']} (max relative difference "
            f"{idn['max_weights_rel_diff']:.2e}), final epsilon equal in "
            f"{idn['epsilon_equal']}, final test accuracy equal in {idn['accuracy_equal']}"
        )
    ratio = tune_s / local_sum
    rep["ratio"] = ratio
    rep["driver_s"] = driver_s
    rep["driver_statuses"] = {
        str(k): int(v) for k, v in driver_trials["status"].value_counts().items()
    }
    rep["driver_ratio"] = driver_s / local_sum
    rep["tune_status"] = "PASS" if ratio <= TARGET_RATIO else "MISS"
    rep["driver_status"] = "PASS" if rep["driver_ratio"] <= TARGET_RATIO else "MISS"
    rep["winner"] = "driver" if driver_s < tune_s else "tune"
    rep["status"] = "PASS" if min(ratio, rep["driver_ratio"]) <= TARGET_RATIO else "MISS"
    rep["load_average_at_end"] = load_average()
    print("\n== ratio ==")
    print(
        f"Tune / in process ({args.trials} trials): {tune_s:.2f} s / {local_sum:.2f} s = "
        f"{ratio:.3f} (target <= {TARGET_RATIO}: {rep['tune_status']})"
    )
    print(
        f"--runner driver / in process ({args.trials} trials): {driver_s:.2f} s / "
        f"{local_sum:.2f} s = {rep['driver_ratio']:.3f} (target <= {TARGET_RATIO}: "
        f"{rep['driver_status']}) {rep['driver_statuses']}  [load {rep['driver_load']}]"
    )
    print(
        f"faster here: --runner {rep['winner']}; sweep target: {rep['status']} "
        f"(best ratio {min(ratio, rep['driver_ratio']):.3f})"
    )
    print(
        f"load average (1/5/15 min): {rep['load_average_at_start']} at start, "
        f"{rep['load_average_at_end']} at end"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=2, default=str))
        print(f"json: {args.json}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
