"""An independent DP-FedAvg loop for the FedAvg CNN (imports nothing from dpfl).

Written from the DP-FedAvg pseudo-code (McMahan et al., ICLR 2018) as docs/algorithms.md
§1 states it: each sampled client runs minibatch SGD from the global model, its update
Δ = w_local − w_global is scaled to L2 norm at most C, and the server adds
(Σ clipped Δ + z·C·ξ) / denominator (times the server learning rate) to the global
model. The model is the FedAvg CNN (McMahan et al., AISTATS 2017) as a plain
``nn.Sequential`` in float64. Public randomness (initial model, cohorts, minibatch
orders, noise draws ξ) is *input*, so ``test_real_data_lockstep.py`` can hand it the
draws dpfl made and compare the final models.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

DT = torch.float64


def read_idx_gz(path: str) -> np.ndarray:
    """An unsigned-byte IDX file (``.gz`` or plain), parsed from its header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist(root: str, n_train: int, n_test: int) -> tuple[np.ndarray, ...]:
    """The first ``n_train`` / ``n_test`` images of Fashion-MNIST under ``root``, as
    float32 (n, 1, 28, 28) pixels in [0, 1], with int64 labels."""

    def part(prefix: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        x = read_idx_gz(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz"))[:n]
        y = read_idx_gz(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"))[:n]
        return (x[:, None].astype(np.float32) / np.float32(255.0)), y.astype(np.int64)

    return (*part("train", n_train), *part("t10k", n_test))


def make_cnn(num_classes: int = 10) -> nn.Module:
    """Two 5x5 conv layers (32, 64) with ReLU and 2x2 max-pooling, 512 hidden, linear."""
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
    ).to(DT)


def get_flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            k = p.numel()
            p.copy_(flat[offset : offset + k].view_as(p))
            offset += k


def dp_fedavg_cnn(
    x: np.ndarray,
    y: np.ndarray,
    client_train: list[np.ndarray],
    init: np.ndarray,
    cohorts: list[np.ndarray],
    orders: Callable[[int, int], Iterator[np.ndarray]],
    noise: Callable[[int], np.ndarray],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    clip: float,
    z: float,
    denominator: float,
    server_lr: float = 1.0,
) -> tuple[np.ndarray, int, int]:
    """Run ``len(cohorts)`` rounds; returns (final flat model, clipped updates, updates).

    ``orders(t, i)`` yields client i's example order of each epoch in round t (a batch
    is the next ``batch_size`` of it, the last one shorter); ``noise(t)`` is the
    round's standard normal draw, one per coordinate."""
    model = make_cnn()
    xs, ys = torch.as_tensor(x, dtype=DT), torch.as_tensor(y)
    w = torch.as_tensor(init, dtype=DT).clone()
    clipped = updates = 0
    for t, cohort in enumerate(cohorts):
        total = torch.zeros_like(w)
        for i in (int(c) for c in cohort):
            set_flat(model, w)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            it = orders(t, i)
            for _ in range(epochs):
                order = next(it)
                for s in range(0, len(order), batch_size):
                    b = np.sort(order[s : s + batch_size])
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(xs[b]), ys[b]).backward()
                    opt.step()
            delta = get_flat(model) - w
            norm = float(delta.norm())
            if norm > clip:
                delta = delta * (clip / norm)
                clipped += 1
            updates += 1
            total += delta
        xi = torch.as_tensor(noise(t), dtype=DT)
        w = w + server_lr * (total + z * clip * xi) / denominator
    return w.numpy(), clipped, updates
