"""Local training: one interface, two implementations.

A *local trainer* turns the round's global model x^t into each client's local model
w_i by the recipe's local steps (step rule, regularizer, constraint; for DP²-FedSAM a
personal-head phase first), on the client's own minibatches. The interface is
:class:`LocalTrainer`: ``train(global_flat, rnd, clients, public)`` yields one
:class:`LocalResult` per client, in the order given. Two implementations:

* :class:`OneByOneTrainer` (here): one client at a time on the worker's model, with
  autograd;
* :class:`engine.federated.vectorized.GroupedTrainer`: groups of clients as one ``vmap``-ed
  computation, handing groups too small to gain to the one-by-one trainer.

Both share the rules defined once here or in :mod:`algorithms`: minibatches from
:func:`client_batches` (stream (seed, round, client)), parameter updates by
:func:`sgd_update_` (``torch.optim.SGD``'s arithmetic), the step rules' directions from
:mod:`algorithms.pieces.steps` (the step rules' perturbations and public inputs) and the
constraint's projection from the pipeline's piece (``BallProjection.project_`` and
its per-row form ``project_rows_``). What follows training — Δ_i = w_i − x^t, zeroing
a personal head, the client transforms, clipping and noise — is the worker's
(:class:`engine.federated.client.ClientWorker`), the same code for both trainers.

Privacy: nothing here is released. A trainer computes each client's local model from
that client's data and public state only (the global model, the round's public
context); clipping to C and noise happen afterwards in the worker, per client, so
how a client was trained changes no privacy-relevant quantity.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from algorithms.pieces.steps import gradients, round_lr
from algorithms.pipeline import SGDStep
from engine.data.federated import FederatedDataset
from engine.federated.client_state import ClientStateStore
from engine.federated.dense_steps import DenseSteps, dense_steps_enabled
from engine.federated.worker_model import (
    batch_to_tensors,
    flatten_params,
    load_flat_,
    personal_mask,
)
from engine.privacy import rng as rngs

__all__ = [
    "LocalResult",
    "LocalSGD",
    "LocalTrainer",
    "OneByOneTrainer",
    "client_batches",
    "sgd_update_",
]


@dataclass
class LocalResult:
    """One client's local training: its final local model (flat float32, on the
    worker's device, personal head included), the sum of its minibatch losses and its
    number of local steps (non-private diagnostics)."""

    client: int
    local: torch.Tensor
    loss_sum: float
    steps: int
    #: Δ = local − x^t when the trainer computed it directly (more exactly than the
    #: difference of the two float32 models); None: the worker subtracts
    delta: torch.Tensor | None = None


class LocalTrainer(Protocol):
    """What a client worker needs from local training."""

    #: how clients are trained (one by one, groups of G), for logs and results
    note: str

    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]: ...

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor: ...


def client_batches(
    dataset: FederatedDataset,
    seed: int,
    batch_size: int,
    rnd: int,
    client: int,
    steps: int | None,
    epochs: int,
) -> Iterator[Any]:
    """Client ``client``'s minibatch index arrays in round ``rnd``: ``epochs`` shuffled
    passes over its examples, or exactly ``steps`` batches (passes repeat as needed).

    The order comes from the stream (seed, CLIENT_DATA, round, client) only, so it is
    the same whichever worker or trainer trains the client, and whatever ran before.
    A client with no examples has no batches.
    """
    idx = dataset.client_train[client]
    n = len(idx)
    if n == 0:
        return
    gen = rngs.torch_gen(seed, rngs.CLIENT_DATA, rnd, client)
    done, passes = 0, 0
    while True:
        order = idx[torch.randperm(n, generator=gen).numpy()]
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]
            done += 1
            if steps is not None and done >= steps:
                return
        passes += 1
        if steps is None and passes >= epochs:
            return


@torch.no_grad()
def sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    buffer: torch.Tensor | None,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> torch.Tensor | None:
    """``torch.optim.SGD``'s single-tensor update of ``param`` in place (dampening 0,
    no Nesterov): g ← g + wd·w; b ← g on the first step, else b ← m·b + g; w ← w − lr·b
    (b = g when m = 0). Returns the momentum buffer (None when m = 0). Elementwise, so
    it serves one client's tensor and a group's stacked tensors alike."""
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if buffer is None:
            buffer = torch.clone(grad).detach()
        else:
            buffer.mul_(momentum).add_(grad, alpha=1.0)
        grad = buffer
    param.add_(grad, alpha=-lr)
    return buffer


class LocalSGD:
    """``torch.optim.SGD`` (dampening 0, no Nesterov) over a list of parameters, by
    :func:`sgd_update_`, without ``torch.optim``.

    The first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``
    (~1 s of one core): every client worker paid it in round 1. The arithmetic is that
    of the single-tensor path ``torch.optim.SGD`` takes for CPU tensors, operation for
    operation, so the parameters are bit-identical (``tests/engine/test_engine.py``
    checks it against ``torch.optim.SGD``).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        self.params, self.lr = list(params), float(lr)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def step(self, grads: list[torch.Tensor]) -> None:
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            self.buffers[i] = sgd_update_(
                p, g, self.buffers[i], self.lr, self.momentum, self.weight_decay
            )


