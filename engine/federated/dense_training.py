"""Plain local SGD of a dense network with the first layer's updates kept as factors.

For a dense model (:class:`engine.federated.dense_steps.DenseSteps`: Linear layers with
ReLUs between them, mean cross-entropy) trained by plain SGD (no momentum, weight
decay, regularizer, constraint or personal head: DP-FedAvg's local steps), the first
layer's weight after s steps is

    W_s = W_0 − η Σ_{r<s} G_rᵀ X_r

where X_r is step r's minibatch (the client's own examples, known before training:
the batches come from the client's stream) and G_r the gradient of the loss with
respect to the layer's output at step r. So the layer's output at step s is

    X_s W_sᵀ + b_s = X_s W_0ᵀ + b_s − η Σ_{r<s} (X_s X_rᵀ) G_r,

and the client's update of that layer is Δ = −η G_allᵀ X_all. :class:`DenseSGDTrainer`
computes X W_0ᵀ for all of a shard's minibatches in one matrix product against the
global weights (shared by every client of the round), each client's Gram matrix
X Xᵀ once, and Δ in one product per client; the first layer's weights are never
formed per client or updated step by step, which for a model whose first layer holds
most of its parameters (the MLP on 28×28 images: 157k of 199k) was most of a step's
memory traffic. The other layers are trained explicitly, step by step, with the
hand-written steps' arithmetic (:mod:`engine.federated.dense_steps`).

The result is the same local model as :class:`engine.federated.local_training.OneByOneTrainer`
computes, to float32 rounding: the products are summed in another order, and Δ is
computed directly instead of as the difference of two float32 models (which loses the
update's low bits); ``tests/engine/test_dense_training.py`` compares the two.

Privacy: none by itself. Each client's Δ is computed from its own minibatches and the
round's public global model only; clipping and noise follow in the worker, per
client, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.pieces.steps import round_lr
from algorithms.pipeline import SGDStep
from engine.federated.local_training import LocalResult, OneByOneTrainer

__all__ = ["DenseSGDTrainer", "dense_sgd_reason"]

#: Clients trained together (one group: their examples gathered at once, their
#: other layers stacked); a group's working memory is kept under GROUP_BYTES.
MAX_GROUP = 32
GROUP_BYTES = 64 * 2**20
#: A client with more rows (steps × batch) than this, or than the first layer's
#: input width, is trained with every layer stepped (no factors): the factors' cost
#: grows with rows², a stepped first layer's with its width.
MAX_ROWS = 1024


def dense_sgd_reason(base: OneByOneTrainer) -> str | None:
    """Why ``base``'s clients cannot be trained by :class:`DenseSGDTrainer`, or None."""
    pipe, spec = base.pipeline, base.spec
    if base.dense is None:
        return "not a dense model with the plain cross-entropy"
    if type(base.loss_fn) is not torch.nn.CrossEntropyLoss or not _plain_ce(base.loss_fn):
        return "the loss is not the plain mean cross-entropy"
    if pipe.personal is not None or type(pipe.step) is not SGDStep:
        return "the step rule is not plain SGD"
    if pipe.regularizer is not None or pipe.constraint is not None:
        return "a regularizer or constraint changes the steps"
    if not pipe.plain_sgd and (float(spec.momentum) != 0 or float(spec.weight_decay) != 0):
        return "momentum or weight decay"
    if base.device.type != "cpu":
        return "not on the CPU"
    return None


def _plain_ce(loss: torch.nn.CrossEntropyLoss) -> bool:
    return loss.weight is None and loss.reduction == "mean" and loss.label_smoothing == 0.0


