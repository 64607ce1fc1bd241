"""Real-data parity: dpfl's dp_fedavg against the independent plain loop on Fashion-MNIST.

    python scripts/fashion_mnist_parity.py --seeds 0,1,2,3,4 --out results/fm_parity
    python scripts/fashion_mnist_parity.py --out results/fm_parity --reuse   # table only

The setting of issue 28 (the held-out check that found dpfl's old defaults 5 points
below a plain loop): 500 IID clients of 34 images (the first 17,000 Fashion-MNIST
training images, written as IDX files under ``--out``/data), Poisson q = 0.1 (about 50
clients a round), the FedAvg CNN, z = 1, C = 1, one local epoch of B = 10 at lr 0.05,
20 rounds, evaluated on all 10,000 test images. For each seed it runs, as separate
processes, ``scripts/plain_dp_fedavg_mnist.py`` (imports nothing from dpfl) and
``dpfl run`` with dpfl's defaults (pixels in [0, 1], no client held-out split) and
the same choices. The two use different random streams (the plain loop one numpy
generator, dpfl its keyed streams), so they agree in distribution, not bit for bit.

Decision rule (written before the runs): parity holds when the mean over the seeds of
dpfl's final test accuracy is within 1 point (0.01) of the plain loop's mean. The 95 %
interval of the mean difference (t over the per-seed differences; the two runs of a
seed are independent draws, so this is a two-sample question summarised per seed) is
reported beside it. Both ε come from their own accountants (the plain loop's
dp_accounting RDP, dpfl's) and must agree.

Writes ``--out``/parity.json and prints a Markdown table with wall times and the load
average of each run (the machine is shared).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEBIAN_ROOT = "/usr/share/datasets/fashion-mnist"
TRAIN_IMAGES = 17_000  # 500 clients x 34
SETTING = {
    "num_clients": 500,
    "rate": 0.1,
    "noise_multiplier": 1.0,
    "clip_norm": 1.0,
    "epochs": 1,
    "batch_size": 10,
    "lr": 0.05,
    "rounds": 20,
}

#: t quantiles (two-sided 95 %) by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def write_subset(src: str, dst: Path, n: int) -> None:
    """The first ``n`` training images and labels of ``src`` as plain IDX files, and the
    full test set (copied), under ``dst`` (Debian's flat layout)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name, item in (("train-images-idx3-ubyte", 784), ("train-labels-idx1-ubyte", 1)):
        with gzip.open(os.path.join(src, name + ".gz"), "rb") as f:
            data = f.read()
        ndim = data[3]
        header = bytearray(data[: 4 + 4 * ndim])
        header[4:8] = n.to_bytes(4, "big")
        (dst / name).write_bytes(bytes(header) + data[4 + 4 * ndim : 4 + 4 * ndim + n * item])
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        shutil.copy(os.path.join(src, name + ".gz"), dst / (name + ".gz"))


def run_plain(seed: int, data: Path, out: Path) -> None:
    s = SETTING
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "plain_dp_fedavg_mnist.py"),
        "--dataset=fashion_mnist",
        f"--root={data}",
        f"--seed={seed}",
        f"--num-clients={s['num_clients']}",
        f"--rate={s['rate']}",
        f"--noise-multiplier={s['noise_multiplier']}",
        f"--clip-norm={s['clip_norm']}",
        f"--epochs={s['epochs']}",
        f"--batch-size={s['batch_size']}",
        f"--lr={s['lr']}",
        f"--rounds={s['rounds']}",
        f"--eval-every={s['rounds']}",
        f"--json={out / f'plain_s{seed}.json'}",
    ]
    with open(out / f"plain_s{seed}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def run_dpfl(seed: int, data: Path, out: Path) -> None:
    s = SETTING
    sets = {
        "seed": seed,
        "dataset.name": "fashion_mnist",
        "dataset.root": data,
        "dataset.num_clients": s["num_clients"],
        "model.name": "cnn",
        "sampling.rate": s["rate"],
        "privacy.noise_multiplier": s["noise_multiplier"],
        "privacy.clip_norm": s["clip_norm"],
        "local.epochs": s["epochs"],
        "local.batch_size": s["batch_size"],
        "local.lr": s["lr"],
        "rounds": s["rounds"],
        "eval.every": s["rounds"],
    }
    cmd = [str(Path(sys.executable).parent / "dpfl"), "run", "--executor", "local"]
    cmd += ["--out", str(out / f"dpfl_s{seed}")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    t0 = time.time()
    with open(out / f"dpfl_s{seed}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    (out / f"dpfl_s{seed}.time.json").write_text(
        json.dumps({"wall_time_s": time.time() - t0, "loadavg": os.getloadavg()[0]})
    )


def read_dpfl(seed: int, out: Path) -> dict:
    import pandas as pd

    folder = out / f"dpfl_s{seed}"
    rows = pd.read_parquet(folder / "rounds.parquet")
    cfg = json.loads((folder / "config.json").read_text())
    timing_file = out / f"dpfl_s{seed}.time.json"
    timing = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
    if "wall_time_s" not in timing:  # from the run's own rows: seconds since its start
        timing["wall_time_s"] = float(rows["wall_time_s_nonprivate"].iloc[-1])
    return {
        "test_accuracy": float(rows["test_accuracy"].dropna().iloc[-1]),
        "epsilon": float(rows["epsilon"].iloc[-1]),
        "client_test_fraction": cfg["config"]["dataset"]["client_test_fraction"],
        "normalize": cfg["config"]["dataset"]["normalize"],
        "wall_time_s": timing.get("wall_time_s", float("nan")),
        "loadavg": timing.get("loadavg", float("nan")),
    }


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95 % t interval of the per-seed differences."""
    d = np.asarray(diffs, dtype=np.float64)
    mean = float(d.mean())
    if len(d) < 2:
        return mean, math.nan, math.nan
    half = T95.get(len(d) - 1, 1.96) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--out", default="results/fm_parity")
    ap.add_argument("--root", default=DEBIAN_ROOT, help="the four Fashion-MNIST .gz files")
    ap.add_argument("--reuse", action="store_true", help="keep runs already in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    data = out / "data"
    if not (data / "train-images-idx3-ubyte").is_file():
        write_subset(args.root, data, TRAIN_IMAGES)
    seeds = [int(s) for s in args.seeds.split(",")]
    table = []
    for seed in seeds:
        if not (args.reuse and (out / f"plain_s{seed}.json").is_file()):
            run_plain(seed, data, out)
        if not (args.reuse and (out / f"dpfl_s{seed}" / "rounds.parquet").is_file()):
            run_dpfl(seed, data, out)
        plain = json.loads((out / f"plain_s{seed}.json").read_text())
        table.append({"seed": seed, "plain": plain, "dpfl": read_dpfl(seed, out)})
    diffs = [r["dpfl"]["test_accuracy"] - r["plain"]["test_accuracy"] for r in table]
    mean, lo, hi = interval(diffs)
    plain_mean = float(np.mean([r["plain"]["test_accuracy"] for r in table]))
    dpfl_mean = float(np.mean([r["dpfl"]["test_accuracy"] for r in table]))
    verdict = "holds" if abs(dpfl_mean - plain_mean) <= 0.01 else "does not hold"
    summary = {
        "setting": SETTING,
        "train_images": TRAIN_IMAGES,
        "seeds": table,
        "plain_mean": plain_mean,
        "dpfl_mean": dpfl_mean,
        "difference_mean": mean,
        "difference_ci95": [lo, hi],
        "rule": "parity holds when |mean dpfl - mean plain| <= 0.01",
        "verdict": verdict,
    }
    (out / "parity.json").write_text(json.dumps(summary, indent=2))
    print("| seed | plain loop | dpfl | dpfl − plain | ε (plain / dpfl) | wall s (plain / dpfl) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r, d in zip(table, diffs):
        p, q = r["plain"], r["dpfl"]
        print(
            f"| {r['seed']} | {p['test_accuracy']:.4f} | {q['test_accuracy']:.4f} | {d:+.4f} | "
            f"{p['epsilon']:.3f} / {q['epsilon']:.3f} | "
            f"{p['wall_time_s']:.0f} (load {p['loadavg']:.1f}) / "
            f"{q['wall_time_s']:.0f} (load {q['loadavg']:.1f}) |"
        )
    print(
        f"\nmean: plain {plain_mean:.4f}, dpfl {dpfl_mean:.4f}; difference {mean:+.4f}, "
        f"95 % interval [{lo:+.4f}, {hi:+.4f}]; parity within 1 point: {verdict}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
