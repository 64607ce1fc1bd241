"""Membership-inference AUC: an oracle check and the end-to-end column."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.config import load_config
from engine.federated.evaluation import auc_lower_is_member
from engine.simulation import simulate


def test_auc_matches_pairwise_oracle() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        m = rng.integers(0, 5, size=rng.integers(1, 15)).astype(float)
        n = rng.integers(0, 5, size=rng.integers(1, 15)).astype(float)
        pairs = list(itertools.product(m, n))
        oracle = np.mean([1.0 if b > a else 0.5 if a == b else 0.0 for a, b in pairs])
        assert auc_lower_is_member(m, n) == pytest.approx(oracle, abs=1e-12)
    assert auc_lower_is_member(np.zeros(3), np.ones(3)) == 1.0
    assert auc_lower_is_member(np.ones(3), np.ones(3)) == 0.5


def test_membership_inference_column() -> None:
    cfg = load_config(
        overrides=[
            "ray.executor=local",
            "rounds=3",
            "eval.every=1",
            "dataset.num_clients=40",
            "dataset.synthetic_mean_samples=20",
            "eval.membership_inference=true",
            "algorithm=fedavg",
            "sampling.rate=0.5",
            "local.epochs=5",
        ]
    )
    df = simulate(cfg, write=False).rounds
    assert df["mia_auc_nonprivate"].iloc[:-1].isna().all()
    auc = df["mia_auc_nonprivate"].iloc[-1]
    assert 0.0 <= auc <= 1.0


def test_sliced_evaluation_adds_up_to_whole() -> None:
    """Per-worker slices of the test set combine to the single-pass accuracy and loss."""
    import numpy as np
    import torch

    from engine.federated.evaluation import combine_sums, eval_slices, evaluate, evaluate_sums
    from engine.models import build_model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1003, 12)).astype(np.float32)
    y = rng.integers(0, 5, size=1003).astype(np.int64)
    model = build_model("mlp", (12,), 5, torch.Generator().manual_seed(0))
    acc, loss = evaluate(model, x, y)
    for parts in (1, 2, 3, 7):
        slices = eval_slices(len(y), parts)
        assert slices[0][0] == 0 and slices[-1][1] == len(y)
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
        sums = [evaluate_sums(model, x[a:b], y[a:b]) for a, b in slices]
        acc_k, loss_k = combine_sums(sums)
        assert acc_k == acc
        assert abs(loss_k - loss) < 1e-6 * max(1.0, loss)
