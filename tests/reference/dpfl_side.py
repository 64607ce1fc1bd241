"""The dpfl side of the parity tests: run dpfl in process and read its public randomness.

This module (unlike ``common.py`` and ``methods.py``) imports dpfl: it runs
``engine.simulation.simulate`` with ``ray.executor=local`` and reads, from the same
seeded streams dpfl draws from (``engine.privacy.rng``,
``engine.federated.server.sample_cohort``), the
cohorts, minibatch orders, noise draws and rand-k masks, to hand them to the reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from engine.config import config_from_dict
from engine.data.federated import FederatedDataset
from engine.federated.server import sample_cohort
from engine.federated.worker_model import flatten_params, init_process_model
from engine.privacy import rng as rngs
from engine.simulation import prepare, simulate
from tests.reference.common import Problem, shapes
from tests.reference.methods import PRIVATE, Setting

SEED = 3
RATE = 0.4


def dataset(prob: Problem) -> FederatedDataset:
    return FederatedDataset(
        name="synthetic",
        x_train=prob.x,
        y_train=prob.y,
        client_train=prob.client_train,
        client_test=prob.client_test,
        x_test=prob.x_test,
        y_test=prob.y_test,
        num_classes=prob.num_classes,
        input_shape=(prob.dim,),
    )


def config_for(
    s: Setting,
    prob: Problem,
    fixed_cohort: int | None = None,
    batch: int | None = 1,
    rate: float = RATE,
):
    """The dpfl RunConfig matching reference setting ``s``."""
    algo = {k: getattr(s, k) for k in ("rho", "asam", "beta", "sigma_ls", "ls_scope", "topk_site")}
    # The reference's one `sparsity` is LUS's zeroed fraction or the others' kept one.
    algo["zero_fraction" if "lus" in s.method else "keep_fraction"] = s.sparsity
    algo.update(
        randk_rescale=s.randk_rescale,
        noise_site=s.noise_site,
        blur_lambda=s.blur_lambda,
        head_steps=s.head_steps,
        body_steps=s.body_steps,
    )
    if algo["topk_site"] == "paper":
        algo["topk_site"] = "server"
    sampling = (
        {"mode": "fixed", "cohort_size": fixed_cohort}
        if fixed_cohort is not None
        else {"rate": rate}
    )
    data = {
        "algorithm": s.method,
        "seed": SEED,
        "rounds": s.rounds,
        "dataset": {"num_clients": len(prob.client_train)},
        "model": {"name": s.model, "memory_format": "contiguous"},
        "sampling": sampling,
        "local": {
            "epochs": s.epochs,
            "steps": s.steps,
            "batch_size": s.batch_size,
            "lr": s.lr,
            "lr_decay": s.lr_decay,
            "momentum": s.momentum,
            "weight_decay": s.weight_decay,
        },
        "algo": algo,
        "server": {"lr": s.server_lr},
        "eval": {"every": s.rounds},
        "ray": {"executor": "local", "num_workers": 2, "clients_per_worker_batch": batch},
    }
    if s.method in PRIVATE:
        data["privacy"] = {"noise_multiplier": s.z, "clip_norm": s.clip, "delta": 5e-4}
        if s.clip_mode == "adaptive":
            data["privacy"].update(
                clip_mode="adaptive",
                target_quantile=s.target_quantile,
                clip_lr=s.clip_lr,
                clip_count_stddev=s.count_stddev,
            )
    return config_from_dict(data)


def run_dpfl(
    s: Setting,
    prob: Problem,
    fixed_cohort: int | None = None,
    batch: int | None = 1,
    rate: float = RATE,
    info: dict | None = None,
) -> tuple[np.ndarray, dict]:
    """dpfl's final global model and its per-client state (personal heads). ``info``
    receives the worker's vectorised group size (``group``), why (``note``) and the
    released rows (``rows``)."""
    cfg = config_for(s, prob, fixed_cohort, batch, rate)
    states: list[dict] = []

    def on_round(row: dict, executor) -> None:
        if info is not None:
            info.setdefault("rows", []).append(dict(row))
            info["group"] = executor.pool.worker.clients_per_batch
            info["note"] = executor.pool.worker.vectorized_note

    res = simulate(
        cfg,
        write=False,
        dataset=dataset(prob),
        on_checkpoint=lambda st, r: states.append(st),
        on_round=on_round,
    )
    return np.asarray(res.weights, dtype=np.float64), states[-1].get("clients", {})


class Streams:
    """dpfl's public randomness for setting ``s``, in the reference's input form."""

    def __init__(
        self, s: Setting, prob: Problem, fixed_cohort: int | None = None, rate: float = RATE
    ) -> None:
        cfg = config_for(s, prob, fixed_cohort, rate=rate)
        self.prep = prepare(cfg, dataset(prob))
        self.s, self.prob = s, prob
        self.d = sum(math.prod(t) for t in shapes(s.model, prob.dim, prob.num_classes))
        model = init_process_model(SEED, s.model, dataset(prob), 1)
        flat0 = flatten_params(model).double().numpy()
        self.init, o = [], 0
        for shp in shapes(s.model, prob.dim, prob.num_classes):
            n = math.prod(shp)
            self.init.append(flat0[o : o + n].reshape(shp))
            o += n
        self.cohorts = [sample_cohort(self.prep.plan.sampling, SEED, t) for t in range(s.rounds)]
        self.denominator = self.prep.plan.sampling.denominator

    def setting(self) -> Setting:
        """``s`` completed with what dpfl resolved: the public denominator."""
        s = self.s
        s.denominator = self.denominator if s.method in PRIVATE else None
        return s

    def orders(self, t: int, i: int) -> Iterator[np.ndarray]:
        idx = self.prob.client_train[i]
        gen = rngs.torch_gen(SEED, rngs.CLIENT_DATA, t, i)
        while True:
            yield idx[torch.randperm(len(idx), generator=gen).numpy()]

    def noise(self, t: int) -> np.ndarray:
        return rngs.SeededStream(SEED, (rngs.NOISE, t)).standard_normal(self.d)

    def count_noise(self, t: int) -> float:
        """The standard normal draw behind adaptive clipping's released count."""
        return float(rngs.SeededStream(SEED, (rngs.CLIP_COUNT, t)).standard_normal(1)[0])

    def client_noise(self, t: int, i: int) -> np.ndarray:
        """Client i's own noise draws under ``algo.noise_site=client``."""
        return rngs.SeededStream(SEED, (rngs.NOISE, t, i + 1)).standard_normal(self.d)

    def randk_mask(self, t: int) -> np.ndarray:
        k = max(1, min(self.d, round(self.s.sparsity * self.d)))
        g = rngs.torch_gen(SEED, rngs.SERVER_PUBLIC, t)
        mask = np.zeros(self.d, dtype=bool)
        mask[torch.randperm(self.d, generator=g)[:k].numpy()] = True
        return mask
