"""Local SGD of a network with a dense head: the body through autograd, the head by hand
with its first layer's steps as factors.

For an ``nn.Sequential`` whose layers after a ``Flatten`` are dense (``Linear``, then
``ReLU``/``Linear`` pairs: the ``cnn`` of :mod:`engine.models`, whose first dense layer
holds 1.61M of its 1.66M parameters), trained by plain SGD with the mean
cross-entropy, the head's first weight after s steps is

    W_s = W_0 − η Σ_{r<s} G_rᵀ H_r

where H_r is step r's input to the head (the body's output on the minibatch) and G_r
the loss's gradient with respect to that layer's output. So step s needs neither W_s
nor its update:

* its output is H_s W_sᵀ + b_s = H_s W_0ᵀ + b_s − η Σ_{r<s} (H_s H_rᵀ) G_r;
* the gradient that flows back into the body is G_s W_s = G_s W_0 − η Σ_{r<s}
  (G_s G_rᵀ) H_r;
* the client's update of that layer is Δ = −η G_allᵀ H_all, one product at the end.

:class:`DenseHeadSGDTrainer` trains the body (convolutions, pooling) by autograd from
the global model, one graph per client, the layers after the first dense one by the
hand-written arithmetic of :mod:`engine.federated.dense_training`, and the first dense
layer as factors against the round's global weight, which is never copied, updated or
differenced per client. Clients go in lockstep groups of up to :data:`GROUP`, each with
its own copy of the body: step s of every client in the group, with the first dense
layer's two products (H W_0ᵀ forward, G W_0 backward) taken over all their rows at
once. For the ``cnn`` with batches of 10 that saves, per step, the layer's 1.6M-value
gradient and SGD update (each a pass over 6.4 MB) and, per client, loading and
differencing it; the products over a group's rows cost half as much per row as one
client's; and the forward product is taken as (W_0 Hᵀ)ᵀ, which MKL computes about twice
as fast as PyTorch's H W_0ᵀ for ten rows (figures: docs/explanation/performance.md). A
client with more rows (steps × batch) than :data:`MAX_ROWS` or the layer's input
width, where factors would cost more than steps, is trained by the one-by-one trainer.

The result is the one-by-one trainer's local model to float32 rounding (products
summed in another order; Δ computed directly rather than as the difference of two
float32 models); ``tests/engine/test_head_training.py`` compares the two.

Privacy: none by itself. A client's update is computed from its own minibatches and
the round's public global model only; the worker clips and noises it afterwards, per
client, exactly as before. A group's products stack several clients' rows, but each
output row is its own row times W_0: on the 2-core Intel Xeon of
docs/explanation/performance.md a client's rows came out bit for bit the same alone
and inside 7 to 80 stacked rows, so there its update does not depend on who trains
beside it. A BLAS that picked kernels by the number of rows could round them
differently, as any batched kernel may (the float-rounding caveat of every
floating-point DP implementation); the clip to C still bounds each client's update.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from algorithms.pieces.steps import round_lr
from algorithms.pipeline import SGDStep
from engine.federated.dense_steps import DenseSteps, dense_steps_enabled
from engine.federated.dense_training import (
    DeltaResult,
    deltas_into,
    group_sgd_step,
    hand_written_reason,
    stacked_layers,
    weight_bias_pairs,
)
from engine.federated.local_training import LocalResult, OneByOneTrainer

__all__ = ["DenseHeadSGDTrainer", "MAX_ROWS", "dense_head_reason", "split_dense_head"]

#: A client with more rows (Σ over its steps of the batch size) than this, or than the
#: head's input width, is trained one by one: the factors' cost grows with rows².
MAX_ROWS = 1024
#: Clients trained in lockstep: the first dense layer's two products of a step take all
#: their rows at once (for the cnn, 0.18 against 0.40 ms per 10 rows forward and 0.16
#: against 0.33 backward from 40 rows on; one body copy, of 52k parameters, per client).
GROUP = 8


def split_dense_head(model: nn.Module, params: list[torch.Tensor]) -> tuple[int, Any] | None:
    """``(index of the Flatten, DenseSteps of the head)`` when ``model`` is an
    ``nn.Sequential`` of a body with trainable parameters, a ``Flatten(start_dim=1)``
    and a dense head (:meth:`DenseSteps.of`), whose trainable parameters are, in order,
    the body's and then the head's, and which has no buffers; else None."""
    if type(model) is not nn.Sequential or any(True for _ in model.buffers()):
        return None
    mods = list(model)
    at = next((i for i, m in enumerate(mods) if type(m) is nn.Flatten), None)
    if at is None or at == 0:
        return None
    body = [p for m in mods[:at] for p in m.parameters()]
    if not body or not all(p.requires_grad for p in body):
        return None
    head = DenseSteps.of(nn.Sequential(*mods[at:]), params[len(body) :])
    if head is None or any(a is not b for a, b in zip(body, params[: len(body)])):
        return None
    return at, head


def dense_head_reason(base: OneByOneTrainer) -> str | None:
    """Why ``base``'s clients cannot be trained by :class:`DenseHeadSGDTrainer`, or
    None: a body-and-dense-head model (:func:`split_dense_head`) on the CPU, the plain
    mean cross-entropy, and DP-FedAvg's local steps (plain SGD; no momentum, weight
    decay, regularizer, constraint or personal head)."""
    pipe = base.pipeline
    if not dense_steps_enabled():
        return "hand-written steps switched off (DPFL_DENSE_STEPS=0)"
    if split_dense_head(base.model, base.params) is None:
        return "not a body followed by a Flatten and dense layers"
    if type(pipe.step) is not SGDStep or pipe.regularizer is not None:
        return "the step rule is not plain SGD"
    return hand_written_reason(base)


class DenseHeadSGDTrainer:
    """The local trainer of a body-and-dense-head model under plain SGD (module
    docstring): one :class:`LocalResult` per client, in order, with Δ computed
    directly (each client's Δ formed just before it is yielded, so the worker clips it
    while it is still in cache)."""

    note = (
        "lockstep groups of <= 8: the body by autograd, the dense head by hand "
        "(its first layer's steps as factors)"
    )
    group_size = 1
    min_group = 2
    vectorized: Any = None

    def __init__(self, base: OneByOneTrainer) -> None:
        split = split_dense_head(base.model, base.params)
        if split is None:
            raise ValueError("DenseHeadSGDTrainer needs a body followed by a dense head")
        at, head = split
        self.base = base
        self.body = nn.Sequential(*list(base.model.children())[:at])
        self.n_body = sum(1 for _ in self.body.parameters())
        self.sizes = [p.numel() for p in base.params]
        self.body_dim = int(sum(self.sizes[: self.n_body]))
        self.dim = int(sum(self.sizes))
        self.head = head
        #: the bodies clients train on, copies of the model's: the one-by-one trainer
        #: (a client with too many rows) and a client transform's local gradient load
        #: other weights into the model itself while a group's Δ are still being formed
        self.bodies: list[nn.Sequential] = []
        self.width = int(head.weights[0].shape[1])

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        return self.base.local_gradient(client, local)

    def _head(self, global_flat: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """(weight, bias or None) views of ``global_flat`` per dense layer of the head."""
        parts = torch.split(global_flat, self.sizes)
        views = [t.view(p.shape) for t, p in zip(parts, self.base.params)][self.n_body :]
        return weight_bias_pairs(views, self.head.biases)

    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        spec = self.base.spec
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        head = self._head(global_flat)
        cap = min(MAX_ROWS, self.width)
        clients = [int(c) for c in clients]
        for at in range(0, len(clients), GROUP):
            group = clients[at : at + GROUP]
            batches = [
                [np.sort(b) for b in self.base.batches(rnd, c, spec.steps, spec.epochs)]
                for c in group
            ]
            rows = [sum(len(b) for b in bs) for bs in batches]
            members = [i for i, r in enumerate(rows) if 0 < r <= cap]
            states = dict(zip(members, self._lockstep(global_flat, head, batches, members, lr)))
            for i, c in enumerate(group):
                if rows[i] == 0:
                    zero = torch.zeros_like(global_flat)
                    yield LocalResult(c, global_flat.clone(), 0.0, 0, zero)
                elif i not in states:  # more rows than factors pay for
                    yield self.base.train_client(global_flat, rnd, c, public)
                else:
                    st = states.pop(i)
                    delta = self._delta(st, global_flat, head, lr)
                    yield DeltaResult(c, global_flat, st.loss_sum, len(st.batches), delta)

    def _bodies(self, n: int) -> list[nn.Sequential]:
        """``n`` copies of the body, each with parameters of its own (none of them the
        model's), so that clients trained in lockstep keep their own graphs."""
        while len(self.bodies) < n:
            copy = deepcopy(self.body)
            for p, q in zip(self.body.parameters(), copy.parameters()):
                if p.stride() != q.stride():  # pragma: no cover - deepcopy keeps the layout
                    raise RuntimeError("a copy of the body changed its memory layout")
            self.bodies.append(copy)
        return self.bodies[:n]

    def _lockstep(
        self,
        global_flat: torch.Tensor,
        head: list[tuple[torch.Tensor, Any]],
        batches: list[list[np.ndarray]],
        members: list[int],
        lr: float,
    ) -> list[_Client]:
        """Local SGD of the clients ``members`` (indices into ``batches``) in lockstep:
        step s of every client that has one, the dense head's first-layer products of
        all their rows in one product each way (module docstring). Returns each client's
        state after its last step, in the order of ``members``."""
        ds = self.base.dataset
        w1, b1 = head[0]
        start = global_flat[: self.body_dim]
        states: list[_Client] = []
        with torch.no_grad():
            for i, body in zip(members, self._bodies(len(members))):
                params: list[torch.Tensor] = list(body.parameters())
                offset = 0
                for p in params:  # the body from the global model (the head stays global)
                    p.copy_(start[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                rows = sum(len(b) for b in batches[i])
                states.append(
                    _Client(
                        batches=batches[i],
                        body=body,
                        params=params,
                        b1=b1.clone() if b1 is not None else None,
                        rest=stacked_layers(head[1:], 1),  # the layers after the first
                        inputs=torch.empty(rows, self.width, dtype=w1.dtype),
                        factors=torch.empty(rows, w1.shape[0], dtype=w1.dtype),
                    )
                )
        for s in range(max((len(st.batches) for st in states), default=0)):
            active = [st for st in states if s < len(st.batches)]
            outs, labels = [], []
            for st in active:  # the bodies' forward passes, through autograd
                b = st.batches[s]
                x = torch.from_numpy(np.ascontiguousarray(ds.x_train[b]))
                labels.append(torch.from_numpy(np.ascontiguousarray(ds.y_train[b])))
                outs.append(st.body(x).flatten(1))
            with torch.no_grad():
                stacked = torch.cat(outs)
                # H W_0ᵀ of every active client's rows in one product, as (W_0 Hᵀ)ᵀ
                first = torch.mm(w1, stacked.t()).t()
                grads_at_z, r = [], 0
                for st, h, y in zip(active, outs, labels):
                    a, e, n = st.at, st.at + len(y), len(y)
                    h_s = st.inputs[a:e]
                    h_s.copy_(h)
                    z = first[r : r + n]
                    if a > 0:  # the earlier steps of the first dense layer, as factors
                        z = z.addmm(torch.mm(h_s, st.inputs[:a].t()), st.factors[:a], alpha=-lr)
                    if st.b1 is not None:
                        z = z + st.b1
                    ones = torch.ones(1, n, dtype=z.dtype)
                    loss, g = group_sgd_step(z.unsqueeze(0), y.unsqueeze(0), ones, st.rest, lr)
                    assert g is not None
                    grads_at_z.append(g[0])
                    st.loss_sum += float(loss[0])
                    r += n
                # G W_0 of every active client's rows in one product
                into_body = torch.mm(torch.cat(grads_at_z), w1)
            r = 0
            for st, h, g in zip(active, outs, grads_at_z):
                a, n = st.at, g.shape[0]
                with torch.no_grad():
                    back = into_body[r : r + n]
                    if a > 0:  # G_s W_s = G_s W_0 − η Σ_{r<s} (G_s G_rᵀ) H_r
                        back.addmm_(torch.mm(g, st.factors[:a].t()), st.inputs[:a], alpha=-lr)
                    if st.b1 is not None:
                        st.b1.add_(g.sum(0), alpha=-lr)
                    st.factors[a : a + n] = g
                # the body's gradients for the incoming ``back``: through the scalar
                # ⟨h, back⟩, whose backward hands the body exactly ``back`` (1·back),
                # because an explicit grad_outputs makes torch import sympy (~0.3 s per
                # process)
                grads = torch.autograd.grad(torch.sum(h * back), st.params)
                with torch.no_grad():
                    torch._foreach_add_(st.params, grads, alpha=-lr)
                st.at += n
                r += n
        return states

    @torch.no_grad()
    def _delta(
        self,
        st: _Client,
        global_flat: torch.Tensor,
        head: list[tuple[torch.Tensor, Any]],
        lr: float,
    ) -> torch.Tensor:
        """A client's Δ (flat, parameter order) from its trained state: the body's
        difference, −η G_allᵀ H_all for the first dense layer, the rest's differences."""
        w1, b1 = head[0]
        start = global_flat[: self.body_dim]
        delta = torch.empty(self.dim, dtype=global_flat.dtype)
        offset = 0
        for p in st.params:
            n = p.numel()
            torch.sub(p.reshape(-1), start[offset : offset + n], out=delta[offset : offset + n])
            offset += n
        n1 = w1.numel()
        st.factors.mul_(-lr)
        torch.mm(st.factors.t(), st.inputs, out=delta[offset : offset + n1].view(w1.shape))
        offset += n1
        if b1 is not None and st.b1 is not None:
            torch.sub(st.b1, b1, out=delta[offset : offset + b1.numel()])
            offset += b1.numel()
        deltas_into(delta[offset:].unsqueeze(0), head[1:], st.rest)
        return delta


@dataclass
class _Client:
    """One client's state while it trains in lockstep with others."""

    batches: list[np.ndarray]
    body: nn.Module  # its copy of the body
    params: list[torch.Tensor]  # that copy's parameters
    b1: torch.Tensor | None  # the first dense layer's bias, stepped
    rest: list[tuple[torch.Tensor, Any]]  # the dense layers after the first, stepped
    inputs: torch.Tensor  # H_r of every step (rows × the head's input width)
    factors: torch.Tensor  # G_r of every step (rows × the first dense layer's width)
    at: int = 0  # rows trained so far
    loss_sum: float = 0.0
