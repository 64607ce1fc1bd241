"""A body and a dense head (engine.federated.head_training): the cnn's local SGD with its
first dense layer's steps as factors equals one-by-one autograd training to float32
rounding, and the trainer is chosen exactly where it applies.

The oracle is the one-by-one trainer of the same worker (autograd), computed in the
same test. Tolerance: rtol 1e-4, atol 1e-5, as tests/engine/test_dense_training.py
(the largest difference seen here is 4.5e-8, on updates of up to 0.2); each comparison
also checks that the steps move the model by far more than that (a trainer that
ignored them would fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import engine.federated.head_training as head_training
from engine.config import load_config
from engine.data.federated import FederatedDataset
from engine.federated.client import ClientWorker
from engine.federated.dense_steps import ENV
from engine.federated.dense_training import DenseSGDTrainer
from engine.federated.head_training import DenseHeadSGDTrainer, split_dense_head
from engine.simulation import simulate

# the toy clients (empty, below one batch, exact batches, ragged), their spec and the
# worker's start, as the dense trainer's tests use them; images of 1×8×8 for the cnn
from tests.engine.test_dense_training import ATOL, CLIENTS, RTOL, SIZES, spec, start
from tests.engine.test_dense_training import dataset as toy_dataset


def dataset() -> FederatedDataset:
    return toy_dataset(shape=(1, 8, 8))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("rnd", [0, 2])
@pytest.mark.parametrize("kw", [{}, {"steps": 3}], ids=["epochs", "fixed-steps"])
@pytest.mark.parametrize("group,max_rows", [(8, 20), (5, 20), (1, 20), (8, 3)])
def test_head_trainer_equals_one_by_one(layout, rnd, kw, group, max_rows, monkeypatch) -> None:
    """DenseHeadSGDTrainer (the automatic choice for the cnn under plain SGD on the CPU)
    gives each client the update, local model, loss and step count of one-by-one
    autograd training, to float32 rounding: ragged clients (an empty one, some below
    one batch), two epochs or fixed steps, a decayed learning rate, both memory
    layouts, clients in lockstep groups of 8 (the default), 5 or 1, and the clients
    with more rows than MAX_ROWS handed to the one-by-one trainer (at 20 rows, the 11-
    and 13-example clients over two epochs; at 3, all but the one-example client, so
    that the one-by-one trainer runs in its group before that client's Δ is formed)."""
    monkeypatch.setattr(head_training, "MAX_ROWS", max_rows)
    monkeypatch.setattr(head_training, "GROUP", group)
    handed: list[int] = []
    worker = ClientWorker(dataset(), spec("cnn", memory_format=layout, **kw))
    assert isinstance(worker.trainer, DenseHeadSGDTrainer), worker.vectorized_note
    base_train_client = worker.one_by_one.train_client

    def counted(global_flat, r, client, public=None):
        handed.append(client)
        return base_train_client(global_flat, r, client, public)

    monkeypatch.setattr(worker.one_by_one, "train_client", counted)
    w0 = start(worker)
    g0 = torch.from_numpy(w0)
    got = list(worker.trainer.train(g0, rnd, CLIENTS, {}))
    rows = {
        int(c): sum(len(b) for b in worker.one_by_one.batches(rnd, int(c), kw.get("steps"), 2))
        for c in CLIENTS
    }
    over = [c for c, r in rows.items() if r > max_rows]
    assert handed == over  # in order
    assert over or (kw and max_rows == 20)  # some, except 3 steps of at most 4 rows
    assert len(over) < len(CLIENTS) - 1  # and some clients factored
    handed.clear()
    want = list(worker.one_by_one.train(g0, rnd, CLIENTS, {}))
    assert [r.client for r in got] == list(CLIENTS)
    moved = 0.0
    for a, b in zip(got, want):
        assert a.steps == b.steps
        # computed directly, except for the clients handed to the one-by-one trainer
        assert (a.delta is None) == (a.client in over)
        delta = a.delta if a.delta is not None else a.local - g0
        np.testing.assert_allclose(delta, b.local - g0, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(a.local, b.local, rtol=RTOL, atol=ATOL)
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=RTOL, abs=ATOL)
        moved = max(moved, float((b.local - g0).abs().max()))
    assert moved > 1e-2  # the steps move the model far beyond the tolerance
    # the worker's partial sums (clipped, in float64) agree likewise
    fast = worker.train_shard(w0, rnd, CLIENTS)
    worker.trainer = worker.one_by_one
    slow = worker.train_shard(w0, rnd, CLIENTS)
    np.testing.assert_allclose(fast.update_sum, slow.update_sum, rtol=RTOL, atol=ATOL)
    assert (fast.num_clipped, fast.num_steps, fast.num_clients) == (
        slow.num_clipped,
        slow.num_steps,
        slow.num_clients,
    )
    assert slow.num_clipped > 0  # the clip is exercised


@pytest.mark.parametrize("head", ["one-layer", "no-bias"])
def test_head_trainer_on_other_heads(head) -> None:
    """Heads other than the cnn's: one dense layer (its output is the logits, no layer
    stepped after it) and a first dense layer without a bias; the trainer built on the
    one-by-one trainer of such a model equals it to float32 rounding."""
    from engine.federated.local_training import OneByOneTrainer

    torch.manual_seed(0)
    if head == "one-layer":
        layers = [nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(108, 3)]
    else:
        layers = [nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
        layers += [nn.Linear(27, 5, bias=False), nn.ReLU(), nn.Linear(5, 3)]
    model = nn.Sequential(*layers)
    base = OneByOneTrainer(dataset(), spec("cnn"), model, torch.device("cpu"))
    trainer = DenseHeadSGDTrainer(base)
    g0 = torch.cat([p.detach().reshape(-1) for p in base.params])
    got = list(trainer.train(g0, 1, CLIENTS, {}))
    want = list(base.train(g0, 1, CLIENTS, {}))
    moved = 0.0
    for a, b in zip(got, want):
        assert a.delta is not None and a.steps == b.steps
        np.testing.assert_allclose(a.delta, b.local - g0, rtol=RTOL, atol=ATOL)
        moved = max(moved, float((b.local - g0).abs().max()))
    assert moved > 1e-2


def test_head_trainer_leaves_the_global_model_alone() -> None:
    """The round's global vector is read, never written (its first dense layer's weight
    is used in place by every client), and each client's update is its own tensor."""
    worker = ClientWorker(dataset(), spec("cnn"))
    g0 = torch.from_numpy(start(worker))
    before = g0.clone()
    got = list(worker.trainer.train(g0, 0, CLIENTS, {}))
    assert torch.equal(g0, before)
    ptrs = {r.delta.data_ptr() for r in got if r.steps > 0}
    assert len(ptrs) == sum(1 for s in SIZES if s > 0)


@pytest.mark.parametrize(
    "algorithm,kw,group,model",
    [
        ("dp2_fedsam", {}, None, "cnn"),  # its personal head
        ("dp_fedsam", {}, None, "cnn"),  # a step rule other than plain SGD
        ("dp_fedavg_blur", {}, None, "cnn"),  # a regularizer
        ("dp_fedavg", {"momentum": 0.5}, None, "cnn"),
        ("dp_fed_ls", {}, None, "cnn"),  # its ball constraint
        ("dp_fedavg", {}, 1, "cnn"),  # one by one asked for
        ("dp_fedavg", {}, 4, "cnn"),  # groups asked for
        ("dp_fedavg", {}, None, "mlp"),  # a dense model: DenseSGDTrainer
    ],
)
def test_head_trainer_only_where_it_applies(algorithm, kw, group, model) -> None:
    worker = ClientWorker(dataset(), spec(model, algorithm, group, **kw))
    assert not isinstance(worker.trainer, DenseHeadSGDTrainer)
    if model == "mlp":
        assert isinstance(worker.trainer, DenseSGDTrainer)


def test_switch_off_trains_the_cnn_through_autograd(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0")
    worker = ClientWorker(dataset(), spec("cnn"))
    assert worker.trainer is worker.one_by_one


def test_split_dense_head_recognises_a_body_then_dense_layers() -> None:
    def params(m: nn.Module) -> list[torch.Tensor]:
        return [p for p in m.parameters() if p.requires_grad]

    def cnn() -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(1, 2, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(18, 4),
            nn.ReLU(),
            nn.Linear(4, 3),
        )

    model = cnn()
    split = split_dense_head(model, params(model))
    assert split is not None and split[0] == 2
    assert split[1].weights[0] is model[3].weight
    no_body = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    not_dense = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(18, 4), nn.Tanh())
    no_flatten = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    with_buffers = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(18, 3)
    )
    for other in (no_body, not_dense, no_flatten, with_buffers):
        assert split_dense_head(other, params(other)) is None
    frozen = cnn()
    frozen[0].bias.requires_grad_(False)
    assert split_dense_head(frozen, params(frozen)) is None


DIGITS_CNN = [
    "dataset.name=digits",
    "dataset.num_clients=20",
    "model.name=cnn",
    "local.lr=0.05",
    "local.epochs=2",
    "privacy.noise_multiplier=1.0",
]


@pytest.mark.parametrize("layout", ["auto", "contiguous"])
def test_simulate_with_head_training_matches_autograd(small_overrides, monkeypatch, layout) -> None:
    """A whole run on real 8×8 digits (automatic trainer) against the same run through
    autograd: the same cohorts, ε and clipping counts; models equal to float32
    rounding."""
    base = [*small_overrides, *DIGITS_CNN, f"model.memory_format={layout}"]
    calls: list[int] = []
    train = DenseHeadSGDTrainer.train

    def counted(self, *args):
        calls.append(1)
        return train(self, *args)

    monkeypatch.setattr(DenseHeadSGDTrainer, "train", counted)
    fast = simulate(load_config(overrides=base), write=False)
    assert calls  # the fast run trained on the head trainer
    monkeypatch.setenv(ENV, "0")
    calls.clear()
    slow = simulate(load_config(overrides=base), write=False)
    assert not calls
    np.testing.assert_allclose(fast.weights, slow.weights, rtol=RTOL, atol=ATOL)
    moved = np.abs(slow.weights - simulate_start(base)).max()
    assert moved > 1e-2
    cols = ["cohort_size", "epsilon", "clipped_fraction_nonprivate"]
    assert fast.rounds[cols].equals(slow.rounds[cols])
    assert fast.final_accuracy == pytest.approx(slow.final_accuracy, abs=0.01)


def simulate_start(overrides: list[str]) -> np.ndarray:
    """The run's initial weights: every process builds them from (seed, MODEL_INIT)
    alone (engine.federated.worker_model.init_process_model); digits are 1×8×8, 10
    classes."""
    from types import SimpleNamespace

    from engine.federated.worker_model import flatten_params, init_process_model

    cfg = load_config(overrides=overrides)
    shape = SimpleNamespace(input_shape=(1, 8, 8), num_classes=10)
    model = init_process_model(cfg.seed, cfg.model.name, shape, 1)  # type: ignore[arg-type]
    return flatten_params(model).numpy()
