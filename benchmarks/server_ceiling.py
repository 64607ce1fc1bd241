"""The server's ceiling: rounds per second it sustains with no training at all.

Usage::

    python -m benchmarks.server_ceiling [--dims 2000000 11000000] [--workers 1 8 64]
        [--rounds 3]

For each model size d and number k of client workers, a real :class:`engine.federated.server.Server`
(DP-FedAvg, Poisson sampling, z = 1, C = 1, the ``cnn`` (2.16M parameters) or
``resnet18_gn`` (11.2M) model nearest to d) runs rounds on k ready-made float64 partial
sums of d coordinates each (one buffer passed k times: each is read from memory, as k
distinct partial sums would be). Per round it times, in CPU seconds of this one-thread
process (``time.process_time``, so that other processes on a shared machine count
less), ``begin_round`` (cohort, weights out), ``prepare_noise`` (the noise draw the
executor overlaps with training) and ``finish_round`` (reduce of the k partials, the
update with that noise, ε), and prints rounds/s with the noise drawn ahead and after.
The partial sums reach a server in the driver zero-copy from Ray's object store on one
machine; across machines each is d × 8 bytes on the server's network link, so the
printout adds the time k partials take at 25 and 100 Gbit/s (computed, not measured).
The load average is printed with each line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from engine.config import load_config
from engine.data.federated import FederatedDataset
from engine.federated.client import PartialSum
from engine.federated.server import Server
from engine.simulation import make_executor, prepare


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def tiny_cifar(num_clients: int = 1000) -> FederatedDataset:
    """A CIFAR-shaped dataset of one image per client (the server never trains)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num_clients, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, num_clients).astype(np.int64)
    return FederatedDataset(
        name="cifar10",
        x_train=x,
        y_train=y,
        client_train=[np.array([i]) for i in range(num_clients)],
        client_test=[np.zeros(0, np.int64) for _ in range(num_clients)],
        x_test=x[:10],
        y_test=y[:10],
        num_classes=10,
        input_shape=(3, 32, 32),
    )


def make_server(model: str) -> Server:
    cfg = load_config(
        overrides=[
            "algorithm=dp_fedavg",
            "dataset.name=cifar10",
            "dataset.num_clients=1000",
            f"model.name={model}",
            "sampling.rate=0.05",
            "privacy.epsilon=null",
            "privacy.noise_multiplier=1.0",
            "rounds=1000",
            "eval.every=1000",
            "ray.executor=local",
        ]
    )
    ex = make_executor(prepare(cfg, dataset=tiny_cifar()))
    return ex.pool.server  # the in-process pool's Server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet18_gn"])
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"== server ceiling (one torch thread); load average {load()}")
    for model in args.models:
        server = make_server(model)
        server.draw_ahead = False  # each draw timed here, in this thread, not in the next round
        d = server.dim()
        partial = np.random.default_rng(1).standard_normal(d) * 1e-3
        for k in args.workers:
            begin, noise, finish = [], [], []
            for _ in range(args.rounds):
                rnd = server.rounds_done
                parts = [PartialSum(update_sum=partial, num_clients=1) for _ in range(k)]
                t = [time.process_time()]
                server.begin_round(rnd)
                t.append(time.process_time())
                server.prepare_noise(rnd)  # what the executor overlaps with training
                t.append(time.process_time())
                server.finish_round(rnd, *parts, evaluate=False)  # uses that noise
                t.append(time.process_time())
                begin.append(t[1] - t[0])
                noise.append(t[2] - t[1])
                finish.append(t[3] - t[2])
            b, n, f = (statistics.median(v) for v in (begin, noise, finish))
            net = [k * d * 8 * 8 / (g * 1e9) for g in (25, 100)]
            print(
                f"{model}: d = {d:,}, k = {k:3d}: CPU s per round: begin {b:.4f}, finish "
                f"{f:.4f} (reduce, update, epsilon), noise {n:.4f} -> {1 / (b + f):6.2f} "
                f"rounds/s with the noise drawn ahead, {1 / (b + f + n):6.2f} with it drawn "
                f"after the reduce; k partials over 25/100 Gbit/s: {net[0]:.2f}/{net[1]:.2f} "
                f"s; load average {load()}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
