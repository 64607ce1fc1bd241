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

:class:`DenseHeadSGDTrainer` trains one client at a time: the body (convolutions,
pooling) by autograd from the global model, the layers after the first dense one
stepped by the hand-written arithmetic of :mod:`engine.federated.dense_training`, and
the first dense layer as factors against the round's global weight, which is never
copied, updated or differenced per client. For the ``cnn`` with batches of 10 that
saves, per step, the layer's 1.6M-value gradient and SGD update (both a pass over
6.4 MB) and, per client, loading and differencing it; and its forward product is taken
as (W_0 H_sᵀ)ᵀ, which MKL computes about twice as fast as PyTorch's H_s W_0ᵀ for ten
rows (``benchmarks/w1.py``; docs/explanation/performance.md has the figures). A client
with more rows (steps × batch) than :data:`MAX_ROWS` or the layer's input width, where
factors would cost more than steps, is trained by the one-by-one trainer.

The result is the one-by-one trainer's local model to float32 rounding (products
summed in another order; Δ computed directly rather than as the difference of two
float32 models); ``tests/engine/test_head_training.py`` compares the two.

Privacy: none by itself. A client's update is computed from its own minibatches and
the round's public global model only; the worker clips and noises it afterwards, per
client, exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from algorithms.pieces.steps import round_lr
from algorithms.pipeline import SGDStep
from engine.federated.dense_steps import DenseSteps, dense_steps_enabled
from engine.federated.dense_training import DeltaResult, deltas_into, group_sgd_step, stacked_layers
from engine.federated.local_training import LocalResult, OneByOneTrainer

__all__ = ["DenseHeadSGDTrainer", "MAX_ROWS", "dense_head_reason", "split_dense_head"]

#: A client with more rows (Σ over its steps of the batch size) than this, or than the
#: head's input width, is trained one by one: the factors' cost grows with rows².
MAX_ROWS = 1024


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
    pipe, spec = base.pipeline, base.spec
    if not dense_steps_enabled():
        return "hand-written steps switched off (DPFL_DENSE_STEPS=0)"
    if split_dense_head(base.model, base.params) is None:
        return "not a body followed by a Flatten and dense layers"
    loss = base.loss_fn
    if type(loss) is not nn.CrossEntropyLoss or not (
        loss.weight is None and loss.reduction == "mean" and loss.label_smoothing == 0.0
    ):
        return "the loss is not the plain mean cross-entropy"
    if pipe.personal is not None:
        return "personal heads train head and body in separate phases"
    if type(pipe.step) is not SGDStep or pipe.regularizer is not None:
        return "the step rule is not plain SGD"
    if pipe.constraint is not None:
        return "a constraint changes the steps"
    if not pipe.plain_sgd and (float(spec.momentum) != 0 or float(spec.weight_decay) != 0):
        return "momentum or weight decay"
    if base.device.type != "cpu":
        return "not on the CPU"
    return None