class DenseSGDTrainer:
    """The local trainer of a dense model under plain SGD (module docstring): one
    :class:`LocalResult` per client, in order, with its update Δ computed directly.

    Clients are trained in groups of up to :data:`MAX_GROUP`, sorted by their number of
    steps: every step of a group is one batched computation (``bmm``) over its
    clients' stacked layers, the minibatches padded to a common size with weight-0
    rows (copies of a real example, masked out of the loss, so their gradient rows
    are exactly zero) and a client with fewer steps given all-zero weights for the
    rest (a zero gradient leaves plain SGD's parameters exactly unchanged). Clients
    with at most min(:data:`MAX_ROWS`, the first layer's input width) rows (steps ×
    batch) train with the first layer's steps as factors; the others (more rows than
    that: factors would cost more) in groups of their own with every layer stacked
    and stepped, which is still one batched computation per step. On one worker's
    shard of 50 clients of ``dpfl run``'s default workload (dim 60, most clients in
    the second kind) that measured 0.24 against 0.33 CPU-s for the vmap groups it
    replaced, and 0.08-0.14 against 0.25-0.43 CPU-s on 25 Fashion-MNIST MLP clients
    (one by one before; 2 cores, load 4-8)."""

    group_size = MAX_GROUP
    min_group = 1
    vectorized: Any = None

    def __init__(self, base: OneByOneTrainer) -> None:
        if base.dense is None:
            raise ValueError("DenseSGDTrainer needs a dense model")
        self.base, self.dense = base, base.dense
        self.sizes = [p.numel() for p in base.params]
        self.width = int(base.dense.weights[0].shape[1])
        self.dim = int(sum(self.sizes))
        self.note = "dense SGD in groups of <= 32 (the first layer's steps as factors)"

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        return self.base.local_gradient(client, local)

    def _layers(self, global_flat: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """(weight, bias or None) views of ``global_flat`` per Linear layer."""
        views = [
            t.view(p.shape) for t, p in zip(torch.split(global_flat, self.sizes), self.base.params)
        ]
        out, at = [], 0
        for b in self.dense.biases:
            out.append((views[at], views[at + 1] if b is not None else None))
            at += 2 if b is not None else 1
        return out

    @torch.no_grad()
    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        spec = self.base.spec
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        layers = self._layers(global_flat)
        clients = [int(c) for c in clients]
        cap = min(MAX_ROWS, self.width)
        for start in range(0, len(clients), 4 * MAX_GROUP):
            chunk = clients[start : start + 4 * MAX_GROUP]
            batches = [
                [np.sort(b) for b in self.base.batches(rnd, c, spec.steps, spec.epochs)]
                for c in chunk
            ]
            done: dict[int, LocalResult] = {}
            factored: list[int] = []
            explicit: list[int] = []
            for i, (c, bs) in enumerate(zip(chunk, batches)):
                rows = sum(len(b) for b in bs)
                if rows == 0:
                    zero = torch.zeros_like(global_flat)
                    done[i] = LocalResult(c, global_flat.clone(), 0.0, 0, zero)
                else:
                    (factored if rows <= cap else explicit).append(i)
            for members, as_factors in ((factored, True), (explicit, False)):
                members.sort(key=lambda i: (len(batches[i]), max(len(b) for b in batches[i])))
                for group in self._groups(members, batches, as_factors):
                    deltas, losses = self._group(
                        [batches[i] for i in group], layers, lr, as_factors
                    )
                    for k, i in enumerate(group):
                        delta = deltas[k]
                        done[i] = _DeltaResult(
                            chunk[i], global_flat, losses[k], len(batches[i]), delta
                        )
            for i in range(len(chunk)):
                yield done.pop(i)

    def _groups(
        self, order: list[int], batches: list[list[np.ndarray]], as_factors: bool
    ) -> list[list[int]]:
        """Consecutive clients of ``order`` in groups of at most :data:`MAX_GROUP`
        whose padded working memory stays under :data:`GROUP_BYTES`."""
        groups: list[list[int]] = []
        cur: list[int] = []
        hidden = int(self.dense.weights[0].shape[0])
        for i in order:
            trial = [*cur, i]
            steps = max(len(batches[j]) for j in trial)
            width = max(len(b) for j in trial for b in batches[j])
            rows = steps * width
            per_row = self.width + rows + 2 * hidden if as_factors else self.width
            need = 4 * len(trial) * (rows * per_row + (0 if as_factors else self.dim))
            if cur and (len(trial) > MAX_GROUP or need > GROUP_BYTES):
                groups.append(cur)
                cur = [i]
            else:
                cur = trial
        if cur:
            groups.append(cur)
        return groups

    def _group(
        self,
        batches: list[list[np.ndarray]],
        layers: list[tuple[torch.Tensor, Any]],
        lr: float,
        as_factors: bool = True,
    ) -> tuple[list[torch.Tensor], list[float]]:
        """A group's Δ (flat, parameter order) and loss sums: every step one batched
        computation over the group (class docstring); the first layer's steps as
        factors, or (``as_factors=False``) every layer stacked and stepped."""
        ds = self.base.dataset
        g_n, steps = len(batches), max(len(bs) for bs in batches)
        width = max(len(b) for bs in batches for b in bs)
        rows = steps * width
        idx = np.empty((g_n, steps, width), dtype=np.int64)
        wts = np.zeros((g_n, steps, width), dtype=np.float32)
        for k, bs in enumerate(batches):
            idx[k] = bs[0][0]  # padding: a real example of the client, weight 0
            for s, b in enumerate(bs):
                idx[k, s, : len(b)] = b
                wts[k, s, : len(b)] = 1.0
        w1, b1 = layers[0]
        x = torch.from_numpy(np.ascontiguousarray(ds.x_train[idx.reshape(-1)]))
        x = x.reshape(g_n, rows, -1).to(w1.dtype)
        y = torch.from_numpy(np.ascontiguousarray(ds.y_train[idx])).reshape(g_n, steps, width)
        wt = torch.from_numpy(wts)
        if not as_factors:
            return self._explicit_group(x, y, wt, layers, lr, steps, width)
        p = torch.mm(x.reshape(g_n * rows, -1), w1.t()).view(g_n, rows, -1)  # x W_0ᵀ
        gram = torch.bmm(x, x.transpose(1, 2))
        g_first = torch.zeros_like(p)  # G_r of every step
        b1_now = b1.expand(g_n, -1).clone() if b1 is not None else None
        rest = _stacked(layers[1:], g_n)
        loss_acc = torch.zeros(g_n, dtype=torch.float64)
        for s in range(steps):
            a, e = s * width, (s + 1) * width
            z = p[:, a:e] if b1_now is None else p[:, a:e] + b1_now.unsqueeze(1)
            if s > 0:  # the first layer's earlier steps, as factors
                z = torch.baddbmm(z, gram[:, a:e, :a], g_first[:, :a], alpha=-lr)
            loss, g = _group_step(z, y[:, s], wt[:, s], rest, lr)
            assert g is not None
            loss_acc += loss.double()
            g_first[:, a:e] = g
            if b1_now is not None:
                b1_now.add_(g.sum(1), alpha=-lr)
        # every client's Δ in one (G, d) buffer, parameter order: no per-client concatenation
        out = torch.empty(g_n, self.dim, dtype=w1.dtype)
        at = w1.numel()
        delta1 = out[:, :at].view(g_n, *w1.shape)
        torch.bmm(g_first.transpose(1, 2), x, out=delta1)
        delta1.mul_(-lr)
        if b1 is not None and b1_now is not None:
            torch.sub(b1_now, b1, out=out[:, at : at + b1.numel()])
            at += b1.numel()
        _deltas_into(out[:, at:], layers[1:], rest)
        return list(out), [float(v) for v in loss_acc.tolist()]

    def _explicit_group(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        wt: torch.Tensor,
        layers: list[tuple[torch.Tensor, Any]],
        lr: float,
        steps: int,
        width: int,
    ) -> tuple[list[torch.Tensor], list[float]]:
        """A group trained with every layer stacked and stepped (clients with more rows
        than the first layer's input width, for whom factors cost more)."""
        g_n = x.shape[0]
        stacked = _stacked(layers, g_n)
        loss_acc = torch.zeros(g_n, dtype=torch.float64)
        for s in range(steps):
            a, e = s * width, (s + 1) * width
            loss, _ = _group_step(x[:, a:e], y[:, s], wt[:, s], stacked, lr, from_input=True)
            loss_acc += loss.double()
        out = torch.empty(g_n, self.dim, dtype=x.dtype)
        _deltas_into(out, layers, stacked)
        return list(out), [float(v) for v in loss_acc.tolist()]


def _stacked(layers: list[tuple[torch.Tensor, Any]], g_n: int) -> list[tuple[torch.Tensor, Any]]:
    """Each layer's weight and bias repeated for ``g_n`` clients (their own copies)."""
    return [
        (w.expand(g_n, -1, -1).clone(), b.expand(g_n, -1).clone() if b is not None else None)
        for w, b in layers
    ]


class _DeltaResult(LocalResult):
    """A :class:`LocalResult` whose local model x^t + Δ is formed only when read (by a
    client transform that needs the local gradient, e.g. LUS): the worker clips Δ
    itself, so most rounds never allocate a model-sized tensor per client for it."""

    def __init__(
        self,
        client: int,
        global_flat: torch.Tensor,
        loss_sum: float,
        steps: int,
        delta: torch.Tensor,
    ) -> None:
        self.client, self.loss_sum, self.steps, self.delta = client, loss_sum, steps, delta
        self._global = global_flat

    @property
    def local(self) -> torch.Tensor:  # type: ignore[override]  # read-only: formed from Δ
        assert self.delta is not None
        return self._global + self.delta


def _deltas_into(
    out: torch.Tensor,
    layers: list[tuple[torch.Tensor, Any]],
    stacked: list[tuple[torch.Tensor, Any]],
) -> None:
    """Each client's update of the ``stacked`` layers (parameter order) written into its
    row of ``out`` (G, Σ sizes): weight − global weight, then bias − global bias."""
    at = 0
    for (w0, b0), (wk, bk) in zip(layers, stacked):
        n = w0.numel()
        torch.sub(wk, w0, out=out[:, at : at + n].view(wk.shape))
        at += n
        if bk is not None and b0 is not None:
            torch.sub(bk, b0, out=out[:, at : at + b0.numel()])
            at += b0.numel()
    assert at == out.shape[1]


def _group_step(
    z: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    rest: list[tuple[torch.Tensor, Any]],
    lr: float,
    from_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One SGD step of a group's stacked layers ``rest`` from ``z`` (G, B, ·), with
    labels ``y`` and example weights ``w`` (G, B): the first layer's output (then the
    layers after the first are stepped), or with ``from_input`` the minibatch itself
    (then every layer is). Updates ``rest`` in place; returns each client's mean loss
    over its real examples (0 for a client without any this step) and the gradient
    with respect to ``z`` (None with ``from_input``)."""
    h = torch.relu(z) if rest and not from_input else z
    inputs = []
    for i, (wi, bi) in enumerate(rest):
        inputs.append(h)
        wt = wi.transpose(1, 2)
        out = torch.baddbmm(bi.unsqueeze(1), h, wt) if bi is not None else torch.bmm(h, wt)
        h = torch.relu(out) if i + 1 < len(rest) else out
    lsm = F.log_softmax(h, -1)
    n = w.sum(1)
    scale = w / n.clamp(min=1.0).unsqueeze(1)  # 1/n for real rows, 0 for padding
    nll = -lsm.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    loss = torch.where(w > 0, nll, 0.0).mul(scale).sum(1)
    g = lsm.exp()
    g.scatter_add_(-1, y.unsqueeze(-1), torch.full_like(nll, -1.0).unsqueeze(-1))
    g.mul_(scale.unsqueeze(-1))
    grad: torch.Tensor | None = g
    for i in range(len(rest) - 1, -1, -1):
        wi, bi = rest[i]
        h_in = inputs[i]
        assert grad is not None
        g_w = torch.bmm(grad.transpose(1, 2), h_in)
        g_b = grad.sum(1) if bi is not None else None
        if i > 0 or not from_input:  # the input's gradient, before wi moves
            grad = torch.ops.aten.threshold_backward(torch.bmm(grad, wi), h_in, 0)
        else:
            grad = None
        wi.add_(g_w, alpha=-lr)
        if bi is not None and g_b is not None:
            bi.add_(g_b, alpha=-lr)
    return loss, grad