class OneByOneTrainer:
    """Trains one client at a time on the worker's model (the reference trainer).

    Holds what local training needs in a worker process: the model and its trainable
    parameters, the loss, the recipe's pipeline and, for recipes with personal heads,
    the head mask and the per-client state store (heads never leave the worker).
    """

    note = "one by one"
    group_size = 1
    min_group = 2
    vectorized: Any = None

    def __init__(
        self, dataset: FederatedDataset, spec: Any, model: nn.Module, device: torch.device
    ) -> None:
        self.dataset = dataset
        self.spec = spec  # engine.federated.client.LocalSpec
        self.pipeline = spec.pipeline
        self.model = model
        self.device = device
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.loss_fn = nn.CrossEntropyLoss()
        self.head_mask: torch.Tensor | None = None
        self.head_params: list[torch.Tensor] = []
        self.body_params: list[torch.Tensor] = []
        if self.pipeline.personal is not None:
            self.head_mask = personal_mask(model, self.pipeline.personal.layers).to(device)
            self.head_params = self._select(self.head_mask, True)
            self.body_params = self._select(self.head_mask, False)
        self.state = ClientStateStore(spec.state_dir)
        #: the hand-written steps of a dense model (engine.federated.dense_steps), used
        #: for plain-SGD steps without a regularizer; None for other models
        self.dense = DenseSteps.of(model, self.params) if dense_steps_enabled() else None

    def _select(self, mask: torch.Tensor, value: bool) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            if bool(mask[offset]) == value:
                out.append(p)
            offset += p.numel()
        return out

    def batches(self, rnd: int, client: int, steps: int | None, epochs: int) -> Iterator[Any]:
        """:func:`client_batches` with this run's seed and batch size."""
        spec = self.spec
        return client_batches(self.dataset, spec.seed, spec.batch_size, rnd, client, steps, epochs)

    def _run_steps(self, params, step_rule, batches, anchor, public, lr, plain: bool) -> tuple:
        spec, pipe = self.spec, self.pipeline
        opt = LocalSGD(
            params,
            lr=lr,
            momentum=0.0 if plain else spec.momentum,
            weight_decay=0.0 if plain else spec.weight_decay,
        )
        loss_sum, steps = 0.0, 0
        dense = self.dense is not None and params is self.params  # all of them trained
        if dense and type(step_rule) is SGDStep and pipe.regularizer is None:
            # the same gradients as the closure below, bit for bit, without autograd
            for b in batches:
                x, y = batch_to_tensors(self.dataset, b, self.device)
                assert self.dense is not None
                loss, grads = self.dense.loss_and_grads(x, y)
                opt.step(grads)
                if pipe.constraint is not None:
                    pipe.constraint.project_(self.params, anchor)
                loss_sum += float(loss)
                steps += 1
            return loss_sum, steps
        for b in batches:
            x, y = batch_to_tensors(self.dataset, b, self.device)

            def closure(x=x, y=y) -> torch.Tensor:
                loss = self.loss_fn(self.model(x), y)
                if pipe.regularizer is not None:
                    loss = loss + pipe.regularizer.loss(self.params, anchor)
                return loss

            loss, grads = step_rule.gradients(params, closure, public)
            opt.step(grads)
            if pipe.constraint is not None:
                pipe.constraint.project_(self.params, anchor)
            loss_sum += float(loss)
            steps += 1
        return loss_sum, steps

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        """Gradient of the client's mean training loss at its local model ``local``
        (LUS's importance scores); loads ``local`` into the model."""
        load_flat_(self.model, local)
        idx = self.dataset.client_train[client]
        total = [torch.zeros_like(p) for p in self.params]
        for s in range(0, len(idx), 256):
            x, y = batch_to_tensors(self.dataset, idx[s : s + 256], self.device)

            def batch_loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return self.loss_fn(self.model(x), y)

            _, g = gradients(self.params, batch_loss)
            for t, gi in zip(total, g):
                t.add_(gi, alpha=len(y) / max(len(idx), 1))
        return torch.cat([t.reshape(-1) for t in total])

    def train_client(
        self, global_flat: torch.Tensor, rnd: int, client: int, public: dict | None = None
    ) -> LocalResult:
        """Local training of ``client`` from ``global_flat``.

        With a personal head (DP²-FedSAM) the client's stored head is loaded first,
        the head trained by plain SGD, then the body by the recipe's step rule, and the
        new head stored here (it never leaves the worker).
        """
        spec, pipe = self.spec, self.pipeline
        public = dict(public or {})
        load_flat_(self.model, global_flat)
        # x^t for the regulariser and the projection, the only users of the anchor
        needs_anchor = pipe.regularizer is not None or pipe.constraint is not None
        anchor = [p.detach().clone() for p in self.params] if needs_anchor else []
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        personal = pipe.personal
        if personal is not None:
            if self.head_mask is None:
                raise RuntimeError("a personal pipeline without its head mask")
            saved = self.state.get(client)
            if saved is not None:
                flat = flatten_params(self.model)
                flat[self.head_mask] = saved.to(self.device)
                load_flat_(self.model, flat)
            n_batches = math.ceil(len(self.dataset.client_train[client]) / spec.batch_size)
            head_steps = personal.head_steps or n_batches
            ls, st = self._run_steps(
                self.head_params,
                SGDStep(),
                self.batches(rnd, client, head_steps, 1),
                anchor,
                public,
                lr,
                False,
            )
            body_steps = personal.body_steps or spec.steps
            ls2, st2 = self._run_steps(
                self.body_params,
                pipe.step,
                self.batches(rnd, client, body_steps, spec.epochs),
                anchor,
                public,
                lr,
                False,
            )
            loss_sum, steps = ls + ls2, st + st2
        else:
            loss_sum, steps = self._run_steps(
                self.params,
                pipe.step,
                self.batches(rnd, client, spec.steps, spec.epochs),
                anchor,
                public,
                lr,
                pipe.plain_sgd,
            )
        local = flatten_params(self.model)
        if self.head_mask is not None:
            self.state.put(client, local[self.head_mask].cpu())  # the store clones
        return LocalResult(client, local, loss_sum, steps)

    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        for c in clients:
            yield self.train_client(global_flat, rnd, int(c), public)
