"""Local SGD steps of a dense network written out by hand: the same arithmetic as
autograd, without autograd.

For a model that is an ``nn.Sequential`` of an optional ``Flatten``, then ``Linear``
layers with a ``ReLU`` between each two (``logreg`` and ``mlp`` of
:mod:`engine.models`), trained with the plain mean cross-entropy,
:class:`DenseSteps` computes a minibatch's loss and every parameter's gradient by
calling, in the same order and with the same operands, the kernels that autograd
calls for that model:

* forward: ``addmm(b, h, Wᵀ)`` per layer (what ``F.linear`` runs for a 2-d input),
  ``relu``, ``log_softmax`` and ``nll_loss`` (``F.cross_entropy``);
* backward: ``nll_loss``'s gradient (−1/B at each target, B the batch size) through
  ``_log_softmax_backward_data``; per layer ``Wgrad = Gᵀ·h`` (``mm`` of the
  transposed output gradient, as autograd's ``addmm`` backward computes it for a
  transposed weight), ``bgrad = ΣG`` over the batch, ``G ← G·W`` and
  ``threshold_backward`` through each ``ReLU``.

So the gradients, and the parameters after :func:`engine.federated.local_training.sgd_update_`,
are bit-identical to the autograd path's on the same device and threads (tested
against it), while a step costs the kernels and none of autograd's graph building,
module calls or buffer allocations: at the batch sizes of cross-device federated
learning (B = 10-64) and models of 10^4-10^6 parameters those are most of a step's
time on a CPU (``benchmarks/cpu_throughput.py``).

Privacy: none by itself. It only computes a client's gradients from that client's
own minibatch, as autograd would; clipping and noise follow in the worker, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseSteps"]


class DenseSteps:
    """Hand-written forward and backward of a dense ``nn.Sequential`` (see the module
    docstring); built by :meth:`of`, which returns None for any other model."""

    def __init__(self, layers: list[nn.Linear], flatten: bool) -> None:
        self.layers = layers
        self.flatten = flatten
        self.weights = [m.weight for m in layers]
        self.biases = [m.bias for m in layers]

    @classmethod
    def of(cls, model: nn.Module, params: list[torch.Tensor]) -> DenseSteps | None:
        """The hand-written steps of ``model``, or None when it is not a Sequential of
        [Flatten(start_dim=1)], Linear, (ReLU, Linear)*, with trainable parameters
        exactly its layers' weights and biases, in order, and no buffers."""
        if type(model) is not nn.Sequential or any(True for _ in model.buffers()):
            return None
        mods = list(model)
        flatten = bool(mods) and type(mods[0]) is nn.Flatten
        if flatten:
            f = mods[0]
            assert isinstance(f, nn.Flatten)
            if f.start_dim != 1 or f.end_dim != -1:
                return None
            mods = mods[1:]
        if not mods or len(mods) % 2 != 1:
            return None
        layers: list[nn.Linear] = []
        for i, m in enumerate(mods):
            if i % 2 == 0 and type(m) is not nn.Linear:
                return None
            if i % 2 == 1 and (type(m) is not nn.ReLU or m.inplace):
                return None
            if i % 2 == 0:
                assert isinstance(m, nn.Linear)
                layers.append(m)
        own = [t for m in layers for t in (m.weight, m.bias) if t is not None]
        if len(own) != len(params) or any(a is not b for a, b in zip(own, params)):
            return None
        if not all(p.requires_grad for p in own):
            return None
        return cls(layers, flatten)

    @torch.no_grad()
    def loss_and_grads(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The minibatch's mean cross-entropy and the gradients of every parameter,
        in the order of ``params`` (weight, bias per layer), as autograd computes them."""
        h = x.reshape(x.shape[0], -1) if self.flatten else x
        inputs: list[torch.Tensor] = []
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            inputs.append(h)
            z = torch.addmm(b, h, w.t()) if b is not None else torch.mm(h, w.t())
            h = torch.relu(z) if i + 1 < len(self.weights) else z
        lsm = F.log_softmax(h, 1)
        loss = F.nll_loss(lsm, y)
        # nll_loss's gradient for reduction="mean": -grad / total_weight at the targets
        g_nll = torch.zeros_like(lsm)
        g_nll.scatter_(1, y.reshape(-1, 1), -(1.0 / float(y.shape[0])))
        g = torch._log_softmax_backward_data(g_nll, lsm, 1, lsm.dtype)
        grads: list[torch.Tensor] = []
        for i in range(len(self.weights) - 1, -1, -1):
            w, b, h_in = self.weights[i], self.biases[i], inputs[i]
            layer = [torch.mm(g.t(), h_in)]
            if b is not None:
                layer.append(g.sum(0))
            grads[:0] = layer
            if i > 0:
                g = torch.ops.aten.threshold_backward(torch.mm(g, w), h_in, 0)
        return loss, grads


#: Set to "0" to train dense models through autograd instead (a benchmark's "before").
ENV = "DPFL_DENSE_STEPS"


def dense_steps_enabled() -> bool:
    """Whether trainers use :class:`DenseSteps` (on unless ``DPFL_DENSE_STEPS=0``). Either
    way the results are the same, bit for bit."""
    import os

    return os.environ.get(ENV, "1") != "0"
