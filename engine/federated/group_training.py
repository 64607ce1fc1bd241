"""Vectorised local training: a group of clients trained as one batched computation.

The batched computation behind :class:`engine.federated.vectorized.GroupedTrainer`
(which :func:`engine.federated.vectorized.choose_trainer` picks and sizes):
:class:`VectorizedTrainer` trains G clients of a worker's shard at once. Their
parameters are stacked along a leading client axis and every local step is one
forward pass, ``torch.func.vmap`` over a ``torch.func.functional_call``
of the worker's model, and one backward pass of plain autograd through the sum of the
clients' losses (client i's loss depends only on its own row of the stacked
parameters, so the gradient of the sum with respect to that row is its own gradient;
``torch.func.grad`` would compute the same but imports ``torch._dynamo`` on first use,
1 s of each worker's first round on 2 cores). The result for each client is
the same local model that
:meth:`engine.federated.local_training.OneByOneTrainer.train_client` would produce for it
alone, up to float32 rounding (batched kernels sum in a different order):

* **Minibatches**: client i draws its batches from its own generator,
  :func:`engine.federated.local_training.client_batches` (stream (seed, round, client)), so at
  step t it uses exactly the indices of its sequential step t. The
  group's batches are padded to a common length with weight-0 examples (copies of the
  client's own first example of the batch, masked out of the loss) and the loss is
  Σ_{wᵢ=1} lᵢ / Σ wᵢ, the mean over the real examples, i.e. ``CrossEntropyLoss()`` of
  the sequential step.
* **Ragged clients**: clients differ in size, so in their number of steps and in
  the length of their last batch. Each step's batches are padded to the longest one;
  a client whose generator is exhausted (fewer steps, or no examples at all) is
  inactive from then on: its final parameters are stored and it is removed from the
  stacked tensors, so its parameters (and momentum buffer) cannot change and no
  zero-norm or empty-batch gradient is ever computed for it. Its loss and step counts
  stop there, exactly as in the sequential loop.
* **Step rules**: plain SGD by :func:`engine.federated.local_training.sgd_update_`, the
  one-by-one trainer's arithmetic on stacked tensors (weight decay added to the
  gradient, momentum buffer per client initialised with the first gradient, dampening
  0, no Nesterov; ``pipeline.plain_sgd`` disables both), SAM/ASAM (the perturbation is
  :func:`algorithms.pieces.steps.sam_perturbation` evaluated per client), and
  DP-FedPGN (public g̃ and perturbation from :func:`algorithms.pieces.steps.pgn_public`,
  the same for every client). The BLUR term is added to each client's loss inside the
  differentiated function; the ball projection of DP-Fed-LS is applied per client
  after every step by :meth:`algorithms.pipeline.BallProjection.project_rows_` (the
  rule of ``project_``, norm in float64, row by row).

Not covered (the worker then trains one by one): personal heads (DP²-FedSAM), other
step rules / regularizers / constraints, and models for which the probe at worker
start fails (``functional_call`` + ``vmap`` unsupported, or a gradient that does not
match plain autograd).

Privacy: vectorisation changes no privacy-relevant quantity. It only computes each
client's local model Δᵢ = wᵢ − xᵗ, from that client's own data and public state, in a
batched kernel; the worker then applies the client transforms and clips *each* client's
whole update individually (``engine.privacy.kernels.clip_update``, float64, with
non-finite updates zeroed) before summing, in the same client order as the sequential
path, and the noise is added by the server (or per client, as before) exactly as
without vectorisation. No client's data can influence another client's row: every
operation is per client along the group axis, and padding examples carry weight 0.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from algorithms.pieces.steps import pgn_public, round_lr, sam_perturbation
from algorithms.pipeline import BLUR, BallProjection, PGNStep, SAMStep, SGDStep
from engine.federated.local_training import OneByOneTrainer, sgd_update_

__all__ = ["PROBE_RTOL", "VectorizedTrainer", "unsupported_reason"]

#: The probe's tolerance: ‖vectorised gradient − autograd‖ ≤ PROBE_RTOL·‖autograd‖
#: per parameter tensor (float32 sums in another order land near 1e-6).
PROBE_RTOL = 1e-4


def unsupported_reason(base: OneByOneTrainer) -> str | None:
    """Why ``base``'s pipeline cannot be vectorised, or None if it can."""
    pipe = base.pipeline
    if pipe.personal is not None:
        return "personal heads (DP2-FedSAM) train head and body in separate phases"
    if type(pipe.step) not in (SGDStep, SAMStep, PGNStep):
        return f"step rule {type(pipe.step).__name__} has no vectorised form"
    if pipe.regularizer is not None and type(pipe.regularizer) is not BLUR:
        return f"regularizer {type(pipe.regularizer).__name__} has no vectorised form"
    if pipe.constraint is not None and type(pipe.constraint) is not BallProjection:
        return f"constraint {type(pipe.constraint).__name__} has no vectorised form"
    loss = base.loss_fn
    if not (
        type(loss) is torch.nn.CrossEntropyLoss
        and loss.weight is None
        and loss.reduction == "mean"
        and loss.label_smoothing == 0.0
    ):
        return "the loss is not the plain mean cross-entropy"
    if any(not p.requires_grad for p in base.model.parameters()):
        return "the model has frozen parameters"
    if len(list(base.model.buffers())):
        return "the model has buffers"
    if len(base.dataset.y_train) == 0:
        return "the dataset has no training examples"
    return None


