"""The server: owns the global model, samples cohorts, privatises, accounts, evaluates.

Privacy (ALGORITHMS.md §0–1), for DP-FedAvg:

* Cohorts are drawn from the round's sampling stream: Poisson (each client with
  probability q; optionally truncated to ``max_cohort`` by a uniformly random subset)
  or fixed-size without replacement. The realised cohort size is private under
  Poisson sampling; it is never used as the denominator.
* The server receives only sums of clipped updates (sensitivity C per client), adds
  N(0, (zC)² I) once from the round's noise stream, divides by the public
  denominator (q·N or m), multiplies by the server learning rate and updates x.
* The accountant composes exactly one event per completed round; the ε recorded for
  round t is the cumulative ε after t rounds, computed by dp-accounting.

FedAvg (non-private) skips clipping and noise and divides by the realised cohort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms import build_pipeline
from engine import rng as rngs
from engine.client import (
    PartialSum,
    flatten_params,
    init_process_model,
    load_flat_,
    personal_mask,
    reduce_partials,
)
from engine.data.federated import FederatedDataset
from engine.evaluation import evaluate as evaluate_model
from engine.evaluation import membership_inference_auc
from engine.privacy.accounting import EpsilonTracker, SamplingSpec
from engine.privacy.mechanisms import privatize_sum


@dataclass(frozen=True)
class ServerSpec:
    seed: int
    model_name: str
    private: bool
    noise_multiplier: float
    clip_norm: float
    server_lr: float
    delta: float
    accountant: str
    sampling: SamplingSpec
    eval_every: int
    rounds: int
    num_threads: int = 1
    algorithm: str = "dp_fedavg"
    algo: Any = None  # engine.config.AlgoConfig
    local_lr: float = 0.1
    lr_decay: float = 1.0
    steps: int | None = None  # public K (PGN)
    membership_inference: bool = False


def sample_cohort(spec: SamplingSpec, seed: int, rnd: int) -> np.ndarray:
    """The sorted client ids of round ``rnd`` (from the round's own sampling stream)."""
    g = rngs.numpy_rng(seed, rngs.SAMPLING, rnd)
    n = spec.num_clients
    if spec.mode == "fixed":
        assert spec.cohort_size is not None
        return np.sort(g.choice(n, spec.cohort_size, replace=False)).astype(np.int64)
    assert spec.rate is not None
    cohort = np.flatnonzero(g.random(n) < spec.rate).astype(np.int64)
    if spec.max_cohort is not None and len(cohort) > spec.max_cohort:
        cohort = np.sort(g.choice(cohort, spec.max_cohort, replace=False)).astype(np.int64)
    return cohort


class Server:
    """Global model, noise, accounting and evaluation (a Ray actor or in process)."""

    def __init__(self, dataset: FederatedDataset, spec: ServerSpec) -> None:
        from engine.config import AlgoConfig

        self.dataset = dataset
        self.spec = spec
        self.model = init_process_model(spec.seed, spec.model_name, dataset, spec.num_threads)
        self.weights = flatten_params(self.model)  # float32 (d,)
        self.shapes = [tuple(p.shape) for p in self.model.parameters() if p.requires_grad]
        self.pipeline = build_pipeline(
            spec.algorithm, spec.algo or AlgoConfig(), spec.clip_norm, spec.noise_multiplier
        )
        self.head_mask = (
            personal_mask(self.model, self.pipeline.personal.layers)
            if self.pipeline.personal is not None
            else None
        )
        self.g_tilde: torch.Tensor | None = None  # PGN: previous noisy direction (public)
        self.tracker = (
            EpsilonTracker(spec.noise_multiplier, spec.sampling, spec.delta, spec.accountant)
            if spec.private
            else None
        )
        self.rounds_done = 0

    def dim(self) -> int:
        return int(self.weights.numel())

    def state_dict(self) -> dict:
        """Everything that evolves across rounds. RNG streams are keyed by (seed, round)
        and ε is a function of the rounds done, so this is the whole server state."""
        return {
            "weights": self.weights.numpy().copy(),
            "g_tilde": None if self.g_tilde is None else self.g_tilde.numpy().copy(),
            "rounds_done": self.rounds_done,
        }

    def load_state_dict(self, state: dict) -> None:
        self.weights = torch.from_numpy(np.array(state["weights"], dtype=np.float32))
        g = state.get("g_tilde")
        self.g_tilde = None if g is None else torch.from_numpy(np.array(g, dtype=np.float32))
        self.rounds_done = int(state["rounds_done"])

    def get_weights(self) -> np.ndarray:
        return self.weights.numpy().copy()

    def begin_round(self, rnd: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """Sample round ``rnd``'s cohort; return (cohort, global weights, public state)."""
        if rnd != self.rounds_done:
            raise RuntimeError(f"round {rnd} requested but {self.rounds_done} rounds are done")
        public = {"g_tilde": None if self.g_tilde is None else self.g_tilde.numpy()}
        return sample_cohort(self.spec.sampling, self.spec.seed, rnd), self.weights.numpy(), public

    def noise_support(self, rnd: int) -> torch.Tensor | None:
        """Where server noise goes: every released coordinate (not personal heads), or
        only the round's public rand-k mask. ``None`` means all coordinates."""
        pipe = self.pipeline
        support = None
        if self.head_mask is not None:
            support = (~self.head_mask).double()
        if pipe.privatizer is not None and pipe.privatizer.noise_support == "public_mask":
            rk = pipe.randk
            assert rk is not None
            mask = rk.mask(self.dim(), rngs.torch_gen(self.spec.seed, rngs.SERVER_PUBLIC, rnd))
            support = mask.double() if support is None else support * mask.double()
        return support

    def finish_round(self, rnd: int, *partials: PartialSum, evaluate: bool = True) -> dict:
        """Aggregate the shards' partial sums, privatise, post-process, update, account.

        With ``evaluate=False`` the executor evaluates the new model itself (spread
        over the workers) and fills ``test_accuracy``/``test_loss``.
        """
        spec, pipe = self.spec, self.pipeline
        total = reduce_partials(list(partials), self.dim())
        summed = torch.from_numpy(total.update_sum)
        priv = pipe.privatizer
        if priv is not None:
            server_noise = priv.site == "server"
            avg = privatize_sum(
                summed,
                noise_multiplier=spec.noise_multiplier if server_noise else 0.0,
                clip_norm=spec.clip_norm,
                denominator=spec.sampling.denominator,
                generator=rngs.torch_gen(spec.seed, rngs.NOISE, rnd),
                support=self.noise_support(rnd),
            )
        else:
            avg = summed / total.num_clients if total.num_clients else torch.zeros_like(summed)
        lr = spec.local_lr * spec.lr_decay**rnd
        ctx = {"shapes": self.shapes, "g_tilde": self.g_tilde, "steps": spec.steps, "lr": lr}
        for transform in pipe.server_transforms:
            avg = transform.apply(avg, ctx)
        if pipe.server_update is not None:  # PGN: g̃ ← −mean(Δ)/(ηK), x ← x − γ g̃
            k_lr = lr * float(spec.steps or 1)
            g_new = -avg / k_lr
            if pipe.server_update.smoothing is not None:
                g_new = pipe.server_update.smoothing.apply(g_new, ctx)
            self.g_tilde = g_new.to(torch.float32)
            self.weights = self.weights - (spec.server_lr * k_lr * g_new).to(torch.float32)
        else:
            self.weights = self.weights + (spec.server_lr * avg).to(torch.float32)
        self.rounds_done = rnd + 1
        n = total.num_clients
        row: dict = {
            "round": rnd + 1,
            "cohort_size": spec.sampling.denominator,
            "realised_cohort_size_nonprivate": n,
            "epsilon": self.tracker.epsilon(rnd + 1) if self.tracker else math.inf,
            "mean_update_norm_nonprivate": total.norm_sum / n if n else math.nan,
            "clipped_fraction_nonprivate": total.num_clipped / n if n else math.nan,
            "nonfinite_updates_nonprivate": total.num_nonfinite,
            "train_loss_nonprivate": (
                total.loss_sum / total.num_steps if total.num_steps else math.nan
            ),
            "max_clipped_norm_nonprivate": total.max_clipped_norm,
        }
        acc, loss, mia = math.nan, math.nan, math.nan
        if self.is_eval_round(rnd):
            load_flat_(self.model, self.weights)
            if evaluate:
                acc, loss = evaluate_model(self.model, self.dataset.x_test, self.dataset.y_test)
            if spec.membership_inference and rnd + 1 == spec.rounds:
                mia = membership_inference_auc(self.model, self.dataset, spec.seed)
        row["test_accuracy"], row["test_loss"] = acc, loss
        if spec.membership_inference:
            row["mia_auc"] = mia
        return row

    def is_eval_round(self, rnd: int) -> bool:
        return is_eval_round(rnd, self.spec.eval_every, self.spec.rounds)


def is_eval_round(rnd: int, every: int, rounds: int) -> bool:
    """Round ``rnd`` (0-based) is evaluated every ``every`` rounds and at the end."""
    return (rnd + 1) % every == 0 or rnd + 1 == rounds
