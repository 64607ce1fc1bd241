"""Vectorised local training: a group of clients trained as one batched computation.

The vectorised implementation of the local-training interface
(:mod:`engine.federated.local_training`) is :class:`GroupedTrainer`, chosen once per worker by
:func:`choose_trainer`. Its :class:`VectorizedTrainer` trains G clients of a worker's
shard at once. Their parameters are stacked along a leading client axis and every
local step is one forward pass, ``torch.func.vmap`` over a ``torch.func.functional_call``
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

Privacy: vectorisation changes no privacy-relevant quantity. It only computes each
client's local model Δᵢ = wᵢ − xᵗ, from that client's own data and public state, in a
batched kernel; the worker then applies the client transforms and clips *each* client's
whole update individually (``engine.privacy.mechanisms.clip_update``, float64, with
non-finite updates zeroed) before summing, in the same client order as the sequential
path, and the noise is added by the server (or per client, as before) exactly as
without vectorisation. No client's data can influence another client's row: every
operation is per client along the group axis, and padding examples carry weight 0.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from algorithms.pieces.steps import pgn_public, round_lr, sam_perturbation
from algorithms.pipeline import BLUR, BallProjection, PGNStep, SAMStep, SGDStep
from engine.federated.local_training import LocalResult, OneByOneTrainer, sgd_update_

__all__ = [
    "DeferredTrainer",
    "GPU_MAX_GROUP",
    "GroupedTrainer",
    "choose_trainer",
    "MAX_GROUP",
    "VectorizedTrainer",
    "CPU_MAX_PARAMS",
    "CPU_MIN_GROUP",
    "auto_group_size",
    "cpu_prefers_one_by_one",
    "unsupported_reason",
]

#: The probe's tolerance: ‖vectorised gradient − autograd‖ ≤ PROBE_RTOL·‖autograd‖
#: per parameter tensor (float32 sums in another order land near 1e-6).
PROBE_RTOL = 1e-4
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


def choose_trainer(base: OneByOneTrainer) -> OneByOneTrainer | GroupedTrainer | DeferredTrainer:
    """The worker's local trainer, decided once per worker (never per round): groups
    of ``ray.clients_per_worker_batch`` clients if set, else the automatic size;
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
