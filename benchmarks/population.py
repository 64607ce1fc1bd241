"""Population scale (issue 16): set-up time and peak memory of a materialised synthetic
population against the data's own size.

    python -m benchmarks.population                      # N = 10^6 (the target), 10^5
    python -m benchmarks.population --clients 20000 --quick   # CI smoke run

Each N is built in a fresh subprocess (``build_dataset`` of ``dataset.name=synthetic``,
``synthetic_mean_samples=8``, IID partition, public clients ⌈N/10⌉ as in a run), which
reports its wall time and its peak RSS (``resource.getrusage``, ``ru_maxrss``, the whole
process: interpreter and numpy included). The data's own size is the nbytes of the
example arrays (``x_train``, ``y_train``, ``x_test``, ``y_test``); the client index
(``ClientIndex``: 8 bytes per example and per client) is printed apart. Targets: peak
≤ 1.5 × the data's size, set-up ≤ 30 s at N = 10^6. Timings are wall-clock: other load
on the machine skews them (the load average is printed); the set-up's CPU time (user +
system, ``resource.getrusage``) is printed beside it.

On-demand populations (``dataset.materialize=false``) are timed per round: the server's
Poisson draw (``sample_cohort`` with ``on_demand``, O(cohort)) and reading every member's
examples, in a fresh subprocess per N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
import numpy as np
from engine.config import DatasetConfig
from engine.data import build_dataset

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = DatasetConfig(num_clients={n}, synthetic_mean_samples={mean}, partition={partition!r})
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
ds = build_dataset(cfg, np.random.default_rng(0))
wall = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
data = sum(a.nbytes for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test))
index = sum(i.flat.nbytes + i.offsets.nbytes for i in (ds.client_train, ds.client_test))
print(json.dumps({{
    "clients": ds.num_clients, "examples": int(len(ds.y_train) + len(ds.y_test)),
    "setup_s": wall, "setup_cpu_s": cpu, "data_bytes": int(data), "index_bytes": int(index),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_before_bytes": before * 1024,
}}))
"""


ON_DEMAND = r"""
import json, resource, sys, time
import numpy as np
from engine.config import DatasetConfig
from engine.data import build_dataset
from engine.privacy.accounting import SamplingSpec
from engine.federated.server import sample_cohort

n, cohort, rounds = {n}, {cohort}, {rounds}
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = DatasetConfig(num_clients=n, synthetic_mean_samples={mean}, partition="natural",
                    materialize=False, public_eval_clients=1000)
t0 = time.perf_counter()
ds = build_dataset(cfg, np.random.default_rng(0))
setup = time.perf_counter() - t0
spec = SamplingSpec("poisson", n, rate=cohort / n)
on_demand = ds.meta.get("materialize", True) is False  # as engine.federated.server.Server sets it
sample_s, data_s, members = [], [], 0
for rnd in range(1, rounds + 1):
    t = time.perf_counter()
    ids = sample_cohort(spec, 0, rnd, on_demand=on_demand)  # what the server draws
    t1 = time.perf_counter()
    for c in ids:  # what a worker reads: each member's training examples
        x, y = ds.x_train[ds.client_train[c]], ds.y_train[ds.client_train[c]]
    data_s.append(time.perf_counter() - t1)
    sample_s.append(t1 - t)
    members += len(ids)
print(json.dumps({{
    "clients": n, "setup_s": setup, "mean_cohort": members / rounds,
    "sample_ms": 1e3 * float(np.median(sample_s)), "data_ms": 1e3 * float(np.median(data_s)),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_before_build_bytes": rss0 * 1024,
}}))
"""


def on_demand(n: int, mean: int, cohort: int, rounds: int) -> dict:
    code = ON_DEMAND.format(repo=str(REPO), n=n, mean=mean, cohort=cohort, rounds=rounds)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def materialised(n: int, mean: int, partition: str) -> dict:
    code = CHILD.format(repo=str(REPO), n=n, mean=mean, partition=partition)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", default="1000000,100000", help="materialised N, comma-separated")
    p.add_argument("--mean-samples", type=int, default=8)
    p.add_argument("--partition", default="iid", choices=["iid", "natural"])
    p.add_argument("--on-demand", default="10000,1000000", help="on-demand N, comma-separated")
    p.add_argument("--cohort", type=int, default=100, help="expected Poisson cohort (rate = c/N)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    p.add_argument("--json", help="write every number to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.on_demand, a.rounds = "20000", "1000,20000", 3
    sizes = [int(s) for s in a.clients.split(",") if s]
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    results: dict = {"materialised": []}
    print(
        "\nmaterialised synthetic population (mean 8 examples/client, dim 60, "
        f"partition={a.partition}, public clients N/10)"
    )
    print(
        "N | examples | set-up s | set-up CPU s | data | client index | peak RSS | peak/data"
        " | verdict"
    )
    for n in sizes:
        r = materialised(n, a.mean_samples, a.partition)
        ratio = r["peak_rss_bytes"] / r["data_bytes"]
        r["peak_over_data"] = ratio
        verdict = ""
        if n >= 1_000_000:
            ok = ratio <= 1.5 and r["setup_s"] <= 30
            verdict = f"{'PASS' if ok else 'MISS'} (≤ 1.5 and ≤ 30 s)"
        print(
            f"{n:,} | {r['examples']:,} | {r['setup_s']:.2f} | {r['setup_cpu_s']:.2f} | "
            f"{mib(r['data_bytes'])} | "
            f"{mib(r['index_bytes'])} | {mib(r['peak_rss_bytes'])} | {ratio:.2f} | {verdict}"
        )
        results["materialised"].append(r)
    print(
        f"\non-demand population (dataset.materialize=false, natural, mean {a.mean_samples}"
        f" examples), Poisson cohort of expected {a.cohort}, medians over {a.rounds} rounds"
    )
    print("N | set-up s | cohort | sample ms | build cohort data ms | round ms | peak RSS")
    rows = []
    for n in [int(s) for s in a.on_demand.split(",") if s]:
        r = on_demand(n, a.mean_samples, a.cohort, a.rounds)
        r["round_ms"] = r["sample_ms"] + r["data_ms"]
        rows.append(r)
        print(
            f"{n:,} | {r['setup_s']:.2f} | {r['mean_cohort']:.1f} | {r['sample_ms']:.2f} | "
            f"{r['data_ms']:.1f} | {r['round_ms']:.1f} | {mib(r['peak_rss_bytes'])}"
        )
    results["on_demand"] = rows
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        print(
            f"ratios N={hi['clients']:,} / N={lo['clients']:,}: round time "
            f"{hi['round_ms'] / lo['round_ms']:.2f}, cohort data "
            f"{hi['data_ms'] / lo['data_ms']:.2f}, peak RSS "
            f"{hi['peak_rss_bytes'] / lo['peak_rss_bytes']:.2f}"
        )
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
