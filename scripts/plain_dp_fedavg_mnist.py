"""Independent plain-PyTorch DP-FedAvg on MNIST or Fashion-MNIST: an oracle for dpfl.

This script re-implements, in a single process and without importing anything from
the project packages (``engine``, ``algorithms``, ``tuning``), the procedure that

    dpfl run --set dataset.name=fashion_mnist --set model.name=cnn \\
        --set dataset.num_clients=500 --set sampling.rate=0.1 \\
        --set privacy.noise_multiplier=1.0 --set local.epochs=1 --set local.batch_size=10 \\
        --set local.lr=0.05 --set rounds=20

runs with dpfl's defaults (privacy.clip_norm=1.0, server.lr=1.0, lr_decay=1.0,
momentum=0, weight_decay=0; for dp_fedavg no client held-out split and, for these
grey-scale sources, pixels in [0, 1]; δ=min(N^-1.1, 0.01/N)). Its RNG streams differ
from dpfl's, so results are not bit-identical; they agree in distribution
(scripts/fashion_mnist_parity.py compares them over seeds).

Procedure:

* Data: ``--dataset mnist``: MNIST's IDX files in torchvision's layout under
  ``<root>/MNIST/raw``; ``--dataset fashion_mnist`` (default): the four IDX files
  directly under ``<root>`` (default /usr/share/datasets/fashion-mnist, Debian's
  ``dataset-fashion-mnist``). Files may be gzipped. Pixels /255; with
  ``--normalize standardize`` then (x - mean) / std with the published constants.
* IID partition of the training images into N clients (random permutation split
  into near-equal parts); each client holds out floor(f·n) examples
  (``--client-test-fraction``, default 0) and trains on the rest. Evaluation uses
  the official test set.
* Model: the FedAvg CNN (two 5x5 conv layers 32/64 with ReLU and 2x2 max-pooling,
  a 512-unit dense layer, a linear classifier), default PyTorch initialisation.
* Each round: Poisson sampling with rate q; each sampled client runs ``epochs``
  epochs of plain SGD (batch size B, shuffled every epoch, last batch may be
  smaller, cross-entropy) from the global weights; its update Δ is clipped to L2
  norm C; the clipped sum plus N(0, (zC)²) per coordinate is divided by the fixed
  denominator q·N and added (times the server learning rate) to the global weights.
* ε: ``dp_accounting`` RDP accountant, ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
  composed once per round, at δ = min(N^-1.1, 0.01/N).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import time

import dp_accounting
import numpy as np
import torch
from dp_accounting import rdp
from torch import nn

logging.getLogger("absl").setLevel(logging.ERROR)  # RDP's benign non-convergence notes

#: (mean, std) of the training pixels in [0, 1]: MNIST's usual published values, and
#: Fashion-MNIST's (0.2860, 0.3530), used only with ``--normalize standardize``.
STATS = {"mnist": (0.1307, 0.3081), "fashion_mnist": (0.2860, 0.3530)}
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"


def read_idx(path: str) -> np.ndarray:
    """Read an unsigned-byte IDX file (plain or ``.gz``) into a uint8 array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim, dtype_code = magic & 0xFF, (magic >> 8) & 0xFF
    if magic >> 16 != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {magic:#010x})")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 * (ndim + 1))
    return arr.reshape(dims)


def load_images(
    dataset: str, root: str | None, normalize: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): float32 (n, 1, 28, 28), int64 labels.

    ``mnist``: torchvision's layout ``<root>/MNIST/raw``; ``fashion_mnist``: the four
    files directly under ``<root>`` (Debian's ``dataset-fashion-mnist`` puts them in
    /usr/share/datasets/fashion-mnist). Files may be gzipped. Pixels /255, then with
    ``standardize`` (x - mean) / std with the usual published constants.
    """
    if root is None:
        root = FASHION_MNIST_ROOT if dataset == "fashion_mnist" else "."
    folder = os.path.join(root, "MNIST", "raw") if dataset == "mnist" else root
    mean, std = STATS[dataset]

    def path(name: str) -> str:
        plain = os.path.join(folder, name)
        return plain if os.path.isfile(plain) else plain + ".gz"

    def images(name: str) -> np.ndarray:
        x = read_idx(path(name)).astype(np.float32)[:, None]
        x /= np.float32(255.0)
        if normalize == "unit_interval":
            return x
        return ((x - np.float32(mean)) / np.float32(std)).astype(np.float32)

    def labels(name: str) -> np.ndarray:
        return read_idx(path(name)).astype(np.int64)

    return (
        images("train-images-idx3-ubyte"),
        labels("train-labels-idx1-ubyte"),
        images("t10k-images-idx3-ubyte"),
        labels("t10k-labels-idx1-ubyte"),
    )


def partition_clients(
    n: int, num_clients: int, test_fraction: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """IID split into near-equal parts; returns each client's *training* indices."""
    parts = np.array_split(rng.permutation(n), num_clients)
    train = []
    for part in parts:
        perm = rng.permutation(len(part))
        n_test = min(int(math.floor(test_fraction * len(part))), max(len(part) - 1, 0))
        train.append(np.sort(part[perm[n_test:]]).astype(np.int64))
    return train


def make_cnn(num_classes: int = 10) -> nn.Module:
    """The FedAvg CNN of McMahan et al. (2017) for 1x28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


def get_flat(model: nn.Module) -> torch.Tensor:
    """A new float32 vector holding all parameters."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the model's parameters."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            k = p.numel()
            p.copy_(flat[offset : offset + k].view_as(p))
            offset += k


def local_update(
    model: nn.Module,
    global_w: torch.Tensor,
    x: np.ndarray,
    y: np.ndarray,
    epochs: int,
    batch_size: int,
    lr: float,
    rng: np.random.Generator,
) -> torch.Tensor:
    """Plain minibatch SGD from ``global_w`` on (x, y); returns Δ = w_local − w_global."""
    set_flat(model, global_w)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    loss_fn = nn.CrossEntropyLoss()
    n = len(y)
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            b = order[start : start + batch_size]
            xb = torch.from_numpy(x[b])
            yb = torch.from_numpy(y[b])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
    return get_flat(model) - global_w


def clip(delta: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """Scale ``delta`` by min(1, C/‖Δ‖); non-finite updates become zero."""
    if not bool(torch.isfinite(delta).all()):
        return torch.zeros_like(delta), math.nan
    norm = float(torch.linalg.vector_norm(delta.double()))
    if norm > clip_norm:
        return delta * (clip_norm / norm), norm
    return delta, norm


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 2048) -> float:
    """Top-1 accuracy of ``model`` on (x, y)."""
    model.eval()
    correct = 0
    for s in range(0, len(y), batch_size):
        out = model(torch.from_numpy(x[s : s + batch_size]))
        correct += int((out.argmax(1) == torch.from_numpy(y[s : s + batch_size])).sum())
    model.train()
    return correct / len(y)


def epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """ε after ``rounds`` Poisson-subsampled Gaussian rounds (RDP, add/remove-one)."""
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return float(acc.get_epsilon(delta))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=sorted(STATS), default="fashion_mnist")
    p.add_argument(
        "--root",
        default=None,
        help="mnist: folder holding MNIST/raw/*-ubyte[.gz]; fashion_mnist: folder holding "
        f"the four *-ubyte[.gz] files (default {FASHION_MNIST_ROOT})",
    )
    p.add_argument("--normalize", choices=("unit_interval", "standardize"), default="unit_interval")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5, help="test accuracy every k rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1, help="local epochs")
    p.add_argument("--num-clients", type=int, default=500)
    p.add_argument("--rate", type=float, default=0.1, help="Poisson sampling rate q")
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-decay", type=float, default=1.0)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--client-test-fraction", type=float, default=0.0)
    p.add_argument("--json", default=None, help="also write the final numbers to this file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    t0 = time.time()

    x_train, y_train, x_test, y_test = load_images(args.dataset, args.root, args.normalize)
    clients = partition_clients(len(y_train), args.num_clients, args.client_test_fraction, rng)
    sizes = np.array([len(c) for c in clients])
    print(
        f"data: train={len(y_train)} test={len(y_test)} clients={len(clients)} "
        f"train/client min={sizes.min()} mean={sizes.mean():.1f} max={sizes.max()}",
        flush=True,
    )

    model = make_cnn()
    global_w = get_flat(model)
    dim = global_w.numel()
    q, n_clients = args.rate, args.num_clients
    z, c_norm = args.noise_multiplier, args.clip_norm
    denominator = q * n_clients
    delta_dp = min(float(n_clients) ** -1.1, 0.01 / n_clients)
    print(f"model: cnn params={dim} denominator={denominator} delta={delta_dp:.3e}", flush=True)

    for t in range(args.rounds):
        tr = time.time()
        cohort = np.flatnonzero(rng.random(n_clients) < q)
        lr = args.lr * args.lr_decay**t
        total = torch.zeros(dim, dtype=torch.float64)
        norms = []
        for c in cohort:
            idx = clients[c]
            d = local_update(
                model, global_w, x_train[idx], y_train[idx], args.epochs, args.batch_size, lr, rng
            )
            clipped, norm = clip(d, c_norm)
            total += clipped.double()
            norms.append(norm)
        noise = torch.randn(dim, dtype=torch.float64) * (z * c_norm)
        avg = (total + noise) / denominator
        global_w = global_w + (args.server_lr * avg).to(torch.float32)
        set_flat(model, global_w)
        msg = (
            f"round {t + 1}/{args.rounds}: cohort={len(cohort)} "
            f"mean_norm={np.nanmean(norms) if norms else math.nan:.3f} "
            f"clipped={np.mean(np.array(norms) > c_norm) if norms else math.nan:.2f}"
        )
        if (t + 1) % args.eval_every == 0 or t + 1 == args.rounds:
            msg += f" test_accuracy={accuracy(model, x_test, y_test):.4f}"
        print(f"{msg} ({time.time() - tr:.1f}s)", flush=True)

    acc = accuracy(model, x_test, y_test)
    eps = epsilon(q, z, args.rounds, delta_dp)
    print(
        f"plain loop: final test_accuracy={acc:.4f} epsilon={eps:.4f} "
        f"wall_time_s={time.time() - t0:.1f} loadavg={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "seed": args.seed,
                    "test_accuracy": acc,
                    "epsilon": eps,
                    "wall_time_s": time.time() - t0,
                    "loadavg": os.getloadavg()[0],
                    "args": vars(args),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