class DenseHeadSGDTrainer:
    """The local trainer of a body-and-dense-head model under plain SGD (module
    docstring): one :class:`LocalResult` per client, in order, with Δ computed
    directly."""

    note = "one by one: the body by autograd, the dense head by hand (its first layer as factors)"
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
        self.body_params = base.params[: self.n_body]
        self.sizes = [p.numel() for p in base.params]
        self.body_dim = int(sum(self.sizes[: self.n_body]))
        self.dim = int(sum(self.sizes))
        self.head = head
        self.width = int(head.weights[0].shape[1])

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        return self.base.local_gradient(client, local)

    def _head(self, global_flat: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """(weight, bias or None) views of ``global_flat`` per dense layer of the head."""
        parts = torch.split(global_flat, self.sizes)
        views = [t.view(p.shape) for t, p in zip(parts, self.base.params)][self.n_body :]
        out, at = [], 0
        for b in self.head.biases:
            out.append((views[at], views[at + 1] if b is not None else None))
            at += 2 if b is not None else 1
        return out

    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        spec = self.base.spec
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        head = self._head(global_flat)
        cap = min(MAX_ROWS, self.width)
        for c in clients:
            c = int(c)
            batches = [np.sort(b) for b in self.base.batches(rnd, c, spec.steps, spec.epochs)]
            rows = sum(len(b) for b in batches)
            if rows == 0:
                zero = torch.zeros_like(global_flat)
                yield LocalResult(c, global_flat.clone(), 0.0, 0, zero)
            elif rows > cap:
                yield self.base.train_client(global_flat, rnd, c, public)
            else:
                delta, loss_sum = self._client(global_flat, head, batches, rows, lr)
                yield DeltaResult(c, global_flat, loss_sum, len(batches), delta)

    def _client(
        self,
        global_flat: torch.Tensor,
        head: list[tuple[torch.Tensor, Any]],
        batches: list[np.ndarray],
        rows: int,
        lr: float,
    ) -> tuple[torch.Tensor, float]:
        """One client's Δ (flat, parameter order) and the sum of its minibatch losses."""
        ds, body, params = self.base.dataset, self.body, self.body_params
        w1, b1 = head[0]
        with torch.no_grad():
            start = global_flat[: self.body_dim]
            offset = 0
            for p in params:  # the body from the global model (the head stays global)
                p.copy_(start[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            b1_now = b1.clone() if b1 is not None else None
            rest = stacked_layers(head[1:], 1)  # the layers after the first: stepped
        inputs = torch.empty(rows, self.width, dtype=w1.dtype)  # H_r of every step
        factors = torch.empty(rows, w1.shape[0], dtype=w1.dtype)  # G_r of every step
        loss_sum, a = 0.0, 0
        for b in batches:
            e = a + len(b)
            x = torch.from_numpy(np.ascontiguousarray(ds.x_train[b]))
            y = torch.from_numpy(np.ascontiguousarray(ds.y_train[b]))
            h = body(x).flatten(1)  # through autograd: the body's graph
            with torch.no_grad():
                h_s = inputs[a:e]
                h_s.copy_(h)
                # H_s W_0ᵀ as (W_0 H_sᵀ)ᵀ (module docstring), then the earlier steps
                z = torch.mm(w1, h_s.t()).t()
                if a > 0:
                    z = z.addmm(torch.mm(h_s, inputs[:a].t()), factors[:a], alpha=-lr)
                if b1_now is not None:
                    z = z + b1_now
                ones = torch.ones(1, e - a, dtype=z.dtype)
                loss, g = group_sgd_step(z.unsqueeze(0), y.unsqueeze(0), ones, rest, lr)
                assert g is not None
                g = g[0]
                # the gradient into the body: G_s W_s from W_0 and the earlier factors
                back = torch.mm(g, w1)
                if a > 0:
                    back.addmm_(torch.mm(g, factors[:a].t()), inputs[:a], alpha=-lr)
                if b1_now is not None:
                    b1_now.add_(g.sum(0), alpha=-lr)
                factors[a:e] = g
            # the body's gradients for the incoming ``back``: through the scalar ⟨h, back⟩,
            # whose backward hands the body exactly ``back`` (1·back), because an
            # explicit grad_outputs makes torch import sympy (~0.3 s per process)
            grads = torch.autograd.grad(torch.sum(h * back), params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-lr)
            loss_sum += float(loss[0])
            a = e
        with torch.no_grad():
            delta = torch.empty(self.dim, dtype=global_flat.dtype)
            offset = 0
            for p in params:
                n = p.numel()
                torch.sub(p.reshape(-1), start[offset : offset + n], out=delta[offset : offset + n])
                offset += n
            n1 = w1.numel()
            factors.mul_(-lr)
            torch.mm(factors.t(), inputs, out=delta[offset : offset + n1].view(w1.shape))
            offset += n1
            if b1 is not None and b1_now is not None:
                torch.sub(b1_now, b1, out=delta[offset : offset + b1.numel()])
                offset += b1.numel()
            deltas_into(delta[offset:].unsqueeze(0), head[1:], rest)
        return delta, loss_sum
