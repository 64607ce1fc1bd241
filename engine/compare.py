"""``dpfl compare``: several recipes at one privacy budget, one table, best first.

Every method runs with the same config (data, model, sampling, budget, seed); only
``algorithm`` changes. Private methods at one ε are comparable because each one's σ
is calibrated to that ε with its own sampling; non-private rows report ε = inf.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd

from algorithms import RECIPES
from engine.config import ConfigError, RunConfig, replace


def parse_algorithms(spec: str) -> list[str]:
    if spec.strip() == "all":
        return list(RECIPES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise ConfigError(f"--algorithms={spec!r}: unknown {unknown}; known: {', '.join(RECIPES)}")
    return names


def compare(config: RunConfig, algorithms: list[str], out: Path, progress: bool = True):
    """Run each algorithm; return the summary DataFrame sorted by final accuracy."""
    from engine.simulate import prepare, simulate

    configs = [replace(config, algorithm=a, out=str(out / a)) for a in algorithms]
    for c in configs:  # validate every run before any work starts
        prepare(c)
    owns_ray = False
    if config.ray.executor == "ray":  # one Ray for all runs, not one start per method
        from engine.executors import ensure_ray

        owns_ray = ensure_ray(config.ray)
    rows = []
    try:
        for i, c in enumerate(configs, 1):
            if progress:
                print(f"[{i}/{len(configs)}] {c.algorithm}", flush=True)
            t0 = time.perf_counter()
            res = simulate(c, progress=progress)
            acc = res.rounds["test_accuracy"].dropna()
            row = {
                "algorithm": c.algorithm,
                "private": RECIPES[c.algorithm].private,
                "epsilon": res.final_epsilon,
                "noise_multiplier": res.privacy["noise_multiplier"],
                "final_accuracy": res.final_accuracy,
                "best_accuracy": float(acc.max()) if len(acc) else math.nan,
                "wall_time_s": time.perf_counter() - t0,
            }
            if "personal_accuracy" in res.rounds:
                pa = res.rounds["personal_accuracy"].dropna()
                row["personal_accuracy"] = float(pa.iloc[-1]) if len(pa) else math.nan
            rows.append(row)
            summary = pd.DataFrame(rows)
            summary.to_parquet(out / "compare.parquet", index=False)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    return summary.sort_values("final_accuracy", ascending=False, ignore_index=True)


def format_table(summary: pd.DataFrame) -> str:
    cols = [
        "algorithm",
        "private",
        "epsilon",
        "noise_multiplier",
        "final_accuracy",
        "best_accuracy",
        "personal_accuracy",
        "wall_time_s",
    ]
    cols = [c for c in cols if c in summary]
    return summary[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")
