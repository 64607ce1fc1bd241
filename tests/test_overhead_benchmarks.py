"""benchmarks/startup_eval.py and benchmarks/tune_overhead.py: ``--quick`` runs measure
what they claim and report consistent numbers. No timing bound is asserted (timings
belong to the benchmarks' own output, on a possibly shared machine)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_command

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.benchmark]


def run_quick(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        benchmark_command(script, "--quick", "--json", str(out), *extra),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_startup_eval_quick(tmp_path) -> None:
    r = run_quick("startup_eval.py", tmp_path)
    fr = r["first_round"]
    assert positive(fr["ratio"]) and fr["status"] in ("PASS", "MISS")
    assert positive(fr["cold_ratio"]) and fr["cold_status"] in ("PASS", "MISS")
    for run in fr["runs"]:
        # round 1's row comes after the actors started, and the steps add up
        assert positive(run["first_round_s"]) and positive(run["round1_s"])
        parts = run["prepare_s"] + run["actors_s"] + run["round1_s"]
        assert run["to_first_round_s"] == pytest.approx(parts)
        assert 0 <= run["final_epsilon"] <= 4.0  # dpfl run's default budget
        # a remembered calibration (warm) runs exactly what a fresh search (cold) runs
        assert positive(run["cold_first_round_s"])
        assert run["cold_final_epsilon"] == run["final_epsilon"]
        assert run["cold_final_accuracy"] == run["final_accuracy"]
    ev = r["evaluation"]
    n = ev["examples"]
    plain_correct, _, plain_n = ev["plain"]["sums"]
    assert plain_n == n and positive(ev["plain"]["examples_per_s"])
    assert [row["workers"] for row in ev["ray"]] == [1, 2]
    for row in ev["ray"]:
        k = row["workers"]
        # the executor's slices cover the test set once, in order
        assert len(row["slices"]) == k and row["slices"][0][0] == 0 and row["slices"][-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(row["slices"], row["slices"][1:]))
        assert row["n"] == n
        # same model, same examples: the executor scores what the plain loop scores
        # (a differing memory layout may flip a borderline prediction, no more)
        assert abs(row["correct"] - plain_correct) <= max(2, n // 500)
        assert positive(row["speedup_vs_plain"]) and row["target_speedup"] == pytest.approx(0.8 * k)
        assert row["ratio_to_target"] == pytest.approx(row["speedup_vs_plain"] / (0.8 * k))


def test_tune_overhead_quick(tmp_path) -> None:
    r = run_quick("tune_overhead.py", tmp_path, "--trials", "3")
    assert r["trials_requested"] == 3
    assert r["tune_statuses"] == {"TERMINATED": 3}
    assert positive(r["ratio"]) and r["ratio"] == pytest.approx(r["tune_s"] / r["in_process_sum_s"])
    assert r["timeline"]["span_s"] <= r["tune_s"]
    # dpfl promises Ray == in process for the same seed and num_workers: each Tune trial
    # (its own trial seed and sampled hyperparameters) equals its in-process rerun
    idn = r["identity"]
    assert idn["tune_trials"] == 3 and idn["compared"] == 3 and not idn["missing"]
    assert idn["weights_identical"] == 3 and idn["max_weights_rel_diff"] == 0.0
    assert idn["epsilon_equal"] == 3 and idn["accuracy_equal"] == 3
    # the same sweep with --runner driver: the same trials, the verdict the better one's
    assert r["driver_statuses"] == {"TERMINATED": 3}
    assert r["driver_ratio"] == pytest.approx(r["driver_s"] / r["in_process_sum_s"])
    d = r["driver_identity"]
    assert d["compared"] == 3 and d["weights_identical"] == 3 and d["epsilon_equal"] == 3
    assert r["winner"] == ("driver" if r["driver_s"] < r["tune_s"] else "tune")
    best = min(r["ratio"], r["driver_ratio"])
    assert r["status"] == ("PASS" if best <= 1.2 else "MISS")
