"""Reading a sweep's results: one file per (trial, round) against one file per trial.

    python -m benchmarks.results_io                      # 1,000 trials x 300 rounds
    python -m benchmarks.results_io --trials 100 --rounds 50 --json io.json

While a Tune trial runs, each round is its own Parquet file (``tuning.rounds.write_round``,
readable at once); when it ends, ``tuning.rounds.compact_trial`` folds them into one file.
This writes ``--sample-trials`` trials round by round with the real ``write_round``,
times ``tuning.report.load_rounds`` on that per-round layout, compacts them with the
real ``compact_trial``, and fills the rest of the sweep with copies of those compacted
files (each under its own trial id), then times ``load_rounds`` on the whole compacted
sweep. Writing 300,000 round files would take minutes, so the per-round layout's time
for the whole sweep is extrapolated from the sample at the measured seconds per file
(reading is linear in the number of files; the figure is labelled as extrapolated).
Prints both, their ratio, and PASS/MISS against the target: the whole compacted sweep
read in <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tuning.report import load_rounds
from tuning.rounds import compact_trial, rounds_dir, write_round

TARGET_S = 5.0
#: a tuned run's row: the engine's per-round columns, event columns, hyperparameters
FLOAT_COLUMNS = [
    "epsilon", "test_accuracy", "test_loss", "cohort_size", "realised_cohort_size_nonprivate",
    "mean_update_norm_nonprivate", "clipped_fraction_nonprivate", "train_loss_nonprivate",
    "nonfinite_updates_nonprivate", "max_clipped_norm_nonprivate", "noise_multiplier",
    "clip_norm", "delta", "sampling_rate", "num_clients", "max_cohort", "rounds_planned",
    "trial_index", "trial_seed", "data_seed", "lr", "epochs", "rho", "beta", "sigma_ls",
    "keep_fraction", "blur_lambda", "wall_time_s_nonprivate", "local_steps",
]  # fmt: skip
STRING_COLUMNS = {"ls_scope": "string", "ls_local": "string"}


def trial_rows(trial_id: str, rounds: int, seed: int) -> list[dict]:
    g = np.random.default_rng(seed)
    values = g.random((rounds, len(FLOAT_COLUMNS)))
    rows = []
    for r in range(rounds):
        row = dict(zip(FLOAT_COLUMNS, values[r].tolist()))
        row.update(
            algorithm="dp_fedavg",
            epsilon_budget=4.0,
            trial_id=trial_id,
            round=r + 1,
            dataset="synthetic",
            accountant="rdp",
            clip_mode="fixed",
            ls_scope="tensor",
        )
        rows.append(row)
    return rows


def measure(out: Path, trials: int, rounds: int, sample: int) -> dict:
    columns = {c: "float" for c in ("lr", "epochs", "rho", "beta", "sigma_ls", "keep_fraction")}
    columns.update(STRING_COLUMNS)
    sample = min(sample, trials)
    t0 = time.perf_counter()
    for k in range(sample):
        for row in trial_rows(f"t_{k:05d}", rounds, k):
            write_round(out, row, columns)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    per_round = load_rounds(out)
    per_round_s = time.perf_counter() - t0
    files = sample * rounds
    folder = rounds_dir(out, "dp_fedavg", 4.0)
    t0 = time.perf_counter()
    for k in range(sample):
        compact_trial(out, "dp_fedavg", 4.0, f"t_{k:05d}")
    compact_s = time.perf_counter() - t0
    assert len(list(folder.iterdir())) == sample
    pd.testing.assert_frame_equal(load_rounds(out), per_round)  # the same rows
    for k in range(sample, trials):  # the rest of the sweep: compacted trials
        frame = pd.read_parquet(folder / f"t_{k % sample:05d}.parquet")
        frame["trial_id"] = f"t_{k:05d}"
        frame.to_parquet(folder / f"t_{k:05d}.parquet", index=False)
    t0 = time.perf_counter()
    whole = load_rounds(out)
    compacted_s = time.perf_counter() - t0
    assert len(whole) == trials * rounds
    extrapolated = per_round_s / files * trials * rounds
    return {
        "trials": trials,
        "rounds": rounds,
        "columns": int(whole.shape[1]),
        "sample_trials": sample,
        "per_round_files_read": files,
        "per_round_read_s": per_round_s,
        "per_round_write_s_per_file": write_s / files,
        "compact_s_per_trial": compact_s / sample,
        "per_round_layout_whole_sweep_s_extrapolated": extrapolated,
        "compacted_files": trials,
        "compacted_read_s": compacted_s,
        "ratio_compacted_over_per_round": compacted_s / extrapolated,
        "target_s": TARGET_S,
        "pass": compacted_s <= TARGET_S,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--sample-trials", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        res = measure(Path(d), args.trials, args.rounds, args.sample_trials)
        shutil.rmtree(Path(d) / "rounds", ignore_errors=True)
    n = res["trials"] * res["rounds"]
    shape = f"{res['trials']} trials x {res['rounds']} rounds = {n} rows"
    print(f"sweep: {shape}, {res['columns']} columns")
    print(
        f"per-round layout: {res['per_round_files_read']} files read in "
        f"{res['per_round_read_s']:.2f} s -> whole sweep ({n} files) "
        f"{res['per_round_layout_whole_sweep_s_extrapolated']:.1f} s (extrapolated)"
    )
    print(
        f"compaction: {res['compact_s_per_trial'] * 1e3:.1f} ms per trial "
        f"(writing a round file: {res['per_round_write_s_per_file'] * 1e3:.2f} ms)"
    )
    verdict = "PASS" if res["pass"] else "MISS"
    print(
        f"one file per trial: {res['compacted_files']} files read in "
        f"{res['compacted_read_s']:.2f} s; ratio compacted/per-round "
        f"{res['ratio_compacted_over_per_round']:.4f}; target <= {TARGET_S:g} s: {verdict}"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
