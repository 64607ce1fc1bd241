"""Local SGD, SAM, PGN or BLUR of a dense network with the first layer's updates as factors.

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

SAM (DP-FedSAM's step, :func:`algorithms.pieces.steps.sam_gradients`: the gradient at
w + e, e = ρ g/‖g‖) keeps that form: the first layer's gradient at step s is G_sᵀ X_s,
so ‖g‖² needs only ⟨G_s G_sᵀ, X_s X_sᵀ⟩ (the step's block of the Gram matrix) and the
output at w + e is X_s W_sᵀ + c (X_s X_sᵀ) G_s; the step then stores the gradient at
w + e as the factor. ASAM's ascent (e = ρ T² g/‖T g‖, T = |w| coordinate by
coordinate) needs every client's first-layer weight, so ASAM trains every layer
stacked and stepped, still one batched computation per step.

PGN (DP-FedPGN's step, :func:`algorithms.pieces.steps.pgn_gradients`: β∇F(w + δ) +
(1 − β) g̃ with the round's public g̃ and δ = ρ g̃/‖g̃‖) adds to the first layer's weight
terms that are the same for every client: δ_1 = c g̃_1 and the drift −η (1 − β) g̃_1 of
each of the client's own steps, so the output gains (c − η (1 − β) r) X g̃_1ᵀ after r
steps (X g̃_1ᵀ computed once for all rows, as X W_0ᵀ) and Δ gains −η (1 − β) K g̃_1 for
the client's K steps. The factors are β G_r.

BLUR (DP-FedAvg-BLUR's penalty, :func:`algorithms.pieces.regularizers.blur_loss`:
(λ/2)·max(0, ‖w − x^t‖² − C²)) adds λ (w − x^t) to a step's gradient while the client is
outside the ball. For the first layer w − x^t is −η Σ_r G_rᵀ X_r, so ‖·‖² is
η² Σ_{r,r'} ⟨G_r G_r'ᵀ, X_r X_r'ᵀ⟩ (the Gram matrix again), and the step
W ← W − η (Gᵀ X + λ (W − W_0)) multiplies every earlier factor by 1 − η λ.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.pieces.steps import pgn_public, round_lr
from algorithms.pipeline import BLUR, PGNStep, SAMStep, SGDStep
from engine.federated.local_training import LocalResult, OneByOneTrainer

__all__ = [
    "DeltaResult",
    "DenseSGDTrainer",
    "deltas_into",
    "dense_sgd_reason",
    "group_sgd_step",
    "hand_written_reason",
    "stacked_layers",
    "weight_bias_pairs",
]

#: Clients trained together (one group: their examples gathered at once, their
#: other layers stacked); a group's working memory is kept under GROUP_BYTES.
MAX_GROUP = 32
GROUP_BYTES = 64 * 2**20
#: A client with more rows (steps × batch) than this, or than the first layer's
#: input width, is trained with every layer stepped (no factors): the factors' cost
#: grows with rows², a stepped first layer's with its width.
MAX_ROWS = 1024
#: Added to ‖g‖ in SAM's e = ρ g/(‖g‖ + eps), as :func:`algorithms.pieces.steps.sam_perturbation`
SAM_EPS = 1e-12


def dense_sgd_reason(base: OneByOneTrainer) -> str | None:
    """Why ``base``'s clients cannot be trained by :class:`DenseSGDTrainer`, or None: it
    takes plain SGD, SAM, ASAM or PGN steps, and BLUR's penalty under plain SGD."""
    pipe = base.pipeline
    if base.dense is None:
        return "not a dense model with the plain cross-entropy"
    if type(pipe.step) not in (SGDStep, SAMStep, PGNStep):
        return "the step rule is neither plain SGD, SAM nor PGN"
    if pipe.regularizer is not None and (
        type(pipe.regularizer) is not BLUR or type(pipe.step) is not SGDStep
    ):
        return "a regularizer other than BLUR under plain SGD changes the steps"
    return hand_written_reason(base)


