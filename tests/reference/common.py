"""Shared pieces of the independent reference implementations (imports nothing from dpfl).

Everything here is written from the papers' pseudo-code as summarised in the project's
docs/algorithms.md, in plain torch (float64, functional models, autograd for
gradients), so that ``tests/reference/test_parity.py`` can check dpfl against code that
shares none of dpfl's implementation. Public randomness (cohorts, minibatch orders,
the Gaussian noise draws, rand-k masks) is *input* here: the test reads it from dpfl's
seeded streams and passes it in, so the two computations see the same random numbers.

Parameters are kept as a list of tensors in PyTorch's natural parameter order
(``[W1, b1, W2, b2, ...]`` with ``W`` of shape (out, in)); the flat vector of a model is
their row-major concatenation in that order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

DT = torch.float64


# ------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class Problem:
    """A small federated classification problem (all arrays numpy)."""

    x: np.ndarray  # (n, D) float32 features owned by the clients
    y: np.ndarray  # (n,) int64 labels
    client_train: list[np.ndarray]  # indices into x per client
    client_test: list[np.ndarray]  # held-out indices into x per client
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def dim(self) -> int:
        return int(self.x.shape[1])


def make_problem(
    num_clients: int = 12, dim: int = 6, classes: int = 3, seed: int = 0, sizes=(5, 11)
) -> Problem:
    """Gaussian features, labels from a noisy random linear teacher; clients hold
    between ``sizes[0]`` and ``sizes[1] - 1`` training examples (so some minibatches
    are short) plus two held-out ones."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(classes, dim))
    counts = rng.integers(sizes[0], sizes[1], size=num_clients)
    n = int(counts.sum()) + 2 * num_clients
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = np.argmax(x @ teacher.T + 0.5 * rng.normal(size=(n, classes)), axis=1).astype(np.int64)
    train, test, start = [], [], 0
    for c in counts:
        train.append(np.arange(start, start + c, dtype=np.int64))
        test.append(np.arange(start + c, start + c + 2, dtype=np.int64))
        start += c + 2
    xt = rng.normal(size=(30, dim)).astype(np.float32)
    yt = np.argmax(xt @ teacher.T, axis=1).astype(np.int64)
    return Problem(x, y, train, test, xt, yt, classes)


# ----------------------------------------------------------------------------- model


def layer_sizes(model: str, dim: int, classes: int) -> list[int]:
    """Widths of the fully connected layers: logistic regression or the 200-200 MLP."""
    if model == "logreg":
        return [dim, classes]
    if model == "mlp":
        return [dim, 200, 200, classes]
    raise ValueError(model)


def shapes(model: str, dim: int, classes: int) -> list[tuple[int, ...]]:
    w = layer_sizes(model, dim, classes)
    out: list[tuple[int, ...]] = []
    for a, b in zip(w[:-1], w[1:]):
        out += [(b, a), (b,)]
    return out


def forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Linear layers with ReLU between them (params = [W1, b1, W2, b2, ...])."""
    h = x
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[2 * i].T + params[2 * i + 1]
        if i < layers - 1:
            h = torch.relu(h)
    return h


def ce_loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(forward(params, x), y)


def grad(
    params: list[torch.Tensor],
    loss_fn: Callable[[list[torch.Tensor]], torch.Tensor],
    wrt: list[int] | None = None,
) -> list[torch.Tensor]:
    """∇ of ``loss_fn(params)`` with respect to the parameters listed in ``wrt`` (all
    by default), evaluated at ``params``; the others are held fixed."""
    wrt = list(range(len(params))) if wrt is None else wrt
    leaves = [p.detach().clone().requires_grad_(i in wrt) for i, p in enumerate(params)]
    loss = loss_fn(leaves)
    gs = torch.autograd.grad(loss, [leaves[i] for i in wrt])
    return [g.detach() for g in gs]


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params])


def unflat(v: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, o = [], 0
    for p in like:
        out.append(v[o : o + p.numel()].view_as(p).clone())
        o += p.numel()
    return out


def norm(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum((t**2).sum() for t in ts))


# ------------------------------------------------------------------ local optimiser


class SGD:
    """SGD with heavy-ball momentum and L2 weight decay (the seeds' base optimiser):
    g ← g + wd·w; b ← g (first step) or m·b + g; w ← w − η·b."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.lr, self.m, self.wd = lr, momentum, weight_decay
        self.buf: list[torch.Tensor] | None = None

    def step(self, w: list[torch.Tensor], g: list[torch.Tensor]) -> list[torch.Tensor]:
        g = [gi + self.wd * wi for gi, wi in zip(g, w)]
        if self.m:
            if self.buf is None:
                self.buf = [gi.clone() for gi in g]
            else:
                self.buf = [self.m * b + gi for b, gi in zip(self.buf, g)]
            g = self.buf
        return [wi - self.lr * gi for wi, gi in zip(w, g)]


def minibatches(
    orders: Iterator[np.ndarray], batch_size: int, epochs: int, steps: int | None
) -> list[np.ndarray]:
    """``epochs`` passes over the client's data in the given shuffled orders, in
    minibatches of ``batch_size`` (the last one short), or exactly ``steps`` minibatches
    when ``steps`` is given (passes continue as needed)."""
    out: list[np.ndarray] = []
    passes = 0
    while True:
        order = next(orders)
        for s in range(0, len(order), batch_size):
            out.append(order[s : s + batch_size])
            if steps is not None and len(out) >= steps:
                return out
        passes += 1
        if steps is None and passes >= epochs:
            return out


# ------------------------------------------------------------- privacy primitives


def clip(v: torch.Tensor, c: float) -> torch.Tensor:
    """v · min(1, C/‖v‖) (whole flattened update)."""
    n = float(v.norm())
    return v if (not math.isfinite(c) or n <= c) else v * (c / n)


def top_k_mask(v: torch.Tensor, fraction: float) -> torch.Tensor:
    """Mask of the round(fraction·d) (at least 1) entries of largest |v|."""
    d = v.numel()
    k = max(1, min(d, round(fraction * d)))
    mask = torch.zeros(d, dtype=torch.bool)
    mask[torch.argsort(-v.abs(), stable=True)[:k]] = True
    return mask


def cycle_laplacian(n: int) -> torch.Tensor:
    """L of the 1-D cycle graph: 2 on the diagonal, −1 on both neighbours (wrapping)."""
    lap = 2.0 * torch.eye(n, dtype=DT)
    for i in range(n):
        lap[i, (i + 1) % n] -= 1.0
        lap[i, (i - 1) % n] -= 1.0
    return lap


def laplacian_smooth_dense(v: torch.Tensor, sigma: float) -> torch.Tensor:
    """Solve (I + σ L) x = v with a dense solver (DP-Fed-LS). Vectors of 1–2 entries
    have no cycle to smooth over and are returned unchanged."""
    n = v.numel()
    if sigma == 0 or n <= 2:
        return v.clone()
    a = torch.eye(n, dtype=DT) + sigma * cycle_laplacian(n)
    return torch.linalg.solve(a, v.to(DT))


def smooth(v: torch.Tensor, shapes_: list[tuple[int, ...]], sigma: float, scope: str):
    """Smooth each parameter tensor's row-major segment (``tensor``) or the whole vector
    (``model``); ``tensor_transposed`` smooths a (out, in) weight along its columns
    instead, the ordering mistake docs/algorithms.md §4 warns about (for the tests only)."""
    if scope == "model":
        return laplacian_smooth_dense(v, sigma)
    sizes = [math.prod(s) for s in shapes_]
    if scope == "tensor_transposed":  # a wrong order: neighbours = one input, all outputs
        out = []
        for seg, shp in zip(torch.split(v, sizes), shapes_):
            if len(shp) == 2:
                t = laplacian_smooth_dense(seg.view(shp).T.reshape(-1), sigma)
                out.append(t.view(shp[1], shp[0]).T.reshape(-1))
            else:
                out.append(laplacian_smooth_dense(seg, sigma))
        return torch.cat(out)
    return torch.cat([laplacian_smooth_dense(s, sigma) for s in torch.split(v, sizes)])
