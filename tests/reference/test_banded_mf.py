"""Reference parity for DP-BandMF (issue 32): ``dpfl run`` of ``dp_bandmf`` (in process)
equals the independent reference of ``tests/reference/banded_mf.py`` (dense C⁻¹Z) with
the same cohorts, minibatch orders, noise rows and strategy; without the correlation
(independent noise, C = I) the reference moves far from dpfl."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.config import config_from_dict
from engine.federated.server import sample_cohort
from engine.federated.worker_model import flatten_params, init_process_model
from engine.privacy import rng as rngs
from engine.privacy.banded_mf import strategy
from engine.simulation import prepare, simulate
from tests.reference.banded_mf import run_dp_bandmf
from tests.reference.common import make_problem, shapes
from tests.reference.dpfl_side import SEED, dataset
from tests.reference.methods import Setting

TOL = 1e-5
MOVES = 1e-3
PROB = make_problem()  # 12 clients


def _config(s: Setting, m: int, bands: int, momentum: float):
    return config_from_dict(
        {
            "algorithm": "dp_bandmf",
            "seed": SEED,
            "rounds": s.rounds,
            "dataset": {"num_clients": len(PROB.client_train)},
            "model": {"name": s.model, "memory_format": "contiguous"},
            "sampling": {"mode": "fixed", "cohort_size": m},
            "local": {"epochs": s.epochs, "batch_size": s.batch_size, "lr": s.lr},
            "algo": {"server_momentum": momentum, "bands": bands},
            "server": {"lr": s.server_lr},
            "eval": {"every": s.rounds},
            "privacy": {"noise_multiplier": s.z, "clip_norm": s.clip, "delta": 5e-4},
            "ray": {"executor": "local", "num_workers": 2, "clients_per_worker_batch": 1},
        }
    )


def test_dp_bandmf_matches_the_reference() -> None:
    s = Setting("dp_bandmf", rounds=7, lr=0.3, clip=0.2, z=0.5, server_lr=0.5)
    m, bands, momentum = 3, 3, 0.8  # 3 groups of 4 clients
    cfg = _config(s, m, bands, momentum)
    spec = prepare(cfg, dataset(PROB)).plan.sampling
    assert spec.mode == "bands" and spec.bands == bands
    s.denominator = spec.denominator
    ours = np.asarray(simulate(cfg, write=False, dataset=dataset(PROB)).weights, np.float64)
    d = sum(math.prod(t) for t in shapes(s.model, PROB.dim, PROB.num_classes))
    flat0 = flatten_params(init_process_model(SEED, s.model, dataset(PROB), 1)).double().numpy()
    init, o = [], 0
    for shp in shapes(s.model, PROB.dim, PROB.num_classes):
        init.append(flat0[o : o + math.prod(shp)].reshape(shp))
        o += math.prod(shp)
    cohorts = [sample_cohort(spec, SEED, t) for t in range(s.rounds)]
    for t in range(s.rounds - bands + 1):  # b-min-separation: no client twice in b rounds
        window = np.concatenate(cohorts[t : t + bands])
        assert len(np.unique(window)) == len(window)

    def orders(t: int, i: int):
        idx = PROB.client_train[i]
        gen = rngs.torch_gen(SEED, rngs.CLIENT_DATA, t, i)
        while True:
            yield idx[torch.randperm(len(idx), generator=gen).numpy()]

    def noise(t: int) -> np.ndarray:
        return rngs.SeededStream(SEED, (rngs.NOISE, t)).standard_normal(d)

    c = np.array(strategy(s.rounds, bands))
    ref = run_dp_bandmf(s, PROB, init, cohorts, orders, noise, c, momentum)
    assert np.max(np.abs(ours - ref)) < TOL
    independent = run_dp_bandmf(s, PROB, init, cohorts, orders, noise, np.eye(s.rounds), momentum)
    assert np.max(np.abs(ours - independent)) > MOVES
