"""Reference parity for DP-FTRL (issue 32): dpfl's tree-aggregation noise and DP-FTRLM
server step equal the independent reference of ``tests/reference/tree_aggregation.py``.

* The online estimator: dpfl's incremental stack (``OnlineTreeNoise``) against the
  dyadic decomposition of [1, t] written from the paper, for the same node draws.
* End to end: ``dpfl run`` of ``dp_ftrl`` (in process, two shards) against the
  reference's local training + DP-FTRLM, with the same cohorts, minibatch orders and
  noise (read from dpfl's seeded streams), over more than one epoch (so the restart is
  exercised and the last epoch is partial). Ablations in the reference only (no
  momentum, no restart, independent per-round noise) must move the model by far more
  than the tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from algorithms.pieces.correlated_noise import TreeAggregationPrivatizer, TreeFTRL
from engine.config import config_from_dict
from engine.federated.server import sample_cohort
from engine.federated.worker_model import flatten_params, init_process_model
from engine.privacy import rng as rngs
from engine.privacy.tree_aggregation import OnlineTreeNoise, epoch_cohort
from engine.simulation import prepare, simulate
from tests.reference.common import make_problem, shapes
from tests.reference.dpfl_side import SEED, dataset
from tests.reference.methods import Setting
from tests.reference.tree_aggregation import dyadic_nodes, node_span, prefix_noise, run_dp_ftrl

TOL = 1e-5  # dpfl trains in float32, the reference in float64
MOVES = 1e-3
PROB = make_problem()  # 12 clients


def test_dyadic_decomposition_covers_the_prefix_once() -> None:
    for t in range(1, 70):
        covered = []
        for k, j in dyadic_nodes(t):
            first, last = node_span(k, j)
            covered += list(range(first, last + 1))
        assert covered == list(range(1, t + 1))
        assert len(dyadic_nodes(t)) == bin(t).count("1")


def test_online_noise_equals_the_dyadic_sum() -> None:
    """dpfl's stack gives, after each leaf t, the sum of the decomposition's nodes,
    where the node ending at leaf e is the draw dpfl made at leaf e."""
    g = torch.Generator().manual_seed(5)
    draws = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(45)]
    tree = OnlineTreeNoise()
    for t in range(1, 46):
        got = tree.advance(draws[t - 1])
        want = prefix_noise(t, lambda k, j: draws[node_span(k, j)[1] - 1])
        assert torch.allclose(got, want, rtol=0, atol=1e-12), t
        assert len(tree.stack) == bin(t).count("1")


def _config(s: Setting, m: int, momentum: float):
    return config_from_dict(
        {
            "algorithm": "dp_ftrl",
            "seed": SEED,
            "rounds": s.rounds,
            "dataset": {"num_clients": len(PROB.client_train)},
            "model": {"name": s.model, "memory_format": "contiguous"},
            "sampling": {"mode": "fixed", "cohort_size": m},
            "local": {"epochs": s.epochs, "batch_size": s.batch_size, "lr": s.lr},
            "algo": {"server_momentum": momentum},
            "server": {"lr": s.server_lr},
            "eval": {"every": s.rounds},
            "privacy": {"noise_multiplier": s.z, "clip_norm": s.clip, "delta": 5e-4},
            "ray": {"executor": "local", "num_workers": 2, "clients_per_worker_batch": 1},
        }
    )


def _reference(s: Setting, m: int, momentum: float, **ablate) -> tuple[np.ndarray, list]:
    prep = prepare(_config(s, m, momentum), dataset(PROB))
    spec = prep.plan.sampling
    assert spec.mode == "epochs" and spec.denominator == m
    s.denominator = spec.denominator
    d = sum(math.prod(t) for t in shapes(s.model, PROB.dim, PROB.num_classes))
    flat0 = flatten_params(init_process_model(SEED, s.model, dataset(PROB), 1)).double().numpy()
    init, o = [], 0
    for shp in shapes(s.model, PROB.dim, PROB.num_classes):
        init.append(flat0[o : o + math.prod(shp)].reshape(shp))
        o += math.prod(shp)
    cohorts = [sample_cohort(spec, SEED, t) for t in range(s.rounds)]

    def orders(t: int, i: int):
        idx = PROB.client_train[i]
        gen = rngs.torch_gen(SEED, rngs.CLIENT_DATA, t, i)
        while True:
            yield idx[torch.randperm(len(idx), generator=gen).numpy()]

    def noise(t: int) -> np.ndarray:
        return rngs.SeededStream(SEED, (rngs.NOISE, t)).standard_normal(d)

    w = run_dp_ftrl(
        s, PROB, init, cohorts, orders, noise, spec.rounds_per_epoch, momentum, **ablate
    )
    return w, cohorts


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_dp_ftrl_matches_the_reference(momentum: float) -> None:
    s = Setting("dp_ftrl", rounds=7, lr=0.3, clip=0.2, z=0.5, server_lr=0.5)
    # 12 clients, m = 4: R = 3 rounds per epoch (not a power of two: with R = 2^k and
    # γ = 0 a restart would change nothing); 7 rounds = two epochs and a partial one
    m = 4
    res = simulate(_config(s, m, momentum), write=False, dataset=dataset(PROB))
    ours = np.asarray(res.weights, dtype=np.float64)
    ref, cohorts = _reference(s, m, momentum)
    assert np.max(np.abs(ours - ref)) < TOL
    # participation: each client at most once per epoch, cohorts of m
    for e in range(3):
        block = cohorts[e * 3 : e * 3 + 3]
        members = np.concatenate(block)
        assert all(len(c) == m for c in block)
        assert len(np.unique(members)) == len(members)
    assert list(res.rounds["epoch"]) == [0, 0, 0, 1, 1, 1, 2]
    # the ingredients matter: without them the reference moves far from dpfl
    if momentum > 0:
        no_momentum, _ = _reference(s, m, 0.0)
        assert np.max(np.abs(ours - no_momentum)) > MOVES
    no_restart, _ = _reference(s, m, momentum, restart=False)
    assert np.max(np.abs(ours - no_restart)) > MOVES


def test_noise_enters_as_tree_noise_not_per_round() -> None:
    """With the same draws, independent per-round noise (DP-FedAvg's, summed as the
    FTRL iterate would see it) differs from the tree's: the parity above is not a
    coincidence of summing every round's noise. At leaf t = 3 the tree adds the nodes
    [1, 2] and [3] (2 draws), the independent sum adds 3 draws."""
    g = torch.Generator().manual_seed(1)
    draws = [torch.randn(6, generator=g, dtype=torch.float64) for _ in range(3)]
    tree = OnlineTreeNoise()
    got = [tree.advance(n) for n in draws][-1]
    assert torch.allclose(got, draws[1] + draws[2], atol=1e-12)
    assert (got - sum(draws)).abs().max() > 0.1


def test_server_state_survives_a_checkpoint() -> None:
    """A TreeFTRL restored from its state_dict mid-epoch continues bit for bit."""
    priv = TreeAggregationPrivatizer(1.0, 0.7, 0.9)
    g = torch.Generator().manual_seed(2)
    sums = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(11)]
    nodes = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(11)]

    def play(opt: TreeFTRL, w: torch.Tensor, rounds: range) -> torch.Tensor:
        for r in rounds:
            w = opt.step(r, sums[r], w, nodes[r])
        return w

    w0 = torch.zeros(5, dtype=torch.float32)
    straight = play(TreeFTRL(priv, 4, 3.0, 0.5), w0, range(11))
    first = TreeFTRL(priv, 4, 3.0, 0.5)
    mid = play(first, w0, range(6))
    again = TreeFTRL(priv, 4, 3.0, 0.5)
    again.load_state_dict(first.state_dict())
    assert torch.equal(play(again, mid, range(6, 11)), straight)


def test_epoch_cohorts_are_disjoint_passes() -> None:
    n, m = 23, 5  # R = 4, 3 clients sit each epoch out
    for e in range(3):
        block = [epoch_cohort(7, e * 4 + p, n, m) for p in range(4)]
        members = np.concatenate(block)
        assert all(len(b) == m for b in block)
        assert len(np.unique(members)) == 20
    assert not np.array_equal(epoch_cohort(7, 0, n, m), epoch_cohort(7, 4, n, m))