class VectorizedTrainer:
    """Local training of a group of clients in one batched computation, on the model,
    data and pipeline of the one-by-one trainer ``base`` (the worker's).

    Built once per worker; :meth:`probe` must return None before :meth:`train_group`
    is used. See the module docstring for the exact semantics and the privacy note.
    """

    def __init__(self, base: OneByOneTrainer) -> None:
        self.base = base
        self.model = base.model
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.shapes = list(base.shapes)
        self.sizes = [math.prod(s) for s in self.shapes]
        self.dim = int(sum(self.sizes))
        pipe = base.pipeline
        spec = base.spec
        self.step = pipe.step
        self.regularizer = pipe.regularizer
        self.constraint = pipe.constraint
        self.momentum = 0.0 if pipe.plain_sgd else float(spec.momentum)
        self.weight_decay = 0.0 if pipe.plain_sgd else float(spec.weight_decay)
        self.activation_bytes_per_example = 0
        self.slow_ops: list[str] = []  # vmap fallbacks seen by the probe
        self._vmapped_loss: Any = None  # built by probe()

    # ----------------------------------------------------------- per-client math
    def _loss(self, params: dict, x, y, w, anchor: list[torch.Tensor]) -> torch.Tensor:
        """One client's minibatch loss: weighted mean over real examples (+ BLUR)."""
        logits = functional_call(self.model, params, (x,))
        per_example = F.cross_entropy(logits, y, reduction="none")
        # Padding (w = 0) is masked out, not multiplied: 0·inf would be NaN.
        loss = torch.where(w > 0, per_example, 0.0).sum() / w.sum().clamp(min=1.0)
        if self.regularizer is not None:
            loss = loss + self.regularizer.loss([params[n] for n in self.names], anchor)
        return loss

    def _grads_and_losses(self, params: dict, x, y, w, anchor) -> tuple[dict, torch.Tensor]:
        """Every client's gradient and loss: one vmapped forward, one backward.

        The group's losses are computed by ``vmap`` over :meth:`_loss` and differentiated
        as their sum with plain autograd: client i's loss depends only on its own row of
        the stacked parameters, so the gradient of the sum with respect to row i is
        client i's own gradient. (``torch.func.grad`` would give the same, but its first
        use imports ``torch._dynamo``, 1 s of every worker's first round on 2 cores.)
        """
        leaves = {n: params[n].detach().requires_grad_(True) for n in self.names}
        with torch.enable_grad():
            losses = self._vmapped_loss(leaves, x, y, w, anchor)
            grads = torch.autograd.grad(losses.sum(), [leaves[n] for n in self.names])
        return dict(zip(self.names, grads)), losses.detach()

    def _batched_step(self, params: dict, x, y, w, anchor, pgn_offset, g_tilde):
        """(losses, directions) of one local step of every client of the group: stacked
        params, x, y, w; the anchor and PGN's public tensors are shared by all."""
        step = self.step
        if isinstance(step, SAMStep) and float(step.rho) != 0.0:
            grads, loss = self._grads_and_losses(params, x, y, w, anchor)
            plist = [params[n].detach() for n in self.names]
            rho, asam = step.rho, step.asam
            e = vmap(lambda p, g: sam_perturbation(p, g, rho, asam))(
                plist, [grads[n] for n in self.names]
            )
            shifted = {n: p + en for n, p, en in zip(self.names, plist, e)}
            grads_at_e, _ = self._grads_and_losses(shifted, x, y, w, anchor)
            return loss, grads_at_e
        if isinstance(step, PGNStep):
            if pgn_offset is not None:  # the same offset for every row (broadcast)
                params = {n: params[n] + o for n, o in zip(self.names, pgn_offset)}
            grads, loss = self._grads_and_losses(params, x, y, w, anchor)
            beta = float(step.beta)
            if beta == 1.0:
                return loss, grads
            if g_tilde is None:
                return loss, {n: beta * grads[n] for n in self.names}
            return loss, {
                n: beta * grads[n] + (1.0 - beta) * gt for n, gt in zip(self.names, g_tilde)
            }
        grads, loss = self._grads_and_losses(params, x, y, w, anchor)
        return loss, grads

    def _pgn_public(self, public: dict) -> tuple[list | None, list | None]:
        """(perturbation δ, g̃) of DP-FedPGN: :func:`pgn_public`, the same for all."""
        step = self.step
        if not isinstance(step, PGNStep):
            return None, None
        g_tilde, delta = pgn_public(
            self.base.params, beta=step.beta, rho=step.rho, g_tilde=public.get("g_tilde_list")
        )
        return delta, g_tilde

    # ----------------------------------------------------------------- training
    def train_group(
        self, global_flat: torch.Tensor, rnd: int, clients: list[int], public: dict | None
    ) -> tuple[torch.Tensor, list[float], list[int]]:
        """Train ``clients`` together from ``global_flat``.

        Returns ``(local, loss_sums, steps)``: the clients' final local models as a
        ``(G, d)`` float32 tensor (row i is client ``clients[i]``), and per client the
        sum of its minibatch losses and its number of local steps — what
        ``OneByOneTrainer.train_client`` returns for each.
        """
        base, spec = self.base, self.base.spec
        ds = base.dataset
        public = dict(public or {})
        g = len(clients)
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        anchor = [t.view(s) for t, s in zip(torch.split(global_flat, self.sizes), self.shapes)]
        params = {
            n: a.unsqueeze(0).repeat((g,) + (1,) * a.dim()).contiguous()
            for n, a in zip(self.names, anchor)
        }
        pgn_offset, g_tilde = self._pgn_public(public)
        gens = [base.batches(rnd, int(c), spec.steps, spec.epochs) for c in clients]
        local = torch.empty(g, self.dim, dtype=global_flat.dtype, device=global_flat.device)
        steps = [0] * g
        device = global_flat.device
        loss_acc = torch.zeros(g, dtype=torch.float64, device=device)
        bufs: dict[str, torch.Tensor] = {}  # momentum buffers (per client rows)
        rows = list(range(g))  # group positions of the clients still training, in order
        pending: list[Any] = [None] * g
        while rows:
            # The next batch of every client still training; a client whose generator
            # is exhausted leaves the group for good (its parameters stop changing).
            keep = []
            for k, i in enumerate(rows):
                b = next(gens[i], None)
                if b is None:
                    local[i] = torch.cat([params[n][k].reshape(-1) for n in self.names])
                else:
                    keep.append(k)
                    pending[i] = np.sort(b)
            if len(keep) < len(rows):
                sel = torch.tensor(keep, dtype=torch.long, device=device)
                params = {n: p.index_select(0, sel) for n, p in params.items()}
                bufs = {n: b.index_select(0, sel) for n, b in bufs.items()}
                rows = [rows[k] for k in keep]
            if not rows:
                break
            batches = [pending[i] for i in rows]
            width = max(len(b) for b in batches)
            idx = np.empty((len(rows), width), dtype=np.int64)
            wts = np.zeros((len(rows), width), dtype=np.float32)
            for k, b in enumerate(batches):
                idx[k, : len(b)] = b
                idx[k, len(b) :] = b[0]  # padding: weight 0
                wts[k, : len(b)] = 1.0
                steps[rows[k]] += 1
            x = torch.from_numpy(np.ascontiguousarray(ds.x_train[idx])).to(device)
            y = torch.from_numpy(np.ascontiguousarray(ds.y_train[idx])).to(device)
            w = torch.from_numpy(wts).to(device)
            loss, grads = self._batched_step(params, x, y, w, anchor, pgn_offset, g_tilde)
            with torch.no_grad():
                at = torch.tensor(rows, dtype=torch.long, device=device)
                loss_acc.index_add_(0, at, loss.detach().double())
                for n in self.names:  # torch.optim.SGD's arithmetic, per client row
                    buf = sgd_update_(
                        params[n],
                        grads[n].detach(),
                        bufs.get(n),
                        lr,
                        self.momentum,
                        self.weight_decay,
                    )
                    if buf is not None:
                        bufs[n] = buf
                if self.constraint is not None:
                    self.constraint.project_rows_([params[n] for n in self.names], anchor)
        return local, [float(v) for v in loss_acc.tolist()], steps

    # -------------------------------------------------------------------- probe
    def probe(self) -> str | None:
        """Run one tiny vectorised step; None if it works and matches autograd.

        Two copies of two examples: client 0 with weight 1 must give the loss and
        gradient of plain autograd on the worker's model, client 1 with weight 0 a
        zero gradient, and the recipe's full step (SAM/PGN) must run. Also measures
        the activation size of one example (memory rule) and records ops that vmap
        can only run as a slow per-client loop (``slow_ops``).
        """
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                reason = self._probe()
        except Exception as e:  # noqa: BLE001 - any failure means: train one by one
            return f"functional_call/vmap failed: {type(e).__name__}: {e}"
        for w in caught:
            if "batching rule" in str(w.message):
                self.slow_ops.append(str(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return reason

    def _probe(self) -> str | None:
        self._vmapped_loss = vmap(self._loss, in_dims=(0, 0, 0, 0, None), randomness="error")
        base = self.base
        ds = base.dataset
        n = min(2, len(ds.y_train))
        ix = np.arange(n, dtype=np.int64)
        device = base.device
        x1 = torch.from_numpy(np.ascontiguousarray(ds.x_train[ix])).to(device)
        y1 = torch.from_numpy(np.ascontiguousarray(ds.y_train[ix])).to(device)
        act = [0]

        def hook(_m, _inp, out) -> None:
            outs = out if isinstance(out, tuple) else (out,)
            act[0] += sum(t.numel() * t.element_size() for t in outs if torch.is_tensor(t))

        leaves = [m for m in self.model.modules() if not list(m.children())]
        handles = [m.register_forward_hook(hook) for m in leaves]
        try:
            ref_loss = base.loss_fn(self.model(x1), y1)
        finally:
            for h in handles:
                h.remove()
        self.activation_bytes_per_example = max(1, act[0] // max(n, 1))
        ref = torch.autograd.grad(ref_loss, base.params)
        flat = torch.cat([p.detach().reshape(-1) for p in base.params])
        anchor = [t.view(s) for t, s in zip(torch.split(flat, self.sizes), self.shapes)]
        params = {
            name: a.unsqueeze(0).repeat((2,) + (1,) * a.dim())
            for name, a in zip(self.names, anchor)
        }
        x = torch.stack([x1, x1])
        y = torch.stack([y1, y1])
        w = torch.tensor([[1.0] * n, [0.0] * n], device=device)
        grads, loss = self._grads_and_losses(params, x, y, w, anchor)
        if not torch.isfinite(loss).all():
            return "non-finite probe loss"
        if not torch.allclose(loss[0], ref_loss.detach(), rtol=1e-4, atol=1e-6):
            return f"vectorised loss {float(loss[0])} != sequential {float(ref_loss)}"
        for name, r in zip(self.names, ref):
            # Relative to the tensor's norm: batched kernels sum in another order, so
            # single entries near zero may differ by more than an elementwise rtol
            # allows, while a wrong gradient is off by O(1) of its norm.
            err = float(torch.linalg.vector_norm((grads[name][0] - r).double()))
            scale = float(torch.linalg.vector_norm(r.double()))
            if not err <= PROBE_RTOL * scale + 1e-9:
                return (
                    f"vectorised gradient of {name} does not match autograd "
                    f"(relative error {err / max(scale, 1e-30):.1e} > {PROBE_RTOL:g})"
                )
            if bool(grads[name][1].abs().max() != 0):
                return f"a weight-0 client got a nonzero gradient for {name}"
        g_list = [torch.zeros_like(a) for a in anchor]
        pub = {"g_tilde_list": g_list} if isinstance(self.step, PGNStep) else {}
        offset, gt = self._pgn_public(pub)
        self._batched_step(params, x, y, w, anchor, offset, gt)
        return None

    def bytes_per_client(self) -> int:
        """Rough memory of one client of a group: stacked parameters, gradients, SAM
        copies, momentum, the new parameters, and one minibatch of activations."""
        copies = 4
        if isinstance(self.step, (SAMStep, PGNStep)):
            copies += 2
        if self.momentum != 0:
            copies += 1
        if self.constraint is not None:
            copies += 2
        acts = 3 * self.activation_bytes_per_example * self.base.spec.batch_size
        return int(self.dim * 4 * copies + acts)
