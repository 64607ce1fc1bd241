"""Issue 32's Fashion-MNIST check: dp_ftrl / dp_bandmf against dp_fedavg at epsilon 2 and 8.

    python scripts/fidelity_fm_issue32.py /tmp/fm32/dp_ftrl_emnist /tmp/fm32/dp_bandmf_emnist

Reads every ``<out>/eps<E>/seed<S>/<algorithm>/`` run folder written by ``dpfl compare``
under the given folders (dp_fedavg's runs are shared: the bandmf preset was run with
``-a dp_bandmf_m09`` only), and prints per recipe and target epsilon the final test
accuracy (mean ± sample sd over the seeds), the accountant's final epsilon (max over the
seeds), the per-run wall time, and each preset's verdict (its ``better`` recipe's mean
above dp_fedavg's at every epsilon column).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pandas as pd

VERDICTS = {"dp_ftrl_sgd": "dp_fedavg", "dp_bandmf_m09": "dp_fedavg"}


def collect(roots: list[Path]) -> dict[tuple[str, float], list[dict]]:
    runs: dict[tuple[str, float], list[dict]] = {}
    for root in roots:
        for rp in sorted(root.glob("eps*/seed*/*/rounds.parquet")):
            algo = rp.parent.name
            eps = float(rp.parents[2].name[3:])
            cfg = json.loads((rp.parent / "config.json").read_text())
            d = pd.read_parquet(rp)
            if d.empty or int(d["round"].iloc[-1]) < int(cfg["config"]["rounds"]):
                continue  # unfinished (or still running)
            last = d.dropna(subset=["test_accuracy"]).iloc[-1]
            runs.setdefault((algo, eps), []).append(
                {
                    "seed": int(rp.parents[1].name[4:]),
                    "round": int(last["round"]),
                    "acc": float(last["test_accuracy"]),
                    "eps": float(cfg["privacy"]["final_epsilon"]),
                    "target": float(cfg["privacy"]["target_epsilon"]),
                    "sigma": float(cfg["privacy"]["noise_multiplier"]),
                    "wall": float(d["wall_time_s_nonprivate"].iloc[-1]),
                }
            )
    return runs


def main(argv: list[str]) -> int:
    runs = collect([Path(a) for a in argv])
    means = {}
    print(
        "| recipe | target ε | final accuracy (mean ± sd, seeds) | accountant ε | σ "
        "| wall s per run |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for (algo, eps), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        accs = [r["acc"] for r in rs]
        m = statistics.mean(accs)
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        means[(algo, eps)] = m
        seeds = ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"]))
        print(
            f"| {algo} | {eps:g} | {m:.3f} ± {sd:.3f} ({seeds}; per seed "
            f"{', '.join(f'{a:.3f}' for a in accs)}) | {max(r['eps'] for r in rs):.4f} | "
            f"{statistics.mean(r['sigma'] for r in rs):.3f} | "
            f"{statistics.mean(r['wall'] for r in rs):.0f} |"
        )
    for better, than in VERDICTS.items():
        cols = sorted(e for (a, e) in means if a == better)
        if not cols:
            continue
        ok = all(means[(better, e)] > means.get((than, e), float("inf")) for e in cols)
        print(f"{better} vs {than} at ε {cols}: {'reproduced' if ok else 'not reproduced'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
