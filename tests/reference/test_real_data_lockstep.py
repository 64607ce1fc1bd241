"""Lock-step parity on real data: dpfl's dp_fedavg CNN on Fashion-MNIST images against
the independent loop of ``cnn_reference.py`` (issue 28).

Both get the same real images (the first 240 Fashion-MNIST training images, pixels in
[0, 1], 20 clients of 12, so each client's second batch is short), the same initial
model, cohorts, minibatch orders and noise draws (read from dpfl's seeded streams), and
must end at the same global model after 20 rounds to float tolerance (dpfl trains in
float32, the reference in float64). Clipping is active (C = 0.2 lies inside the range of
update norms, so some updates are scaled and some pass) and noise is on (z is small,
0.002, so that with five clients of a 1.66M-parameter model the noise does not swamp
training; it is still drawn and added on every coordinate). Skipped where Debian's
``dataset-fashion-mnist`` is not installed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine.config import config_from_dict
from engine.data.federated import FederatedDataset
from engine.data.torchvision_sources import FASHION_MNIST_ROOT
from engine.federated.server import sample_cohort
from engine.federated.worker_model import flatten_params, init_process_model
from engine.privacy import rng as rngs
from engine.simulation import prepare, simulate
from tests.reference.cnn_reference import dp_fedavg_cnn, load_fashion_mnist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.path.isfile(os.path.join(FASHION_MNIST_ROOT, "train-images-idx3-ubyte.gz")),
        reason=f"Fashion-MNIST not under {FASHION_MNIST_ROOT} "
        "(apt-get install dataset-fashion-mnist)",
    ),
]

SEED, CLIENTS, PER_CLIENT, ROUNDS = 5, 20, 12, 20
SETTING = {"epochs": 1, "batch_size": 10, "lr": 0.05, "clip": 0.2, "z": 0.002}


def _dataset() -> FederatedDataset:
    x, y, xt, yt = load_fashion_mnist(FASHION_MNIST_ROOT, CLIENTS * PER_CLIENT, 100)
    train = [np.arange(k * PER_CLIENT, (k + 1) * PER_CLIENT) for k in range(CLIENTS)]
    return FederatedDataset(
        name="fashion_mnist",
        x_train=x,
        y_train=y,
        client_train=train,
        client_test=[np.zeros(0, dtype=np.int64) for _ in range(CLIENTS)],
        x_test=xt,
        y_test=yt,
        num_classes=10,
        input_shape=(1, 28, 28),
    )


def _config():
    return config_from_dict(
        {
            "algorithm": "dp_fedavg",
            "seed": SEED,
            "rounds": ROUNDS,
            "dataset": {"num_clients": CLIENTS},
            "model": {"name": "cnn", "memory_format": "contiguous"},
            "sampling": {"rate": 0.25},
            "local": {
                "epochs": SETTING["epochs"],
                "batch_size": SETTING["batch_size"],
                "lr": SETTING["lr"],
            },
            "privacy": {
                "noise_multiplier": SETTING["z"],
                "clip_norm": SETTING["clip"],
                "delta": 1e-4,
            },
            "eval": {"every": ROUNDS},
            "ray": {"executor": "local", "num_workers": 2, "clients_per_worker_batch": 1},
        }
    )


def test_dp_fedavg_cnn_on_fashion_mnist_matches_independent_loop() -> None:
    ds, cfg = _dataset(), _config()
    prep = prepare(cfg, ds)
    init = flatten_params(init_process_model(SEED, "cnn", ds, 1)).double().numpy()
    cohorts = [sample_cohort(prep.plan.sampling, SEED, t) for t in range(ROUNDS)]
    d = init.size

    def orders(t: int, i: int):
        gen = rngs.torch_gen(SEED, rngs.CLIENT_DATA, t, i)
        idx = np.asarray(ds.client_train[i])
        while True:
            yield idx[torch.randperm(len(idx), generator=gen).numpy()]

    def noise(t: int) -> np.ndarray:
        g = rngs.torch_gen(SEED, rngs.NOISE, t)
        return torch.randn(d, generator=g, dtype=torch.float64).numpy()

    ref, clipped, updates = dp_fedavg_cnn(
        ds.x_train,
        ds.y_train,
        [np.asarray(c) for c in ds.client_train],
        init,
        cohorts,
        orders,
        noise,
        denominator=prep.plan.sampling.denominator,
        **SETTING,
    )
    got = np.asarray(simulate(cfg, write=False, dataset=ds).weights, dtype=np.float64)

    assert 0 < clipped < updates, (clipped, updates)  # the clip path and the pass path
    moved = float(np.abs(ref - init).max())
    err = float(np.abs(got - ref).max())
    assert moved > 1e-2  # the model trained; the comparison is not of two inits
    assert err < 1e-4, f"max |dpfl - reference| = {err:.3g} (the model moved by {moved:.3g})"
    # relative to how far training moved it, the two final models agree to 1e-4
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref - init) < 1e-4