def hand_written_reason(base: OneByOneTrainer) -> str | None:
    """What every hand-written trainer (this module's, and
    :mod:`engine.federated.head_training`'s) needs besides its model and step rule, or
    None: the plain mean cross-entropy, no personal head, no constraint, no momentum or
    weight decay, and the CPU."""
    pipe, spec = base.pipeline, base.spec
    if type(base.loss_fn) is not torch.nn.CrossEntropyLoss or not _plain_ce(base.loss_fn):
        return "the loss is not the plain mean cross-entropy"
    if pipe.personal is not None:
        return "personal heads train head and body in separate phases"
    if pipe.constraint is not None:
        return "a constraint changes the steps"
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
        step = base.pipeline.step
        #: SAM's radius ρ (0: plain SGD): each step's gradient is taken at w + ρ g/‖g‖
        self.rho = float(step.rho) if type(step) is SAMStep else 0.0
        #: ASAM: e = ρ T² g/‖T g‖ with T = |w| coordinate by coordinate, so every client's
        #: first-layer weight is needed: every layer is stacked and stepped (no factors)
        self.asam = self.rho > 0 and bool(step.asam)
        #: PGN's β (None: not PGN): each step's direction is β∇F(w + δ) + (1 − β) g̃
        self.beta = float(step.beta) if type(step) is PGNStep else None
        self.pgn_rho = float(step.rho) if type(step) is PGNStep else 0.0
        #: BLUR's (λ, C) (None: no regulariser, or λ = 0, which is plain SGD)
        reg = base.pipeline.regularizer
        self.blur = (float(reg.lam), float(reg.clip_norm)) if type(reg) is BLUR else None
        if self.blur is not None and self.blur[0] == 0.0:
            self.blur = None
        if self.blur is not None:
            self.note = "dense SGD + BLUR in groups of <= 32 (the first layer's steps as factors)"
        elif self.beta is not None:
            self.note = "dense PGN in groups of <= 32 (the first layer's steps as factors)"
        elif self.asam:
            self.note = "dense ASAM in groups of <= 32 (every layer stacked and stepped)"
        else:
            rule = "SAM" if self.rho > 0 else "SGD"
            self.note = f"dense {rule} in groups of <= 32 (the first layer's steps as factors)"

    def local_gradient(self, client: int, local: torch.Tensor) -> torch.Tensor:
        return self.base.local_gradient(client, local)

    def _layers(self, global_flat: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """(weight, bias or None) views of ``global_flat`` per Linear layer."""
        views = [
            t.view(p.shape) for t, p in zip(torch.split(global_flat, self.sizes), self.base.params)
        ]
        return self._pairs(views)

    def _pairs(self, views: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """Per-parameter tensors ``views`` as (weight, bias or None) per Linear layer."""
        return weight_bias_pairs(views, self.dense.biases)

    @torch.no_grad()
    def train(
        self, global_flat: torch.Tensor, rnd: int, clients: Sequence[int] | np.ndarray, public: dict
    ) -> Iterator[LocalResult]:
        spec = self.base.spec
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        layers = self._layers(global_flat)
        pgn = self._pgn_public(public)
        clients = [int(c) for c in clients]
        cap = 0 if self.asam else min(MAX_ROWS, self.width)
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
                        [batches[i] for i in group], layers, lr, as_factors, pgn
                    )
                    for k, i in enumerate(group):
                        delta = deltas[k]
                        done[i] = DeltaResult(
                            chunk[i], global_flat, losses[k], len(batches[i]), delta
                        )
            for i in range(len(chunk)):
                yield done.pop(i)

    def _pgn_public(self, public: dict) -> _PGN | None:
        """PGN's public inputs of the round (:func:`algorithms.pieces.steps.pgn_public`,
        the same for every client) per layer; None when the step is not PGN."""
        if self.beta is None:
            return None
        g_list = (public or {}).get("g_tilde_list")
        g_tilde, delta = pgn_public(
            self.base.params, beta=self.beta, rho=self.pgn_rho, g_tilde=g_list
        )
        gt = self._pairs(g_tilde) if g_tilde is not None else None
        d = self._pairs(delta) if delta is not None else None
        c = 0.0  # δ = c g̃ (pgn_public: ρ g̃/(‖g̃‖ + 1e-12)), so X δ_1ᵀ = c X g̃_1ᵀ
        if g_tilde is not None and delta is not None:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(t) for t in g_tilde])
            )
            c = float(self.pgn_rho / (norm + 1e-12))
        return _PGN(self.beta, gt, d, c)

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
        pgn: _PGN | None = None,
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
            return self._explicit_group(x, y, wt, layers, lr, steps, width, pgn)
        p = torch.mm(x.reshape(g_n * rows, -1), w1.t()).view(g_n, rows, -1)  # x W_0ᵀ
        # PGN: a client's real steps (its batches come first), and x g̃_1ᵀ for the drift
        active = (wt.sum(2) > 0).to(w1.dtype)  # (G, steps)
        before = active.cumsum(1) - active  # real steps before step s
        q = None
        if pgn is not None and pgn.g_tilde is not None:
            q = torch.mm(x.reshape(g_n * rows, -1), pgn.g_tilde[0][0].t()).view(g_n, rows, -1)
        gram = torch.bmm(x, x.transpose(1, 2))
        g: torch.Tensor | None  # a step's gradient at the first layer's output
        g_first = torch.zeros_like(p)  # G_r of every step
        b1_now = b1.expand(g_n, -1).clone() if b1 is not None else None
        rest = stacked_layers(layers[1:], g_n)
        loss_acc = torch.zeros(g_n, dtype=torch.float64)
        for s in range(steps):
            a, e = s * width, (s + 1) * width
            z = p[:, a:e] if b1_now is None else p[:, a:e] + b1_now.unsqueeze(1)
            if s > 0:  # the first layer's earlier steps, as factors
                z = torch.baddbmm(z, gram[:, a:e, :a], g_first[:, :a], alpha=-lr)
            if pgn is not None:
                loss, g = self._pgn_factored(
                    z, y[:, s], wt[:, s], rest, q, a, e, pgn, lr, active[:, s], before[:, s]
                )
                if b1_now is not None:  # the first bias's step along β g + (1 − β) g̃
                    _pgn_descend_bias(b1_now, g, pgn, 0, active[:, s], lr)
                g_first[:, a:e] = g.mul_(pgn.beta)
                loss_acc += loss.double()
                continue
            if self.blur is not None:
                lam, clip = self.blur
                # ‖w − x^t‖² before the step: the first layer's Δ from its factors,
                # ‖Σ_r G_rᵀ X_r‖² = Σ_{r,r'} ⟨G_r G_r'ᵀ, X_r X_r'ᵀ⟩ (η² times it)
                sq = _squared_distance(rest, layers[1:], z)
                if s > 0:
                    f = g_first[:, :a]
                    sq += lr * lr * (f * torch.bmm(gram[:, :a, :a], f)).sum((1, 2))
                if b1_now is not None:
                    sq += (b1_now - b1).pow(2).sum(1)
                on = (sq > clip * clip).to(z.dtype) * active[:, s]  # the penalty's gradient
                loss, g, grads = _group_grads(z, y[:, s], wt[:, s], rest)
                assert g is not None
                loss = loss + active[:, s] * 0.5 * lam * torch.clamp(sq - clip * clip, min=0.0)
                _blur_descend(rest, grads, layers[1:], lam * on, lr)
                if s > 0:  # the first layer's Δ shrinks by 1 − η λ: every earlier factor
                    g_first[:, :a].mul_((1.0 - lr * lam * on).view(-1, 1, 1))
                loss_acc += loss.double()
                g_first[:, a:e] = g
                if b1_now is not None:
                    pull = (lam * on).view(-1, 1) * (b1_now - b1)
                    b1_now.add_(g.sum(1) + pull, alpha=-lr)
                continue
            if self.rho == 0.0:
                loss, g = group_sgd_step(z, y[:, s], wt[:, s], rest, lr)
            else:
                loss, g = self._sam_factored(z, y[:, s], wt[:, s], rest, gram[:, a:e, a:e], lr)
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
        if q is not None and pgn is not None and pgn.g_tilde is not None:  # PGN's drift
            drift = active.sum(1).mul_(-lr * (1.0 - pgn.beta))
            delta1.add_(drift.view(-1, 1, 1) * pgn.g_tilde[0][0])
        if b1 is not None and b1_now is not None:
            torch.sub(b1_now, b1, out=out[:, at : at + b1.numel()])
            at += b1.numel()
        deltas_into(out[:, at:], layers[1:], rest)
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
        pgn: _PGN | None = None,
    ) -> tuple[list[torch.Tensor], list[float]]:
        """A group trained with every layer stacked and stepped (clients with more rows
        than the first layer's input width, for whom factors cost more)."""
        g_n = x.shape[0]
        stacked = stacked_layers(layers, g_n)
        loss_acc = torch.zeros(g_n, dtype=torch.float64)
        active = (wt.sum(2) > 0).to(x.dtype)  # (G, steps): a client's real steps
        for s in range(steps):
            a, e = s * width, (s + 1) * width
            if self.blur is not None:  # every layer stepped, pulled back outside the ball
                lam, clip = self.blur
                sq = _squared_distance(stacked, layers, x)
                on = (sq > clip * clip).to(x.dtype) * active[:, s]
                loss, _, grads = _group_grads(x[:, a:e], y[:, s], wt[:, s], stacked, True)
                loss = loss + active[:, s] * 0.5 * lam * torch.clamp(sq - clip * clip, min=0.0)
                _blur_descend(stacked, grads, layers, lam * on, lr)
            elif pgn is not None:  # β∇F(w + δ) + (1 − β) g̃, every layer stepped
                at_d = _shifted(stacked, pgn.delta) if pgn.delta is not None else stacked
                loss, _, grads = _group_grads(x[:, a:e], y[:, s], wt[:, s], at_d, True)
                _pgn_descend(stacked, grads, pgn, 0, active[:, s], lr)
            elif self.rho == 0.0:
                loss, _ = group_sgd_step(x[:, a:e], y[:, s], wt[:, s], stacked, lr, from_input=True)
            else:
                loss, _, grads = _group_grads(x[:, a:e], y[:, s], wt[:, s], stacked, True)
                if self.asam:  # ascend along T² g, T = |w|: e = ρ T (T g)/‖T g‖
                    grads = _times_abs(stacked, grads)
                c = self.rho / (_squared_norms(grads, x).sqrt() + SAM_EPS)
                if self.asam:
                    grads = _times_abs(stacked, grads)
                at_e = _perturbed(stacked, grads, c)
                _, _, grads = _group_grads(x[:, a:e], y[:, s], wt[:, s], at_e, True)
                _descend(stacked, grads, lr)
            loss_acc += loss.double()
        out = torch.empty(g_n, self.dim, dtype=x.dtype)
        deltas_into(out, layers, stacked)
        return list(out), [float(v) for v in loss_acc.tolist()]

    def _pgn_factored(
        self,
        z: torch.Tensor,
        y: torch.Tensor,
        wt: torch.Tensor,
        rest: list[tuple[torch.Tensor, Any]],
        q: torch.Tensor | None,
        a: int,
        e: int,
        pgn: _PGN,
        lr: float,
        active: torch.Tensor,
        before: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One PGN step of a factored group (:func:`algorithms.pieces.steps.pgn_gradients`):
        the gradient at w + δ, and the layers after the first stepped along
        β g + (1 − β) g̃. The first layer's weight after the client's ``before`` real
        steps carries the public drift −η (1 − β) before g̃_1 besides its factors, and
        w + δ adds δ_1 = c g̃_1: so its output gains (c − η (1 − β) before) X g̃_1ᵀ,
        from ``q`` = X g̃_1ᵀ (rows ``a:e``). Returns the loss at w + δ and the gradient
        at the first layer's output (β times it is the step's factor)."""
        if q is not None:
            coef = pgn.c - lr * (1.0 - pgn.beta) * before
            z = z + coef.view(-1, 1, 1) * q[:, a:e]
        at_d = rest
        if pgn.delta is not None:
            d_b1 = pgn.delta[0][1]
            if d_b1 is not None:
                z = z + d_b1
            at_d = _shifted(rest, pgn.delta[1:])
        loss, g, grads = _group_grads(z, y, wt, at_d)
        assert g is not None
        _pgn_descend(rest, grads, pgn, 1, active, lr)
        return loss, g

    def _sam_factored(
        self,
        z: torch.Tensor,
        y: torch.Tensor,
        wt: torch.Tensor,
        rest: list[tuple[torch.Tensor, Any]],
        gram: torch.Tensor,
        lr: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One SAM step of a factored group: the gradient g at w, e = ρ g/‖g‖ per
        client, the gradient at w + e, and the layers after the first stepped along it.
        The first layer's weight gradient is Gᵀ X (G: the gradient at its output ``z``,
        X: the minibatch), so ‖Gᵀ X‖² = ⟨G Gᵀ, X Xᵀ⟩ and its perturbed output is
        X (W + c Gᵀ X)ᵀ = z + c (X Xᵀ) G: both from the step's block of the Gram
        matrix ``gram``, without forming any client's first-layer weight. Returns the
        loss at w (SAM's, as :func:`algorithms.pieces.steps.sam_gradients`) and the
        gradient at w + e with respect to the first layer's output (its factor)."""
        loss, g, grads = _group_grads(z, y, wt, rest)
        assert g is not None
        sq = _squared_norms(grads, z) + (gram * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
        g_b = g.sum(1) if self.dense.biases[0] is not None else None
        if g_b is not None:
            sq += g_b.pow(2).sum(1)
        c = self.rho / (sq.sqrt() + SAM_EPS)
        z_e = torch.baddbmm(z, gram, g * c.view(-1, 1, 1))
        if g_b is not None:
            z_e += (c.view(-1, 1) * g_b).unsqueeze(1)
        _, g_e, grads_e = _group_grads(z_e, y, wt, _perturbed(rest, grads, c))
        assert g_e is not None
        _descend(rest, grads_e, lr)
        return loss, g_e


def _squared_distance(
    stacked: list[tuple[torch.Tensor, Any]],
    anchor: list[tuple[torch.Tensor, Any]],
    like: torch.Tensor,
) -> torch.Tensor:
    """Each client's ‖w − x^t‖² (G,) over the stacked layers and their global values
    (none: zeros), in the dtype of ``like`` (G, ...)."""
    total = torch.zeros(like.shape[0], dtype=like.dtype)
    for (wi, bi), (w0, b0) in zip(stacked, anchor):
        total += (wi - w0).pow(2).sum((1, 2))
        if bi is not None and b0 is not None:
            total += (bi - b0).pow(2).sum(1)
    return total


def _blur_descend(
    stacked: list[tuple[torch.Tensor, Any]],
    grads: list[tuple[torch.Tensor, Any]],
    anchor: list[tuple[torch.Tensor, Any]],
    pull: torch.Tensor,
    lr: float,
) -> None:
    """SGD of the stacked layers along g + pull·(w − x^t) (BLUR's gradient; ``pull``:
    λ where a client is outside its ball, else 0, (G,)), in place."""
    for (wi, bi), (g_w, g_b), (w0, b0) in zip(stacked, grads, anchor):
        wi.add_(g_w + pull.view(-1, 1, 1) * (wi - w0), alpha=-lr)
        if bi is not None and g_b is not None:
            bi.add_(g_b + pull.view(-1, 1) * (bi - b0), alpha=-lr)


@dataclass(frozen=True)
class _PGN:
    """PGN's public inputs of a round per layer ((weight, bias) pairs): β, g̃ (None in
    the first round), δ = c g̃ (None when ρ = 0 or there is no g̃)."""

    beta: float
    g_tilde: list[tuple[torch.Tensor, Any]] | None
    delta: list[tuple[torch.Tensor, Any]] | None
    c: float


def _shifted(
    rest: list[tuple[torch.Tensor, Any]], offsets: list[tuple[torch.Tensor, Any]]
) -> list[tuple[torch.Tensor, Any]]:
    """New stacked layers ``rest`` + the offsets shared by every client."""
    return [
        (wi + dw, bi + db if bi is not None and db is not None else bi)
        for (wi, bi), (dw, db) in zip(rest, offsets)
    ]


def _pgn_direction(g: torch.Tensor, gt: torch.Tensor | None, pgn: _PGN, active: torch.Tensor):
    """β g + (1 − β) g̃ for each client's row of ``g``; g̃ only on a client's real steps
    (``active``, (G,)); β g alone without g̃; g itself at β = 1."""
    if pgn.beta == 1.0:
        return g
    d = pgn.beta * g
    if gt is None:
        return d
    return d + (1.0 - pgn.beta) * active.view(-1, *([1] * (g.dim() - 1))) * gt


def _pgn_descend(
    rest: list[tuple[torch.Tensor, Any]],
    grads: list[tuple[torch.Tensor, Any]],
    pgn: _PGN,
    first: int,
    active: torch.Tensor,
    lr: float,
) -> None:
    """The stacked layers ``rest`` (layers ``first``, ``first + 1``, ... of the model)
    stepped along PGN's direction, in place."""
    for i, ((wi, bi), (g_w, g_b)) in enumerate(zip(rest, grads)):
        gt = pgn.g_tilde[first + i] if pgn.g_tilde is not None else (None, None)
        wi.add_(_pgn_direction(g_w, gt[0], pgn, active), alpha=-lr)
        if bi is not None and g_b is not None:
            bi.add_(_pgn_direction(g_b, gt[1], pgn, active), alpha=-lr)


def _pgn_descend_bias(
    b1: torch.Tensor, g: torch.Tensor, pgn: _PGN, layer: int, active: torch.Tensor, lr: float
) -> None:
    """A factored group's first bias (G, H) stepped along PGN's direction; ``g``: the
    gradient at the layer's output (G, B, H)."""
    gt = pgn.g_tilde[layer][1] if pgn.g_tilde is not None else None
    b1.add_(_pgn_direction(g.sum(1), gt, pgn, active), alpha=-lr)


def weight_bias_pairs(
    views: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> list[tuple[torch.Tensor, Any]]:
    """Per-parameter tensors ``views`` (weight, then bias where the layer has one, layer
    after layer) as (weight, bias or None) per Linear layer, ``biases`` saying which
    layers have one."""
    out, at = [], 0
    for b in biases:
        out.append((views[at], views[at + 1] if b is not None else None))
        at += 2 if b is not None else 1
    return out


def stacked_layers(
    layers: list[tuple[torch.Tensor, Any]], g_n: int
) -> list[tuple[torch.Tensor, Any]]:
    """Each layer's weight and bias repeated for ``g_n`` clients (their own copies)."""
    return [
        (w.expand(g_n, -1, -1).clone(), b.expand(g_n, -1).clone() if b is not None else None)
        for w, b in layers
    ]


class DeltaResult(LocalResult):
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


def deltas_into(
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


def _group_grads(
    z: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    rest: list[tuple[torch.Tensor, Any]],
    from_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[torch.Tensor, Any]]]:
    """The gradients of one step of a group's stacked layers ``rest`` from ``z`` (G, B,
    ·), with labels ``y`` and example weights ``w`` (G, B): ``z`` is the first layer's
    output (then ``rest`` are the layers after the first), or with ``from_input`` the
    minibatch itself (then every layer). Returns each client's mean loss over its real
    examples (0 for a client without any this step), the gradient with respect to
    ``z`` (None with ``from_input``) and each layer's (weight, bias or None) gradient.
    Changes nothing."""
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
    grads: list[tuple[torch.Tensor, Any]] = [None] * len(rest)  # type: ignore[list-item]
    for i in range(len(rest) - 1, -1, -1):
        wi, bi = rest[i]
        h_in = inputs[i]
        assert grad is not None
        grads[i] = (torch.bmm(grad.transpose(1, 2), h_in), grad.sum(1) if bi is not None else None)
        if i > 0 or not from_input:  # the input's gradient
            grad = torch.ops.aten.threshold_backward(torch.bmm(grad, wi), h_in, 0)
        else:
            grad = None
    return loss, grad, grads


def _descend(
    rest: list[tuple[torch.Tensor, Any]], grads: list[tuple[torch.Tensor, Any]], lr: float
) -> None:
    """Plain SGD of the stacked layers ``rest`` along ``grads``, in place."""
    for (wi, bi), (g_w, g_b) in zip(rest, grads):
        wi.add_(g_w, alpha=-lr)
        if bi is not None and g_b is not None:
            bi.add_(g_b, alpha=-lr)


def group_sgd_step(
    z: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    rest: list[tuple[torch.Tensor, Any]],
    lr: float,
    from_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One SGD step of a group's stacked layers ``rest`` (:func:`_group_grads`, then
    the layers move); returns each client's mean loss and the gradient with respect
    to ``z`` (None with ``from_input``)."""
    loss, grad, grads = _group_grads(z, y, w, rest, from_input)
    _descend(rest, grads, lr)
    return loss, grad


def _squared_norms(grads: list[tuple[torch.Tensor, Any]], like: torch.Tensor) -> torch.Tensor:
    """Each client's squared norm (G,) of the stacked layers' gradients ``grads`` (none:
    zeros), in the dtype of ``like`` (G, ...)."""
    total = torch.zeros(like.shape[0], dtype=like.dtype)
    for g_w, g_b in grads:
        total += g_w.pow(2).sum((1, 2))
        if g_b is not None:
            total += g_b.pow(2).sum(1)
    return total


def _times_abs(
    layers: list[tuple[torch.Tensor, Any]], grads: list[tuple[torch.Tensor, Any]]
) -> list[tuple[torch.Tensor, Any]]:
    """``|w| ⊙ g`` per stacked layer (ASAM's T_w g, T_w = |w|)."""
    return [
        (wi.abs() * g_w, bi.abs() * g_b if bi is not None and g_b is not None else None)
        for (wi, bi), (g_w, g_b) in zip(layers, grads)
    ]


def _perturbed(
    rest: list[tuple[torch.Tensor, Any]], grads: list[tuple[torch.Tensor, Any]], c: torch.Tensor
) -> list[tuple[torch.Tensor, Any]]:
    """New stacked layers ``rest + c·grads`` (``c``: one factor (G,) per client)."""
    cw = c.view(-1, 1, 1)
    out = []
    for (wi, bi), (g_w, g_b) in zip(rest, grads):
        b = bi + c.view(-1, 1) * g_b if bi is not None and g_b is not None else bi
        out.append((wi + cw * g_w, b))
    return out
