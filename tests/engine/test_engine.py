"""End-to-end properties of the round pipeline (in-process executor)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from engine.config import load_config
from engine.federated.client import ClientWorker
from engine.federated.worker_model import flatten_params, load_flat_
from engine.models import build_model
from engine.privacy import rng as rngs
from engine.privacy.accounting import SamplingSpec, compute_epsilon, default_delta
from engine.simulation import simulate

REQUIRED = {
    "round",
    "algorithm",
    "dataset",
    "seed",
    "test_accuracy",
    "test_loss",
    "epsilon",
    "delta",
    "noise_multiplier",
    "clip_norm",
    "sampling_rate",
    "cohort_size",
    "wall_time_s_nonprivate",
    "mean_update_norm_nonprivate",
    "clipped_fraction_nonprivate",
    "sampling",
    "adjacency",
    "accountant",
}


def test_rounds_columns_and_epsilon_from_accountant(small_overrides, tmp_path) -> None:
    cfg = load_config(
        overrides=[*small_overrides, "privacy.noise_multiplier=1.2", f"out={tmp_path}/run"]
    )
    res = simulate(cfg)
    df = pd.read_parquet(tmp_path / "run" / "rounds.parquet")
    assert REQUIRED <= set(df.columns)
    assert list(df["round"]) == [1, 2, 3]
    spec = SamplingSpec("poisson", 40, rate=0.25)
    delta = default_delta(40)
    for t, eps in zip(df["round"], df["epsilon"]):
        assert eps == pytest.approx(compute_epsilon(1.2, spec, int(t), delta), rel=1e-12)
    assert df["delta"].iloc[0] == pytest.approx(0.01 / 40)
    assert (df["cohort_size"] == 10.0).all()  # public denominator q·N, not the realised size
    pd.testing.assert_frame_equal(df, res.rounds)
    assert (tmp_path / "run" / "config.json").is_file()


def test_calibrated_run_meets_budget(small_overrides) -> None:
    cfg = load_config(overrides=[*small_overrides, "privacy.epsilon=2.5"])
    res = simulate(cfg, write=False)
    assert res.final_epsilon <= 2.5
    assert res.final_epsilon > 2.4  # calibration is tight, not wildly conservative
    assert res.privacy["target_epsilon"] == 2.5


def test_dp_fedavg_with_no_noise_and_no_clip_is_fedavg(small_overrides) -> None:
    common = [*small_overrides, "sampling.mode=fixed", "sampling.cohort_size=8", "rounds=3"]
    fedavg = simulate(load_config(overrides=[*common, "algorithm=fedavg"]), write=False)
    dp = simulate(
        load_config(
            overrides=[
                *common,
                "algorithm=dp_fedavg",
                "privacy.noise_multiplier=0",
                "privacy.clip_norm=.inf",
            ]
        ),
        write=False,
    )
    assert np.array_equal(fedavg.weights, dp.weights)  # bit for bit
    assert not np.array_equal(
        fedavg.weights,
        simulate(
            load_config(overrides=[*common, "algorithm=fedavg", "seed=1"]), write=False
        ).weights,
    )


def test_same_seed_same_result_other_seed_differs(small_overrides) -> None:
    base = [*small_overrides, "privacy.noise_multiplier=1.0"]
    a = simulate(load_config(overrides=base), write=False)
    b = simulate(load_config(overrides=base), write=False)
    c = simulate(load_config(overrides=[*base, "seed=5"]), write=False)
    assert np.array_equal(a.weights, b.weights)
    assert not np.array_equal(a.weights, c.weights)


def test_result_does_not_depend_on_client_order(small_overrides) -> None:
    """A client's update depends on (seed, round, client) only, not on what ran before."""
    cfg = load_config(overrides=small_overrides)
    from engine.simulation import make_executor, prepare

    prep = prepare(cfg)
    ex = make_executor(prep)
    worker: ClientWorker = ex.pool.worker
    w = ex.pool.server.get_weights()
    trainer = worker.one_by_one
    d1 = trainer.train_client(torch.from_numpy(w.copy()), 0, 3).local
    trainer.train_client(torch.from_numpy(w.copy()), 0, 7)  # disturb optimizer/model state
    d2 = trainer.train_client(torch.from_numpy(w.copy()), 0, 3).local
    assert torch.equal(d1, d2)


def test_empty_poisson_cohort_is_a_pure_noise_round(small_overrides) -> None:
    # q so small that the first rounds sample nobody: the model still moves (noise).
    cfg = load_config(
        overrides=[
            *small_overrides,
            "sampling.rate=0.001",
            "privacy.noise_multiplier=1.0",
            "rounds=2",
        ]
    )
    res = simulate(cfg, write=False)
    assert (res.rounds["realised_cohort_size_nonprivate"] == 0).all()
    assert np.isfinite(res.weights).all()
    assert (res.rounds["epsilon"] >= 0).all() and res.privacy["noise_multiplier"] == 1.0
    init = flatten_params(build_model("mlp", (12,), 10, rngs.torch_gen(0, rngs.MODEL_INIT)))
    step = res.weights - init.numpy()
    # two rounds of N(0, (zC/(qN))^2) per coordinate: std = sqrt(2) * 1 / 0.04
    assert np.std(step) == pytest.approx(math.sqrt(2) / 0.04, rel=0.05)


