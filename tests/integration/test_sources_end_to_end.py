"""Each non-synthetic source trains end to end through simulate() on tiny generated files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from engine.config import load_config
from engine.simulation import simulate

COMMON = [
    "ray.executor=local",
    "rounds=2",
    "eval.every=1",
    "local.epochs=1",
    "local.batch_size=4",
    "privacy.noise_multiplier=1.0",
    "sampling.rate=0.5",
]


def _write_leaf(folder, users: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(u["y"]) for u in users.values()],
        "user_data": users,
    }
    (folder / "part.json").write_text(json.dumps(blob))


def test_shakespeare_char_lstm(tmp_path) -> None:
    rng = np.random.default_rng(0)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind "

    def user(k: int) -> dict:
        starts = rng.integers(0, len(text) - 10, size=6)
        return {
            "x": [(text * 3)[s : s + 8] for s in starts],
            "y": [(text * 3)[s + 8] for s in starts],
        }

    # 4 roles train; role4 is held out as the public test set (public_eval_clients=1).
    _write_leaf(tmp_path / "train", {f"role{k}": user(k) for k in range(5)})
    _write_leaf(tmp_path / "test", {f"role{k}": user(k) for k in range(2)})
    cfg = load_config(
        overrides=[
            *COMMON,
            "dataset.name=shakespeare",
            f"dataset.root={tmp_path}",
            "dataset.partition=natural",
            "dataset.num_clients=4",
            "dataset.public_eval_clients=1",
            "model.name=char_lstm",
        ]
    )
    res = simulate(cfg, write=False)
    assert len(res.rounds) == 2 and np.isfinite(res.weights).all()
    assert (res.rounds["eval_source"] == "public: 1 held-out writers/roles").all()
    assert 0.0 <= res.final_accuracy <= 1.0 and res.final_epsilon > 0


def _idx(path, arr: np.ndarray) -> None:
    magic = 0x0803 if arr.ndim == 3 else 0x0801
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape))
        f.write(arr.astype(np.uint8).tobytes())


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_mnist_layout_cnn(tmp_path, partition: str) -> None:
    rng = np.random.default_rng(1)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _idx(raw / "train-images-idx3-ubyte", rng.integers(0, 255, (60, 28, 28)))
    _idx(raw / "train-labels-idx1-ubyte", np.arange(60) % 10)
    _idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 255, (20, 28, 28)))
    _idx(raw / "t10k-labels-idx1-ubyte", np.arange(20) % 10)
    cfg = load_config(
        overrides=[
            *COMMON,
            "dataset.name=mnist",
            f"dataset.root={tmp_path}",
            f"dataset.partition={partition}",
            "dataset.alpha=1.0",
            "dataset.num_clients=6",
            "model.name=cnn",
        ]
    )
    res = simulate(cfg, write=False)
    assert res.rounds["test_accuracy"].notna().all()
    assert (res.rounds["eval_source"] == "public: official test split").all()
    assert len(res.weights) == 1_663_370  # the FedAvg CNN on 28x28x1, 10 classes
