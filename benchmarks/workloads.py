"""The benchmarks' fixed workloads and their data.

Workloads (``--quick`` shrinks each to seconds: 200 clients with ~20 examples, q = 0.25,
4 rounds, z = 0.3 so that four rounds visibly learn, 12×12 images for ``cnn``):

* ``cnn``: MNIST-shaped (1×28×28, 10 classes) synthetic data generated here (class
  templates + noise + random shifts; offline), 500 clients with ~60 training examples
  each, the FedAvg CNN, Poisson q = 0.1 (expected cohort 50), 1 local epoch of batch 10,
  lr 0.05, C = 1, z = 1, 20 rounds, evaluation once at the end.
* ``logreg``: the engine's Synthetic(1, 1) data, 1000 clients, q = 0.05 (cohort 50),
  logistic regression, 1 local epoch of batch 10, lr 0.2, C = 1, z = 1, 20 rounds.
* ``resnet18_gn``: CIFAR-shaped (3×32×32) synthetic data, GN-ResNet-18. The plain loop
  uses CUDA when available; dpfl then gets ``ray.num_gpus_per_worker = 1/W`` and the
  device its workers actually trained on is reported. Small on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.streams import DATA, numpy_stream
from engine.config import load_config
from engine.data import build_dataset
from engine.data.federated import FederatedDataset


@dataclass(frozen=True)
class Workload:
    """One fixed benchmark workload: data, model, cohort, local steps, clip and noise."""

    name: str
    model: str
    data: str  # "templates" (generated here) or "synthetic" (engine's generator)
    config_dataset: str  # dataset.name given to dpfl (the data object is passed in)
    num_clients: int
    mean_samples: int  # average training examples per client
    input_shape: tuple[int, ...]
    num_classes: int
    test_size: int
    rate: float  # Poisson sampling rate q
    rounds: int
    epochs: int
    batch_size: int
    lr: float
    clip_norm: float
    noise_multiplier: float
    seed: int = 0
    gpu: bool = False  # use CUDA in both when available


WORKLOADS: dict[str, Workload] = {
    "cnn": Workload(
        name="cnn",
        model="cnn",
        data="templates",
        config_dataset="mnist",
        num_clients=500,
        mean_samples=60,
        input_shape=(1, 28, 28),
        num_classes=10,
        test_size=2000,
        rate=0.1,
        rounds=20,
        epochs=1,
        batch_size=10,
        lr=0.05,
        clip_norm=1.0,
        noise_multiplier=1.0,
    ),
    "logreg": Workload(
        name="logreg",
        model="logreg",
        data="synthetic",
        config_dataset="synthetic",
        num_clients=1000,
        mean_samples=60,
        input_shape=(60,),
        num_classes=10,
        test_size=0,  # the engine's public set: dataset.public_eval_clients held-out clients
        rate=0.05,
        rounds=20,
        epochs=1,
        batch_size=10,
        lr=0.2,
        clip_norm=1.0,
        noise_multiplier=1.0,
    ),
    "resnet18_gn": Workload(
        name="resnet18_gn",
        model="resnet18_gn",
        data="templates",
        config_dataset="cifar10",
        num_clients=100,
        mean_samples=40,
        input_shape=(3, 32, 32),
        num_classes=10,
        test_size=1000,
        rate=0.1,
        rounds=5,
        epochs=1,
        batch_size=16,
        lr=0.05,
        clip_norm=1.0,
        noise_multiplier=1.0,
        gpu=True,
    ),
    # pfl-research's CIFAR-10 cross-device benchmark shape: 1,000 clients of 50
    # images, 50 per round (Poisson, expected 50), 1 local epoch of batch 10, lr 0.1.
    "cifar10_pfl": Workload(
        name="cifar10_pfl",
        model="cnn",
        data="templates",
        config_dataset="cifar10",
        num_clients=1000,
        mean_samples=50,
        input_shape=(3, 32, 32),
        num_classes=10,
        test_size=2000,
        rate=0.05,
        rounds=100,
        epochs=1,
        batch_size=10,
        lr=0.1,
        clip_norm=1.0,
        noise_multiplier=1.0,
        gpu=True,
    ),
}

RESNET_CPU = {"num_clients": 20, "mean_samples": 24, "rate": 0.25, "rounds": 2, "test_size": 200}


def workload_for(
    name: str, cuda: bool, quick: bool = False, rounds: int | None = None
) -> tuple[Workload, bool]:
    """Workload ``name`` as a benchmark runs it, and whether it uses the GPU: a GPU
    workload without CUDA at its small CPU sizes (:data:`RESNET_CPU`), ``quick``'s
    tiny sizes (:func:`quick_variant`), then ``rounds`` when given."""
    w = WORKLOADS[name]
    gpu = w.gpu and cuda
    if w.gpu and not cuda:
        w = dataclasses.replace(w, **RESNET_CPU)
    if quick:
        w = quick_variant(w)
    if rounds is not None:
        w = dataclasses.replace(w, rounds=rounds)
    return w, gpu


def quick_variant(w: Workload) -> Workload:
    """Tiny sizes for CI (seconds per side on 2 cores). The noise multiplier is lowered
    to 0.3 (in both sides) so that four rounds visibly learn."""
    small: dict[str, Any] = {
        "num_clients": 200,
        "mean_samples": 20,
        "rate": 0.25,
        "rounds": 4,
        "noise_multiplier": 0.3,
    }
    if w.data == "templates":
        small["test_size"] = 400
        small["lr"] = 0.2
        if w.model == "cnn":
            small["input_shape"] = (1, 12, 12)
        else:
            small.update(input_shape=(w.input_shape[0], 8, 8), num_clients=16, mean_samples=8)
    return dataclasses.replace(w, **small)


def make_template_data(w: Workload, sizes_given: np.ndarray | None = None) -> FederatedDataset:
    """Learnable image data: per-class smooth random templates, a random shift of up to
    2 pixels, per-example contrast and pixel noise; IID clients with 0.5–1.5× the mean
    number of examples (or ``sizes_given``); a separate test set. Deterministic in
    ``w.seed``."""
    rng = numpy_stream(w.seed, DATA)
    c, h, wd = w.input_shape
    coarse = rng.normal(0.0, 1.0, (w.num_classes, c, max(2, h // 4), max(2, wd // 4)))
    shared = rng.normal(0.0, 1.0, (1, c, max(2, h // 4), max(2, wd // 4)))
    coarse = 0.6 * shared + 0.8 * coarse  # classes share structure: not linearly trivial
    ry, rx = -(-h // coarse.shape[2]), -(-wd // coarse.shape[3])
    templates = np.kron(coarse, np.ones((1, 1, ry, rx)))[:, :, :h, :wd]
    sizes = rng.integers(w.mean_samples // 2, w.mean_samples * 3 // 2 + 1, w.num_clients)
    if sizes_given is not None:  # drawn above all the same: the stream is unchanged
        sizes = np.asarray(sizes_given, dtype=np.int64)
    n_train = int(sizes.sum())

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, w.num_classes, n)
        x = templates[y] * rng.uniform(0.5, 1.5, (n, 1, 1, 1))
        shifts = rng.integers(-2, 3, (n, 2))
        for s in np.unique(shifts, axis=0):
            m = (shifts == s).all(1)
            x[m] = np.roll(x[m], (int(s[0]), int(s[1])), axis=(2, 3))
        x = x + rng.normal(0.0, 1.5, x.shape)
        return x.astype(np.float32), y.astype(np.int64)

    x_train, y_train = draw(n_train)
    x_test, y_test = draw(w.test_size)
    mu, sd = x_train.mean(), x_train.std() + 1e-6
    x_train = ((x_train - mu) / sd).astype(np.float32)
    x_test = ((x_test - mu) / sd).astype(np.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    client_train = [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(len(sizes))]
    return FederatedDataset(
        name=f"{w.name}-templates",
        x_train=x_train,
        y_train=y_train,
        client_train=client_train,
        client_test=[np.zeros(0, np.int64) for _ in client_train],
        x_test=x_test,
        y_test=y_test,
        num_classes=w.num_classes,
        input_shape=tuple(w.input_shape),
        meta={"partition": "iid", "generator": "benchmarks/bench.py templates"},
    )


def make_dataset(w: Workload) -> FederatedDataset:
    """The workload's federated dataset (the same object is used by both sides)."""
    if w.data == "templates":
        return make_template_data(w)
    cfg = load_config(
        overrides=[
            "dataset.name=synthetic",
            f"dataset.num_clients={w.num_clients}",
            f"dataset.synthetic_mean_samples={w.mean_samples}",
            f"dataset.synthetic_dim={w.input_shape[0]}",
            f"dataset.synthetic_classes={w.num_classes}",
            f"seed={w.seed}",
        ]
    )
    # The stream engine.simulation.prepare() uses: (seed, DATA).
    return build_dataset(cfg.dataset, numpy_stream(w.seed, DATA))