def test_nonfinite_update_is_zeroed_and_counted(small_overrides) -> None:
    cfg = load_config(
        overrides=[
            *small_overrides,
            "local.lr=1e30",
            "privacy.noise_multiplier=0",
            "rounds=1",
            "sampling.rate=1.0",
        ]
    )
    res = simulate(cfg, write=False)
    row = res.rounds.iloc[0]
    assert row["nonfinite_updates_nonprivate"] > 0
    assert np.isfinite(res.weights).all()


def test_crash_leaves_completed_rounds_readable(small_overrides, tmp_path, monkeypatch) -> None:
    from engine.federated import server as server_mod

    original = server_mod.Server.finish_round

    def flaky(self, rnd, *partials, **kwargs):
        if rnd == 2:
            raise RuntimeError("simulated crash")
        return original(self, rnd, *partials, **kwargs)

    monkeypatch.setattr(server_mod.Server, "finish_round", flaky)
    cfg = load_config(overrides=[*small_overrides, "rounds=5", f"out={tmp_path}/crash"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        simulate(cfg)
    df = pd.read_parquet(tmp_path / "crash" / "rounds.parquet")
    assert list(df["round"]) == [1, 2]


def test_load_flat_copies_instead_of_aliasing() -> None:
    model = build_model("logreg", (4,), 3, rngs.torch_gen(0, rngs.MODEL_INIT))
    flat = torch.zeros(15)
    load_flat_(model, flat)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.count_nonzero(flat) == 0


def test_dp_training_learns_on_synthetic() -> None:
    """A real private run learns the population's data: on the clients' own held-out
    splits (non-private, measured here by the test, never a run column) accuracy is
    well above chance (10 classes). Synthetic(α, β) clients share no labelling
    function (W_k's common offset u_k cancels in the argmax), so the public test set
    of unseen clients stays near chance and is not what this test measures."""
    from engine.federated.evaluation import evaluate
    from engine.simulation import prepare

    cfg = load_config(
        overrides=[
            "ray.executor=local",
            "rounds=30",
            "eval.every=30",
            "dataset.num_clients=600",
            "privacy.epsilon=8",
            "dataset.client_test_fraction=0.2",  # dp_fedavg's default is 0 (issue 28)
        ]
    )
    res = simulate(cfg, write=False)
    ds = prepare(cfg).dataset
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes)
    load_flat_(model, torch.from_numpy(res.weights))
    held = np.concatenate(ds.client_test)
    acc, _ = evaluate(model, ds.x_train[held], ds.y_train[held])
    assert acc > 0.25
    assert res.final_epsilon <= 8
    assert res.rounds["eval_source"].iloc[-1] == "public: 60 held-out clients"


@pytest.mark.parametrize(
    "algorithm", ["dp_fedavg", "dp2_fedsam", "dp_fedpgn", "dp_ftrl", "dp_bandmf"]
)
def test_resume_from_checkpoint_is_bit_identical(small_overrides, algorithm) -> None:
    cfg = load_config(
        overrides=[
            *small_overrides,
            "rounds=4",
            f"algorithm={algorithm}",
            "privacy.noise_multiplier=1.0",
        ]
    )
    full = simulate(cfg, write=False)
    saved: dict = {}

    def grab(row, executor):
        if row["round"] == 2:
            saved.update(executor.checkpoint())

    simulate(cfg, write=False, on_round=grab)
    resumed = simulate(cfg, write=False, resume=saved)
    assert np.array_equal(full.weights, resumed.weights)
    assert list(resumed.rounds["round"]) == [3, 4]
    cols = [c for c in full.rounds.columns if c != "wall_time_s_nonprivate"]
    pd.testing.assert_frame_equal(
        full.rounds[cols].iloc[2:].reset_index(drop=True), resumed.rounds[cols]
    )


@pytest.mark.parametrize(
    "momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-2), (0.5, 5e-3)]
)
def test_local_sgd_is_torch_sgd_bit_for_bit(momentum: float, weight_decay: float) -> None:
    """The workers' optimizer (engine.federated.client.LocalSGD, which avoids torch.optim's
    import of torch._dynamo) must step exactly like torch.optim.SGD."""
    from engine.federated.local_training import LocalSGD

    gen = torch.Generator().manual_seed(5)
    ref = build_model("cnn", (1, 8, 8), 3, torch.Generator().manual_seed(1))
    ours = build_model("cnn", (1, 8, 8), 3, torch.Generator().manual_seed(1))
    opt_ref = torch.optim.SGD(
        ref.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay
    )
    opt = LocalSGD(list(ours.parameters()), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for _ in range(5):
        x = torch.randn(4, 1, 8, 8, generator=gen)
        y = torch.randint(0, 3, (4,), generator=gen)
        opt_ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        grads = torch.autograd.grad(
            torch.nn.functional.cross_entropy(ours(x), y), list(ours.parameters())
        )
        opt.step(list(grads))
    assert torch.equal(flatten_params(ours), flatten_params(ref))
    assert not torch.equal(flatten_params(ours), flatten_params(build_model(
        "cnn", (1, 8, 8), 3, torch.Generator().manual_seed(1)
    )))  # fmt: skip
