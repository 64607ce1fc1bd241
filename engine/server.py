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

import numpy as np
import torch
from torch import nn

from engine import rng as rngs
from engine.client import (
    PartialSum,
    flatten_params,
    init_process_model,
    load_flat_,
    reduce_partials,
)
from engine.data.federated import FederatedDataset
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


@torch.no_grad()
def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 2048
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    model.eval()
    correct, loss, n = 0, 0.0, len(y)
    for s in range(0, n, batch_size):
        xb = torch.from_numpy(np.array(x[s : s + batch_size]))
        yb = torch.from_numpy(np.array(y[s : s + batch_size]))
        out = model(xb)
        loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train()
    return (correct / n, loss / n) if n else (math.nan, math.nan)


class Server:
    """Global model, noise, accounting and evaluation (a Ray actor or in process)."""

    def __init__(self, dataset: FederatedDataset, spec: ServerSpec) -> None:
        self.dataset = dataset
        self.spec = spec
        self.model = init_process_model(spec.seed, spec.model_name, dataset, spec.num_threads)
        self.weights = flatten_params(self.model)  # float32 (d,)
        self.tracker = (
            EpsilonTracker(spec.noise_multiplier, spec.sampling, spec.delta, spec.accountant)
            if spec.private
            else None
        )
        self.rounds_done = 0

    def dim(self) -> int:
        return int(self.weights.numel())

    def get_weights(self) -> np.ndarray:
        return self.weights.numpy().copy()

    def begin_round(self, rnd: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample round ``rnd``'s cohort; return (cohort, global weights)."""
        if rnd != self.rounds_done:
            raise RuntimeError(f"round {rnd} requested but {self.rounds_done} rounds are done")
        return sample_cohort(self.spec.sampling, self.spec.seed, rnd), self.weights.numpy()

    def finish_round(self, rnd: int, *partials: PartialSum) -> dict:
        """Aggregate the shards' partial sums, privatise, update, account, evaluate."""
        spec = self.spec
        total = reduce_partials(list(partials), self.dim())
        summed = torch.from_numpy(total.update_sum)
        if spec.private:
            avg = privatize_sum(
                summed,
                noise_multiplier=spec.noise_multiplier,
                clip_norm=spec.clip_norm,
                denominator=spec.sampling.denominator,
                generator=rngs.torch_gen(spec.seed, rngs.NOISE, rnd),
            )
        else:
            avg = summed / total.num_clients if total.num_clients else torch.zeros_like(summed)
        self.weights = self.weights + (spec.server_lr * avg).to(torch.float32)
        self.rounds_done = rnd + 1
        row: dict = {
            "round": rnd + 1,
            "cohort_size": spec.sampling.denominator,
            "realised_cohort_size_nonprivate": total.num_clients,
            "epsilon": self.tracker.epsilon(rnd + 1) if self.tracker else math.inf,
            "mean_update_norm_nonprivate": (
                total.norm_sum / total.num_clients if total.num_clients else math.nan
            ),
            "clipped_fraction_nonprivate": (
                total.num_clipped / total.num_clients if total.num_clients else math.nan
            ),
            "nonfinite_updates_nonprivate": total.num_nonfinite,
            "train_loss_nonprivate": (
                total.loss_sum / total.num_steps if total.num_steps else math.nan
            ),
        }
        if (rnd + 1) % spec.eval_every == 0 or rnd + 1 == spec.rounds:
            load_flat_(self.model, self.weights)
            acc, loss = evaluate(self.model, self.dataset.x_test, self.dataset.y_test)
        else:
            acc, loss = math.nan, math.nan
        row["test_accuracy"], row["test_loss"] = acc, loss
        return row
