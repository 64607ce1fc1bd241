"""Client-side work: local training of a shard of the cohort into one partial sum.

A :class:`ClientWorker` is created once per worker process (a Ray actor, or in
process). It builds the model once and, for each client, copies the global weights
into it, trains locally, forms the update Δ_i = w_i − x^t, sanitises and clips it
(ALGORITHMS.md §0 rule 2) and adds it to the shard's sum. Only that sum (plus counts
and non-private diagnostics) leaves the worker: one vector per worker per round.

Randomness (minibatch order) comes from streams keyed by (seed, round, client), so a
client's update does not depend on which worker trains it or in what order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine import rng as rngs
from engine.data.federated import FederatedDataset
from engine.models import build_model
from engine.privacy.mechanisms import clip_update


@dataclass(frozen=True)
class LocalSpec:
    """What a worker needs to train clients (public, identical for all clients)."""

    seed: int
    model_name: str
    epochs: int
    batch_size: int
    lr: float
    lr_decay: float
    momentum: float
    weight_decay: float
    clip_norm: float  # math.inf for non-private FedAvg
    num_threads: int = 1


@dataclass
class PartialSum:
    """A shard's contribution to one round.

    ``update_sum`` is the sum of clipped updates (float64). Everything else except
    ``num_clients`` is a non-private diagnostic computed from raw updates.
    """

    update_sum: np.ndarray
    num_clients: int
    norm_sum: float = 0.0
    num_clipped: int = 0
    num_nonfinite: int = 0
    loss_sum: float = 0.0
    num_steps: int = 0


def flatten_params(model: nn.Module) -> torch.Tensor:
    """A new contiguous float32 vector of all trainable parameters (not a view)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def load_flat_(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the model's parameters (copies; never makes them views)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} entries, model has {offset}")


def reduce_partials(partials: list[PartialSum], dim: int) -> PartialSum:
    """Sum partials in the given (shard) order — the one reduction every executor uses."""
    total = PartialSum(update_sum=np.zeros(dim, np.float64), num_clients=0)
    for p in partials:
        total.update_sum += p.update_sum
        total.num_clients += p.num_clients
        total.norm_sum += p.norm_sum
        total.num_clipped += p.num_clipped
        total.num_nonfinite += p.num_nonfinite
        total.loss_sum += p.loss_sum
        total.num_steps += p.num_steps
    return total


def shard_cohort(cohort: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Split the (sorted) cohort into ``num_shards`` contiguous, near-equal shards."""
    return [np.asarray(s, dtype=np.int64) for s in np.array_split(np.sort(cohort), num_shards)]


def init_process_model(
    seed: int, model_name: str, dataset: FederatedDataset, num_threads: int
) -> nn.Module:
    """Pin this process's torch threads and build the run's initial model (same on
    every process: it is drawn from the (seed, MODEL_INIT) stream)."""
    torch.set_num_threads(max(1, int(num_threads)))
    init = rngs.torch_gen(seed, rngs.MODEL_INIT)
    return build_model(model_name, dataset.input_shape, dataset.num_classes, init)


class ClientWorker:
    """Trains clients of a shard and returns their summed clipped updates."""

    def __init__(self, dataset: FederatedDataset, spec: LocalSpec) -> None:
        self.dataset = dataset
        self.spec = spec
        self.model = init_process_model(spec.seed, spec.model_name, dataset, spec.num_threads)
        self.model.train()
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=spec.lr,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
        )
        self.loss_fn = nn.CrossEntropyLoss()

    def ping(self) -> int:
        return int(sum(p.numel() for p in self.model.parameters()))

    def _train_one(
        self, global_flat: torch.Tensor, rnd: int, client: int
    ) -> tuple[torch.Tensor, float, int]:
        """Local SGD for ``client`` from ``global_flat``; returns (Δ, loss sum, steps)."""
        spec = self.spec
        load_flat_(self.model, global_flat)
        self.optimizer.state.clear()
        lr = spec.lr * spec.lr_decay**rnd
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        idx = self.dataset.client_train[client]
        n = len(idx)
        gen = rngs.torch_gen(spec.seed, rngs.CLIENT_DATA, rnd, client)
        loss_sum, steps = 0.0, 0
        for _ in range(spec.epochs):
            order = idx[torch.randperm(n, generator=gen).numpy()] if n else idx
            for start in range(0, n, spec.batch_size):
                batch = np.sort(order[start : start + spec.batch_size])
                x = torch.from_numpy(np.ascontiguousarray(self.dataset.x_train[batch]))
                y = torch.from_numpy(np.ascontiguousarray(self.dataset.y_train[batch]))
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                self.optimizer.step()
                loss_sum += float(loss.detach())
                steps += 1
        return flatten_params(self.model) - global_flat, loss_sum, steps

    def train_shard(self, global_weights: np.ndarray, rnd: int, clients: np.ndarray) -> PartialSum:
        """Train each client of the shard in order and sum their clipped updates."""
        global_flat = torch.from_numpy(np.array(global_weights, dtype=np.float32, copy=True))
        total = torch.zeros(global_flat.numel(), dtype=torch.float64)
        out = PartialSum(update_sum=np.zeros(0), num_clients=0)
        for c in np.asarray(clients, dtype=np.int64):
            delta, loss_sum, steps = self._train_one(global_flat, rnd, int(c))
            res = clip_update(delta, self.spec.clip_norm)
            total += res.update.double()
            out.num_clients += 1
            out.norm_sum += res.norm if math.isfinite(res.norm) else 0.0
            out.num_clipped += int(res.clipped)
            out.num_nonfinite += int(res.nonfinite)
            out.loss_sum += loss_sum
            out.num_steps += steps
        out.update_sum = total.numpy()
        return out
