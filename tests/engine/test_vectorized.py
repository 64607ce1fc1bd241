"""Vectorised client groups (engine.federated.vectorized) equal one-by-one training.

Each test trains the same shard with ``clients_per_batch=1`` (``OneByOneTrainer.train_client`` per
client, the reference) and with groups of 4 (divides the 12-client shard) and 5
(groups 5, 5, 2), on ragged clients: one with no examples, several with fewer
examples than one batch, the rest with different numbers of steps and a short last
batch.

Tolerance: the float32 local models differ only by the rounding of batched kernels
(bmm / grouped convolution sum in another order than mm / conv); over the few local
steps here the largest observed difference of ``update_sum`` (a float64 sum of 12
clipped updates of norm <= C) is ~3e-7. We assert ``rtol=1e-4, atol=1e-5`` (30x that
margin), and every test also checks that the piece under test changes the result by
far more than that (> 1e-3), so a vectorised path that ignored it would fail. Integer
diagnostics (clients, steps, clipped, non-finite) must be equal exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from algorithms import build_pipeline
from engine.config import AlgoConfig, load_config
from engine.data.federated import FederatedDataset
from engine.federated.client import ClientWorker, LocalSpec, PartialSum
from engine.simulation import simulate

RTOL, ATOL = 1e-4, 1e-5
# 12 clients: empty, below one batch (1, 2, 3), exact batches (4, 8), ragged (5..13).
SIZES = (0, 2, 5, 9, 13, 1, 8, 11, 3, 6, 4, 10)
BATCH = 4
CLIENTS = np.arange(len(SIZES))
SHAPES = {"mlp": (10,), "cnn": (1, 8, 8)}


def make_dataset(model: str, seed: int = 0) -> FederatedDataset:
    shape = SHAPES[model]
    g = np.random.default_rng(seed)
    n = sum(SIZES)
    x = g.normal(size=(n, *shape)).astype(np.float32)
    y = g.integers(0, 3, n).astype(np.int64)
    bounds = np.cumsum((0, *SIZES))
    train = [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:])]
    empty = [np.zeros(0, np.int64) for _ in SIZES]
    return FederatedDataset("toy", x, y, train, empty, x[:4], y[:4], 3, shape)


_DATASETS: dict[str, FederatedDataset] = {}


def dataset(model: str) -> FederatedDataset:
    if model not in _DATASETS:
        _DATASETS[model] = make_dataset(model)
    return _DATASETS[model]


def make_spec(model: str, algorithm: str, group: int | None, **kw) -> LocalSpec:
    base = dict(
        seed=3,
        model_name=model,
        epochs=2,
        batch_size=BATCH,
        lr=0.2,
        lr_decay=0.9,
        momentum=0.0,
        weight_decay=0.0,
        denominator=6.0,
        clients_per_batch=group,
    )
    algo, clip = kw.pop("algo", AlgoConfig()), kw.pop("clip_norm", 0.6)
    base.update(kw)
    pipeline = build_pipeline(algorithm, algo, clip, 1.0, model)
    return LocalSpec(**base, pipeline=pipeline)


def g_tilde(model: str, scale: float = 0.5) -> np.ndarray:
    d = ClientWorker(dataset(model), make_spec(model, "dp_fedavg", 1)).ping()
    return (np.random.default_rng(7).normal(size=d) * scale / math.sqrt(d)).astype(np.float32)


def train(model: str, algorithm: str, group: int | None, public=None, rnd: int = 1, **kw):
    worker = ClientWorker(dataset(model), make_spec(model, algorithm, group, **kw))
    if group is not None and group > 1:
        assert worker.vectorized is not None, worker.vectorized_note
        assert worker.clients_per_batch == group
    w0 = torch.cat([p.detach().reshape(-1) for p in worker.params]).numpy()
    return worker.train_shard(w0, rnd, CLIENTS, public)


def assert_same(vec: PartialSum, seq: PartialSum, swaps: int = 0) -> None:
    """Equal to tolerance; ``swaps`` coordinates may differ (top-k ties, see below)."""
    assert vec.num_clients == seq.num_clients == len(SIZES)
    assert vec.num_steps == seq.num_steps
    assert vec.num_clipped == seq.num_clipped
    assert vec.num_nonfinite == seq.num_nonfinite
    assert vec.update_sum.dtype == np.float64
    bad = ~np.isclose(vec.update_sum, seq.update_sum, rtol=RTOL, atol=ATOL)
    assert bad.sum() <= swaps
    np.testing.assert_allclose(vec.update_sum[~bad], seq.update_sum[~bad], rtol=RTOL, atol=ATOL)
    assert vec.norm_sum == pytest.approx(seq.norm_sum, rel=RTOL, abs=ATOL)
    assert vec.loss_sum == pytest.approx(seq.loss_sum, rel=RTOL, abs=ATOL, nan_ok=True)
    assert vec.max_clipped_norm == pytest.approx(seq.max_clipped_norm, rel=RTOL, abs=ATOL)


def far(a: PartialSum, b: PartialSum) -> bool:
    return float(np.abs(a.update_sum - b.update_sum).max()) > 1e-3


# (id, algorithm, extra LocalSpec fields, public state: None or "g")
CASES = [
    ("dp_fedavg", "dp_fedavg", {}, None),
    ("sam", "dp_fedsam", {"algo": AlgoConfig(asam=False, rho=0.1)}, None),
    ("asam", "dp_fedsam", {"algo": AlgoConfig(asam=True)}, None),
    ("pgn", "dp_fedpgn", {"steps": 3}, "g"),
    ("blur", "dp_fedavg_blur", {"algo": AlgoConfig(blur_lambda=2.0), "clip_norm": 0.3}, None),
    ("fed_ls", "dp_fed_ls", {"clip_norm": 0.3}, None),
    ("topk", "fedsmp_topk", {"algo": AlgoConfig(keep_fraction=0.2)}, None),
]
_SEQ: dict[tuple, PartialSum] = {}


def sequential(model: str, case_id: str) -> PartialSum:
    key = (model, case_id)
    if key not in _SEQ:
        _, alg, kw, pub = next(c for c in CASES if c[0] == case_id)
        public = {"g_tilde": g_tilde(model)} if pub == "g" else None
        _SEQ[key] = train(model, alg, 1, public, **kw)
    return _SEQ[key]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("group", [4, 5])
def test_groups_equal_one_by_one(model, case, group) -> None:
    case_id, alg, kw, pub = case
    public = {"g_tilde": g_tilde(model)} if pub == "g" else None
    seq = sequential(model, case_id)
    vec = train(model, alg, group, public, **kw)
    # Top-k is discontinuous: two coordinates of a client's Δ whose magnitudes tie at
    # the k-th place within float rounding (~3e-8 here) can swap, so a few entries of
    # the sum may differ by one kept coordinate; allow 2 per client.
    assert_same(vec, seq, swaps=2 * len(SIZES) if case_id == "topk" else 0)
    # The setting exercises what it claims: some clients clipped, some not ...
    if case_id in ("dp_fedavg", "sam", "asam", "topk"):
        assert 0 < seq.num_clipped < seq.num_clients - 1
    # ... and the piece under test changes the result by far more than the tolerance.
    if case_id != "dp_fedavg":
        assert far(seq, train(model, "dp_fedavg", 1, None, **{**kw, "algo": AlgoConfig()}))
    if case_id == "asam":
        assert far(seq, sequential(model, "sam"))


def test_pgn_without_g_tilde() -> None:
    """Round 0 of DP-FedPGN: no public g̃ yet (plain gradients scaled by β)."""
    seq = train("mlp", "dp_fedpgn", 1, None, steps=3)
    vec = train("mlp", "dp_fedpgn", 4, None, steps=3)
    assert_same(vec, seq)
    assert far(seq, train("mlp", "dp_fedpgn", 1, {"g_tilde": g_tilde("mlp")}, steps=3))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_momentum_and_weight_decay_follow_torch_sgd(model) -> None:
    kw = {"momentum": 0.9, "weight_decay": 0.01, "epochs": 3}
    seq = train(model, "dp_fedavg", 1, **kw)
    assert_same(train(model, "dp_fedavg", 5, **kw), seq)
    assert far(seq, sequential(model, "dp_fedavg"))


@pytest.mark.parametrize(
    "algorithm,extra",
    [
        ("dp_fedavg_blur_lus", {"algo": AlgoConfig(zero_fraction=0.5)}),
        ("fedsmp_randk", {"algo": AlgoConfig(keep_fraction=0.3)}),
        ("dp_fedavg", {"algo": AlgoConfig(noise_site="client")}),
        ("fedavg", {"clip_norm": math.inf}),
    ],
)
def test_client_transforms_and_client_noise_after_groups(algorithm, extra) -> None:
    seq = train("mlp", algorithm, 1, **extra)
    assert_same(train("mlp", algorithm, 5, **extra), seq)
    assert far(seq, sequential("mlp", "dp_fedavg"))


def test_nonfinite_updates_are_zeroed_and_counted_alike() -> None:
    kw = {"lr": 1e25, "clip_norm": 1.0}
    seq = train("mlp", "dp_fedavg", 1, **kw)
    vec = train("mlp", "dp_fedavg", 4, **kw)
    assert seq.num_nonfinite > 0
    assert_same(vec, seq)


def test_group_of_whole_shard_and_client_order() -> None:
    seq = sequential("mlp", "sam")
    vec = train("mlp", "dp_fedsam", len(SIZES), None, algo=AlgoConfig(asam=False, rho=0.1))
    assert_same(vec, seq)


def test_personal_heads_fall_back_to_one_by_one_exactly() -> None:
    """DP²-FedSAM is never vectorised: the result is bit-identical to one by one."""
    spec = make_spec("mlp", "dp2_fedsam", 4)
    worker = ClientWorker(dataset("mlp"), spec)
    assert worker.vectorized is None and worker.clients_per_batch == 1
    assert "personal" in worker.vectorized_note
    ref = ClientWorker(dataset("mlp"), dataclasses.replace(spec, clients_per_batch=1))
    w0 = torch.cat([p.detach().reshape(-1) for p in ref.params]).numpy()
    for rnd in range(2):  # the second round uses the stored personal heads
        a = worker.train_shard(w0, rnd, CLIENTS)
        b = ref.train_shard(w0, rnd, CLIENTS)
        assert np.array_equal(a.update_sum, b.update_sum)
        assert dataclasses.astuple(a)[1:] == dataclasses.astuple(b)[1:]


def test_failed_probe_falls_back_to_one_by_one(monkeypatch) -> None:
    import engine.federated.group_training as vz

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no batching rule")

    monkeypatch.setattr(vz, "vmap", broken)
    worker = ClientWorker(dataset("mlp"), make_spec("mlp", "dp_fedavg", 4))
    assert calls and worker.vectorized is None and worker.clients_per_batch == 1
    assert "no batching rule" in worker.vectorized_note
    w0 = torch.cat([p.detach().reshape(-1) for p in worker.params]).numpy()
    for rnd in range(2):  # decided once at start: no further probes
        worker.train_shard(w0, rnd, CLIENTS)
    assert len(calls) == 1


def test_automatic_group_size(monkeypatch) -> None:
    import engine.federated.vectorized as vz

    # cnn (189k parameters here) measured slower vectorised on the CPU: one by one,
    # decided without a probe. (Under plain SGD it takes the dense-head trainer,
    # engine.federated.head_training, also one by one: SAM's steps here.)
    cnn = ClientWorker(dataset("cnn"), make_spec("cnn", "dp_fedsam", None))
    assert cnn.clients_per_batch == 1 and cnn.vectorized is None
    assert "one by one on the CPU" in cnn.vectorized_note
    # A small model: large groups, but a group under CPU_MIN_GROUP trains one by one,
    # so this 12-client shard gives exactly the sequential result. (Dense models under
    # plain SGD are trained by engine.federated.dense_training: switched off here, to
    # test the vmap choice that every other small model gets.)
    monkeypatch.setenv("DPFL_DENSE_STEPS", "0")
    spec = make_spec("logreg", "dp_fedavg", None)
    auto = ClientWorker(dataset("mlp"), spec)
    ref = ClientWorker(dataset("mlp"), dataclasses.replace(spec, clients_per_batch=1))
    w0 = torch.cat([p.detach().reshape(-1) for p in ref.params]).numpy()
    a, b = auto.train_shard(w0, 0, CLIENTS), ref.train_shard(w0, 0, CLIENTS)
    assert np.array_equal(a.update_sum, b.update_sum)
    # The decision is deferred to the first shard that could use a group: none yet
    # (no probe, no torch.func import at worker start); made on demand it is the same.
    assert auto.vectorized is None and "until a shard" in auto.vectorized_note
    auto.trainer.decide()
    assert auto.vectorized is not None
    assert auto.clients_per_batch >= len(SIZES) and auto.min_group == vz.CPU_MIN_GROUP
    c = auto.train_shard(w0, 0, CLIENTS)
    assert np.array_equal(c.update_sum, b.update_sum)
    # With a lower threshold the same shard is one vectorised group.
    monkeypatch.setattr(vz, "CPU_MIN_GROUP", 4)
    grouped = ClientWorker(dataset("mlp"), spec)
    grouped.trainer.decide()
    groups = []
    train_group = grouped.vectorized.train_group
    monkeypatch.setattr(
        grouped.vectorized,
        "train_group",
        lambda g, r, cs, p: groups.append(cs) or train_group(g, r, cs, p),
    )
    assert_same(grouped.train_shard(w0, 0, CLIENTS), b)
    assert groups == [list(CLIENTS)]


def test_simulate_with_groups_matches_one_by_one(small_overrides) -> None:
    base = [*small_overrides, "privacy.noise_multiplier=1.0", "local.epochs=2"]
    one = simulate(load_config(overrides=[*base, "ray.clients_per_worker_batch=1"]), write=False)
    four = simulate(load_config(overrides=[*base, "ray.clients_per_worker_batch=4"]), write=False)
    np.testing.assert_allclose(four.weights, one.weights, rtol=RTOL, atol=ATOL)
    assert four.final_accuracy == one.final_accuracy
    cols = ["cohort_size", "epsilon", "clipped_fraction_nonprivate"]
    assert four.rounds[cols].equals(one.rounds[cols])
    assert not np.array_equal(
        one.weights,
        simulate(
            load_config(overrides=[*base, "ray.clients_per_worker_batch=1", "seed=9"]), write=False
        ).weights,
    )


# ---------------------------------------------------------------- memory format


def client_gradients(model: torch.nn.Module, ds: FederatedDataset) -> list[torch.Tensor]:
    """Each non-empty client's full-batch loss gradient, flattened, in ``model``'s dtype."""
    dtype = next(model.parameters()).dtype
    grads = []
    for idx in ds.client_train:
        if len(idx) == 0:
            continue
        model.zero_grad()
        x = torch.from_numpy(ds.x_train[idx]).to(dtype)
        torch.nn.functional.cross_entropy(model(x), torch.from_numpy(ds.y_train[idx])).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return grads


@pytest.mark.parametrize("algorithm", ["dp_fedavg", "dp_fedsam"])
def test_channels_last_trains_the_same_clients(algorithm: str) -> None:
    """model.memory_format changes only the kernels' layout (vectorised groups use
    stacked contiguous parameters and never see it; one by one does).

    The maths is compared in float64, where the two layouts' kernels agree to rounding
    (measured: 7e-16 relative on every client's gradient). In float32 they do not
    always: a max-pooling window whose entries tie in float32 routes the gradient to
    a different, equally valid, entry (measured: one client of this toy shard differs
    by 6e-3 in its first gradient), and local training amplifies that by an amount
    that depends on the CPU's kernels (float32 shard sums differed by 1e-3 on one
    machine and 7e-2 on another), so float32 training is compared only in what the
    layout cannot change: clients and steps.
    """
    ref_worker = ClientWorker(dataset("cnn"), make_spec("cnn", algorithm, 1))
    worker = ClientWorker(dataset("cnn"), make_spec("cnn", algorithm, 1, memory_format="auto"))
    conv = [m for m in worker.model.modules() if isinstance(m, torch.nn.Conv2d)][-1]  # C_in > 1
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    x = torch.from_numpy(dataset("cnn").x_train)
    with torch.no_grad():
        torch.testing.assert_close(worker.model(x), ref_worker.model(x), rtol=1e-5, atol=1e-6)

    # The same model in both layouts, in float64 (``.to(dtype)`` keeps the layout).
    wide = copy.deepcopy(worker.model).to(torch.float64)
    wide_ref = copy.deepcopy(ref_worker.model).to(torch.float64)
    assert [p.is_contiguous() for p in wide.parameters()] == [
        p.is_contiguous() for p in worker.model.parameters()
    ]
    other = copy.deepcopy(
        ClientWorker(dataset("cnn"), make_spec("cnn", algorithm, 1, seed=4)).model
    ).to(torch.float64)
    got = client_gradients(wide, dataset("cnn"))
    ref = client_gradients(wide_ref, dataset("cnn"))
    far_off = client_gradients(other, dataset("cnn"))
    assert len(got) == len(ref) == int(np.count_nonzero(SIZES))
    for g, r, o in zip(got, ref, far_off):
        assert float((g - r).norm() / r.norm()) < 1e-10
        assert float((o - r).norm() / r.norm()) > 1e-2  # another init: the check can fail

    w0 = torch.cat([p.detach().reshape(-1) for p in worker.params]).numpy()
    trained = worker.train_shard(w0, 1, CLIENTS, None)
    ref_trained = ref_worker.train_shard(w0, 1, CLIENTS, None)
    assert (trained.num_clients, trained.num_steps) == (
        ref_trained.num_clients,
        ref_trained.num_steps,
    )
    assert np.isfinite(trained.update_sum).all() and trained.num_nonfinite == 0


def test_auto_memory_format_leaves_models_without_convolutions_contiguous() -> None:
    worker = ClientWorker(dataset("mlp"), make_spec("mlp", "dp_fedavg", 1, memory_format="auto"))
    assert all(p.is_contiguous() for p in worker.params)
    with pytest.raises(ValueError, match="model.memory_format"):
        load_config(overrides=["model.memory_format=nhwc"])


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["dp_fedavg", "dp_fedsam"])
def test_gpu_groups_of_a_conv_model_match_one_by_one(algorithm) -> None:
    """On a GPU the probe accepts the conv model and groups match one-by-one training.

    Before TF32 was switched off in GPU workers (engine.federated.client.configure_cuda_numerics)
    every conv model failed the probe on the GPU and trained one client at a time.
    GPU kernels (cuDNN's algorithms, grouped convolutions) round differently from one
    another, so the tolerance is on the relative norm of the summed clipped update:
    1e-3, where a group that dropped or mixed up a client is off by O(1/12).
    """
    ds = dataset("cnn")

    def run(group: int) -> tuple[ClientWorker, PartialSum]:
        worker = ClientWorker(ds, make_spec("cnn", algorithm, group, device="cuda"))
        w0 = torch.cat([p.detach().reshape(-1) for p in worker.params]).cpu().numpy()
        return worker, worker.train_shard(w0, 1, CLIENTS)

    one_worker, one = run(1)
    group_worker, grouped = run(4)
    assert one_worker.device.type == "cuda"
    assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.matmul.allow_tf32
    assert group_worker.vectorized is not None, group_worker.vectorized_note
    assert grouped.num_steps == one.num_steps and grouped.num_clipped == one.num_clipped
    err = np.linalg.norm(grouped.update_sum - one.update_sum)
    assert err <= 1e-3 * np.linalg.norm(one.update_sum)
