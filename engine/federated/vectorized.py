"""Vectorised local training: which trainer a worker uses, and in groups of what size.

The vectorised implementation of the local-training interface
(:mod:`engine.federated.local_training`) is :class:`GroupedTrainer`, chosen once per
worker by :func:`choose_trainer`; its groups are trained as one batched computation by
:class:`engine.federated.group_training.VectorizedTrainer` (the exact semantics, what
is not covered, and the privacy note are in that module's docstring).

Group size (``ray.clients_per_worker_batch``, decided once per worker): an explicit
G groups the shard's clients, in their order, G at a time (the rest is a smaller
group; a group of one trains one by one). ``null`` chooses automatically
(:func:`auto_group_size`): on a GPU as many clients as a quarter of the free memory
holds (estimated per client from the parameters and their copies plus one
minibatch's activations measured by the probe), at most 128 (64 on the CPU). On one
H100 (cnn, 1.66M parameters, 128 clients of ~60 examples, batch 10, one epoch, one
worker, ``benchmarks/gpu_vectorized.py``) one by one trained 65 clients/s and groups
of 16, 64 and 128 trained 233, 672 and 833 (3.6x, 10.4x, 12.8x); resnet18_gn (32
clients) 22 one by one, 28, 37 and 44 in groups of 8, 16 and 32 (measured when the
backward pass was ``torch.func.grad`` inside vmap; not re-measured on a GPU since it is
plain autograd). On the CPU, measured on
2 cores (1 torch thread, 25 clients of 40–80 examples (~60), batch 10, one epoch,
seconds per ``train_shard`` of the 25 clients, best of 3–7)::

    model (parameters)     rule        G=1     G=5     G=10    G=25
    logreg 28x28 (7.9k)    dp_fedavg   0.023   0.034   0.022   0.012
    logreg 28x28 (7.9k)    dp_fedsam   0.050   0.072   0.051   0.022
    mlp dim 60 (54k)       dp_fedavg   0.050   0.068   0.059   0.043
    mlp dim 60 (54k)       dp_fedsam   0.109   0.151   0.133   0.095
    mlp 28x28 (199k)       dp_fedavg   0.088   0.146   0.129   0.099
    mlp 28x28 (199k)       dp_fedsam   0.203   0.317   0.411   0.330
    cnn 28x28 (1.66M)      dp_fedavg   1.74    1.96    2.08    2.38
    cnn 28x28 (1.66M)      dp_fedsam   3.89    5.73    6.67    6.96

Each vectorised step costs a fixed vmap overhead (a few sequential
client-steps), and on a CPU the stacked tensors of a group leave the cache that one
client's tensors fit in; so only small models in large groups gain. The automatic
rule on the CPU therefore trains models above ``CPU_MAX_PARAMS`` = 100k parameters
(mlp on 28x28, cnn, the GN-ResNets, char_lstm) one by one, and vectorises the others
in groups of up to 64, training groups under ``CPU_MIN_GROUP`` = 16 clients one by
one. Models for which vmap has no batching rule for some op (it then loops per
client, e.g. the LSTM of char_lstm) are trained one by one by the automatic rule.
Under plain SGD on the CPU two models skip vmap altogether: dense ones (logreg, mlp)
take :class:`engine.federated.dense_training.DenseSGDTrainer`, and a body with a dense
head (the cnn) :class:`engine.federated.head_training.DenseHeadSGDTrainer`, one client
at a time with its first dense layer's steps as factors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from engine.federated.dense_training import DenseSGDTrainer, dense_sgd_reason
from engine.federated.group_training import VectorizedTrainer, unsupported_reason
from engine.federated.head_training import DenseHeadSGDTrainer, dense_head_reason
from engine.federated.local_training import LocalResult, OneByOneTrainer

__all__ = [
    "DeferredTrainer",
    "GPU_MAX_GROUP",
    "GroupedTrainer",
    "choose_trainer",
    "MAX_GROUP",
    "CPU_MAX_PARAMS",
    "CPU_MIN_GROUP",
    "auto_group_size",
    "cpu_prefers_one_by_one",
]

#: Upper bound of an automatically chosen group size (CPU).
MAX_GROUP = 64
#: Upper bound on a GPU: one H100, cnn, 128 clients in one worker (README, GPU table)
#: trained 592, 672 and 833 clients/s in groups of 32, 64 and 128 (55-65 one by one).
GPU_MAX_GROUP = 128
#: Fraction of the available memory a group may use (automatic choice).
MEMORY_FRACTION = 0.25
#: On the CPU the automatic choice trains models with more trainable parameters than
#: this one by one: vectorised groups measured no faster (mlp on 28x28, 199k
#: parameters) or slower (cnn, 1.66M) there; see the measurements in the module
#: docstring. An explicit ``ray.clients_per_worker_batch`` still vectorises them.
CPU_MAX_PARAMS = 100_000
#: On the CPU the automatic choice vectorises only groups of at least this many
#: clients (smaller groups, e.g. the rest of a shard, train one by one): each
#: vectorised step has a fixed vmap overhead of a few sequential client-steps,
#: and groups of 2 to 10 measured slower than one by one even for small models.
CPU_MIN_GROUP = 16


def _available_bytes(device: torch.device, gpu_share: float = 0.0) -> int:
    """Free memory for one worker: on a GPU shared fractionally (``gpu_share`` < 1, as
    Ray's ``num_gpus``), at most that share of the GPU's total, so that the workers
    packed on it do not each size their groups for the whole card."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if 0.0 < gpu_share < 1.0:
            return int(min(free, total * gpu_share))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 2**30


def cpu_prefers_one_by_one(base: OneByOneTrainer) -> str | None:
    """Why the automatic choice trains ``base``'s clients one by one without even
    probing (CPU and a model above ``CPU_MAX_PARAMS``), or None."""
    device = base.params[0].device if base.params else torch.device("cpu")
    d = int(sum(p.numel() for p in base.params))
    if device.type == "cpu" and d > CPU_MAX_PARAMS:
        return (
            f"automatic: one by one on the CPU for a model of {d} > {CPU_MAX_PARAMS} "
            "parameters (vectorised groups measured slower)"
        )
    return None


def auto_group_size(base: OneByOneTrainer, trainer: VectorizedTrainer) -> tuple[int, int, str]:
    """The automatic choice (``ray.clients_per_worker_batch: null``): ``(group size,
    smallest group worth vectorising, why)``.

    One by one when vmap would run some op as a per-client loop (``trainer.slow_ops``)
    or, on the CPU, for models above ``CPU_MAX_PARAMS``. Otherwise the group is as
    large as ``MEMORY_FRACTION`` of the available memory allows, at most
    ``MAX_GROUP``; on the CPU groups smaller than ``CPU_MIN_GROUP`` (a short shard, or
    its last group) are trained one by one.

    The choice can depend on the machine's free memory, and the group size on the
    rounding of the result (float32 tolerance, not bit-identity); set
    ``ray.clients_per_worker_batch`` for bit-identical results across machines.
    """
    reason = cpu_prefers_one_by_one(base)
    if reason is not None:
        return 1, 2, reason
    if trainer.slow_ops:
        return 1, 2, "automatic: one by one, vmap has no batching rule for an op of this model"
    device = base.params[0].device
    per_client = max(1, trainer.bytes_per_client())
    available = _available_bytes(device, base.spec.gpu_share)
    by_memory = int(available * MEMORY_FRACTION // per_client)
    cap = GPU_MAX_GROUP if device.type == "cuda" else MAX_GROUP
    size = max(1, min(cap, by_memory))
    least = CPU_MIN_GROUP if device.type == "cpu" else 2
    return (
        size,
        least,
        (
            f"automatic: groups of min({cap}, memory {by_memory}) clients on "
            f"{device.type}, groups under {least} one by one"
        ),
    )


class GroupedTrainer:
    """The vectorised implementation of :class:`engine.federated.local_training.LocalTrainer`.

    Trains a shard's clients, in their order, ``group_size`` at a time with
    :meth:`VectorizedTrainer.train_group`; a group under ``min_group`` clients (e.g.
    a short rest) goes to the one-by-one trainer ``base``. Yields the same
    :class:`LocalResult` per client as ``base`` would, to float32 rounding.
    """

    def __init__(
        self,
        base: OneByOneTrainer,
        vectorized: VectorizedTrainer,
        group_size: int,
        min_group: int,
        note: str,
    ) -> None:
        self.base, self.vectorized = base, vectorized
        self.group_size, self.min_group, self.note = group_size, min_group, note

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        return self.base.local_gradient(client, local)

    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        size = self.group_size
        for start in range(0, len(clients), size):
            group = [int(c) for c in clients[start : start + size]]
            if len(group) < self.min_group:
                yield from self.base.train(global_flat, rnd, group, public)
                continue
            local, loss_sums, steps = self.vectorized.train_group(global_flat, rnd, group, public)
            for i, c in enumerate(group):
                yield LocalResult(c, local[i], loss_sums[i], steps[i])


class DeferredTrainer:
    """The automatic choice on the CPU, made when it first matters.

    On the CPU a group under ``CPU_MIN_GROUP`` clients trains one by one whatever the
    probe says, so a worker whose shards stay smaller never needs the probe, whose
    first vmap costs 0.3 s (1–2.7 s, ``benchmarks/startup_eval.py``, while the backward
    pass was ``torch.func.grad``, which imports ``torch._dynamo``). This trainer trains
    such shards one by one and runs the probe and :func:`auto_group_size` once, at the
    first shard of at least ``least`` clients; from then on it is that choice. Results
    are those of deciding at start: the decision does not depend on when it is made.
    """

    def __init__(self, base: OneByOneTrainer, least: int) -> None:
        self.base, self.least = base, least
        self.chosen: OneByOneTrainer | GroupedTrainer | None = None

    def decide(self) -> OneByOneTrainer | GroupedTrainer:
        if self.chosen is None:
            self.chosen = _probe_and_choose(self.base, None)
        return self.chosen

    @property
    def vectorized(self) -> Any:
        return None if self.chosen is None else self.chosen.vectorized

    @property
    def group_size(self) -> int:
        return 1 if self.chosen is None else self.chosen.group_size

    @property
    def min_group(self) -> int:
        return self.least if self.chosen is None else self.chosen.min_group

    @property
    def note(self) -> str:
        if self.chosen is None:
            return (
                f"automatic: one by one until a shard of >= {self.least} clients, "
                "then probed and decided once"
            )
        return self.chosen.note

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        return self.base.local_gradient(client, local)

    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        if self.chosen is None and len(clients) < self.least:
            return self.base.train(global_flat, rnd, clients, public)
        return self.decide().train(global_flat, rnd, clients, public)


def choose_trainer(
    base: OneByOneTrainer,
) -> OneByOneTrainer | GroupedTrainer | DeferredTrainer | DenseSGDTrainer | DenseHeadSGDTrainer:
    """The worker's local trainer, decided once per worker (never per round): groups
    of ``ray.clients_per_worker_batch`` clients if set; else, for a dense model
    (logreg, mlp) under plain SGD on the CPU, :class:`DenseSGDTrainer`; for a body
    and a dense head (the cnn) under plain SGD on the CPU, one client at a time,
    :class:`engine.federated.head_training.DenseHeadSGDTrainer`; else the automatic size;
    ``base`` (one by one) when the pipeline or model cannot be vectorised (probed
    once) or the size is 1. The automatic choice on the CPU is deferred to the first
    shard that could use a group (:class:`DeferredTrainer`). The trainer's ``note``
    says why."""
    requested = base.spec.clients_per_batch
    if requested == 1:
        return _one_by_one(base, "ray.clients_per_worker_batch=1")
    reason = unsupported_reason(base)
    if reason is not None:
        return _one_by_one(base, f"one by one: {reason}")
    if requested is None and base.dense is not None and dense_sgd_reason(base) is None:
        return DenseSGDTrainer(base)  # a dense model under plain SGD, on the CPU
    if requested is None and dense_head_reason(base) is None:
        return DenseHeadSGDTrainer(base)  # a body and a dense head (the cnn), on the CPU
    if requested is None:
        reason = cpu_prefers_one_by_one(base)
        if reason is not None:
            return _one_by_one(base, reason)
        if base.device.type == "cpu":
            return DeferredTrainer(base, CPU_MIN_GROUP)
    return _probe_and_choose(base, requested)


def _probe_and_choose(
    base: OneByOneTrainer, requested: int | None
) -> OneByOneTrainer | GroupedTrainer:
    trainer = VectorizedTrainer(base)
    reason = trainer.probe()
    if reason is not None:
        return _one_by_one(base, f"one by one: {reason}")
    if requested is None:
        size, least, why = auto_group_size(base, trainer)
    else:
        size, least, why = int(requested), 2, f"ray.clients_per_worker_batch={requested}"
    if size <= 1:
        return _one_by_one(base, why)
    return GroupedTrainer(base, trainer, size, least, why)


def _one_by_one(base: OneByOneTrainer, why: str) -> OneByOneTrainer:
    base.note = why
    return base
