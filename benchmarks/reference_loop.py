"""The plain reference loop: DP-FedAvg in one process and one torch thread, the floor
dpfl's rounds are measured against (``benchmarks/bench.py``).

What is shared and what is independent
--------------------------------------
* **Shared with the engine** (to build identical inputs, not to train):
  ``engine.models.build_model`` for the architecture *and* its initialisation (the
  plain loop calls it with the same seeded generator, so both sides start from the
  same weights); ``engine.data`` for the :class:`FederatedDataset` container and, for
  the ``logreg`` workload, the engine's own ``synthetic`` generator
  (``build_dataset`` with the stream ``simulate`` uses); ``engine.config`` /
  ``engine.simulation`` to run the dpfl side.
* **Independent** (this file's own code; it imports nothing from ``engine.federated.client``,
  ``engine.federated.server``, ``engine.privacy``, ``engine.runtime.executors``,
  ``engine.privacy.rng`` or
  ``algorithms`` — ``simulate`` uses them, the plain loop never does): the local SGD
  loop, the minibatch order, the cohort sampling, the clipping, the Gaussian noise,
  the server update and the evaluation. The random streams are re-implemented from
  ``engine/privacy/rng.py``'s recipe (a ``numpy.random.SeedSequence`` over
  ``(seed, stream, round[, client])``) so that both sides draw the same cohorts
  (``g.random(N) < q``), the same minibatch order (a ``torch.randperm`` per epoch,
  batches of B, indices sorted within a batch) and the same server noise (float64
  × zC, in blocks of 2**18 values, block j from numpy's PCG64 seeded with
  ``SeedSequence(seed, spawn_key=(2, NOISE, round, j))``). The two runs therefore differ only
  by floating-point rounding (summation order, batched kernels, the engine's
  overflow-safe clipping) and agree closely: the report gives the relative L2
  difference of the two final models and the accuracy difference, which must be
  within 0.03 (exit status 1 otherwise, except with ``--quick``).
* ε is reported from dpfl's accountant only; the plain loop does not account privacy.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.measure import mb, read_status_kb, reset_peak_rss
from benchmarks.streams import (
    MODEL_INIT,
    NOISE,
    block_normals,
    minibatches,
    poisson_cohort,
    torch_stream,
)
from benchmarks.workloads import Workload
from engine.data.federated import FederatedDataset
from engine.models import build_model


def plain_layout(model: nn.Module, device: torch.device, requested: str = "auto") -> str:
    """The plain loop's memory layout: ``auto`` is the faster one on this hardware,
    ``channels_last`` for a model with 2-d convolutions on the CPU (cnn step ~8.7 →
    ~7.4 ms on the 2-core CPU), else contiguous; or the layout given."""
    if requested != "auto":
        return requested
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    return "channels_last" if has_conv and device.type == "cpu" else "contiguous"


def _transposed_linear(layer: nn.Linear):
    """A forward for ``layer`` computing x Wᵀ + b as (W xᵀ)ᵀ + b: the same product in
    plain PyTorch, through autograd, by another BLAS call."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        z = torch.mm(layer.weight, x.t()).t()
        return z + layer.bias if layer.bias is not None else z

    return forward


TRANSPOSED = "(W xt)t"


def faster_linear_forms(model: nn.Module, batch_size: int, device: torch.device) -> list[str]:
    """For each 2-d ``Linear`` of ``model``, the faster of two plain-PyTorch forms of its
    product for a batch of ``batch_size`` rows, measured here on fresh tensors of its
    shape (forward and backward, best of 5 of 10 steps each): ``F.linear``'s x Wᵀ, or
    (W xᵀ)ᵀ (:data:`TRANSPOSED`). On the 2-core Intel Xeon's MKL, x Wᵀ took 0.89 ms
    for the cnn's 3136×512 layer at 10 rows and (W xᵀ)ᵀ 0.40, a whole local step 6.5
    against 6.2 ms; dpfl's own dense head uses the second form, so the floor takes
    whichever is faster on the machine it runs on."""
    import time

    chosen = []
    for layer in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        probe = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None)
        probe = probe.to(device)
        x = torch.randn(batch_size, layer.in_features, device=device)
        times = {}
        for name, fwd in (("x Wt", probe.forward), (TRANSPOSED, _transposed_linear(probe))):
            best = math.inf
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(10):
                    torch.autograd.grad(fwd(x).sum(), [probe.weight])
                best = min(best, time.perf_counter() - t)
            times[name] = best
        chosen.append(min(times, key=lambda k: times[k]))
    return chosen


def apply_linear_forms(model: nn.Module, forms: list[str]) -> None:
    """Give ``model``'s Linear layers the forms :func:`faster_linear_forms` chose."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for layer, form in zip(layers, forms, strict=True):
        if form == TRANSPOSED:
            layer.forward = _transposed_linear(layer)  # type: ignore[method-assign]


class FlatModel:
    """A model whose trainable parameters are views of one flat float32 vector, each
    view with its parameter's strides (so a ``channels_last`` weight stays
    ``channels_last``): loading the global model is one copy, a client's update and
    its clip one flat subtraction and one reduction. Gradients stay autograd's own
    tensors (a flat gradient buffer would cost a zeroing and an accumulation pass per
    step: measured 15-25 % slower per cnn step). ``logical`` maps flat positions to
    the model's logical parameter order (``p.reshape(-1)`` concatenated), in which
    noise is drawn and weights are compared."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.dim = sum(p.numel() for p in params)
        self.flat = torch.empty(self.dim, device=device)
        logical = torch.empty(self.dim, dtype=torch.int64, device=device)
        offset = 0
        for p in params:
            n = p.numel()
            dense = p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last)
            if not dense:  # pragma: no cover - every model of the zoo is dense
                raise ValueError("a parameter that is not dense cannot be a flat view")
            view = self.flat.as_strided(p.shape, p.stride(), offset)
            view.copy_(p.detach())
            logical.as_strided(p.shape, p.stride(), offset).copy_(
                torch.arange(offset, offset + n, device=device).view(p.shape)
            )
            p.data = view
            offset += n
        self.params = params
        self.logical = logical

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat vector (of this model's size) shaped and strided like the
        parameters, in their order."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat.as_strided(p.shape, p.stride(), offset))
            offset += p.numel()
        return out

    def logical_weights(self) -> torch.Tensor:
        """The parameters in logical order (what ``engine.federated.worker_model.flatten_params``
        gives), as a new vector."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])


@torch.no_grad()
def plain_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    """Top-1 accuracy on (x, y), batched, under ``no_grad``. Until 2026-11-26 the
    decorator was missing (the floor's evaluation built autograd graphs) and batches
    held 1,000 images (256 is faster on the CPU: the cnn on 10,000 images, 2.96-4.06 s
    against 4.86-4.91 s), so final-evaluation ratios measured before then are against
    a slower floor."""
    model.eval()
    correct = 0
    for s in range(0, len(y), batch):
        correct += int((model(x[s : s + batch]).argmax(1) == y[s : s + batch]).sum())
    model.train()
    return correct / len(y) if len(y) else math.nan


def run_plain(
    w: Workload,
    ds: FederatedDataset,
    device: torch.device,
    layout: str = "auto",
    record_rounds: int = 0,
) -> dict[str, Any]:
    """DP-FedAvg in this process with one torch thread: the tight floor.

    Only what the algorithm needs: the data as tensors once (no copy), one model
    reused for every client, its parameters views of one flat vector (in-place SGD,
    one ``_foreach_add_`` per step; a client's update, its norm and its clipped
    contribution on flat vectors allocated once), batched evaluation under
    ``no_grad``, and the faster memory layout (:func:`plain_layout`). The clock
    covers model build, all rounds and the final evaluation; ``train_s`` is the time
    inside the local-step loops. The minibatches of the first ``record_rounds``
    rounds are returned (``_batches``) for the minimal loop to replay."""
    torch.set_num_threads(1)
    # the faster form of each Linear's product, measured before the clock starts (and
    # left out of a whole-process time: ``linear_probe_s``)
    t_probe = time.perf_counter()
    probe = build_model(w.model, ds.input_shape, ds.num_classes, torch_stream(w.seed, MODEL_INIT))
    linear_forms = faster_linear_forms(probe.to(device), w.batch_size, device)
    linear_probe_s = time.perf_counter() - t_probe
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    model = build_model(w.model, ds.input_shape, ds.num_classes, torch_stream(w.seed, MODEL_INIT))
    model = model.to(device)
    used = plain_layout(model, device, layout)
    if used == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    apply_linear_forms(model, linear_forms)
    model.train()
    fm = FlatModel(model, device)
    flat, dim, params = fm.flat, fm.dim, fm.params
    global_w = flat.clone()
    delta = torch.empty_like(flat)
    total = torch.zeros(dim, device=device)  # float32: a sum of ~50 clipped updates
    total_views = fm.views(total)
    shapes = [p.shape for p in params]
    x_all = torch.from_numpy(ds.x_train).to(device)  # no copy on the CPU
    y_all = torch.from_numpy(ds.y_train).to(device)
    loss_fn = nn.CrossEntropyLoss()
    denominator = w.rate * w.num_clients
    updates, steps, norm_sum, train_s, train_cpu_s = 0, 0, 0.0, 0.0, 0.0
    round_steps: list[int] = []
    round_train_s: list[float] = []
    round_train_cpu_s: list[float] = []
    batches: list[np.ndarray] = []
    t_loop = time.perf_counter()
    for rnd in range(w.rounds):
        total.zero_()
        r_steps, r_train, r_cpu = 0, 0.0, 0.0
        for c in poisson_cohort(w.num_clients, w.rate, w.seed, rnd):
            flat.copy_(global_w)
            t, c0 = time.perf_counter(), time.thread_time()
            for b in minibatches(ds.client_train[c], w.batch_size, w.epochs, w.seed, rnd, int(c)):
                bt = torch.from_numpy(b).to(device)
                loss = loss_fn(model(x_all.index_select(0, bt)), y_all.index_select(0, bt))
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    torch._foreach_add_(params, grads, alpha=-w.lr)
                r_steps += 1
                if rnd < record_rounds:
                    batches.append(b)
            r_train += time.perf_counter() - t
            r_cpu += time.thread_time() - c0
            torch.sub(flat, global_w, out=delta)
            norm = float(torch.linalg.vector_norm(delta))
            if not math.isfinite(norm):  # a diverged client contributes nothing
                norm = 0.0
            else:
                total.add_(delta, alpha=min(1.0, w.clip_norm / norm) if norm > 0 else 1.0)
            norm_sum += norm
            updates += 1
        # The engine's draw (float64, logical order), added through strided views.
        noise = torch.from_numpy(block_normals(w.seed, (NOISE, rnd), dim))
        noise = (noise * (w.noise_multiplier * w.clip_norm)).to(device, torch.float32)
        pieces = noise.split([p.numel() for p in params])
        torch._foreach_add_(total_views, [t.view(sh) for t, sh in zip(pieces, shapes)])
        global_w.add_(total, alpha=1.0 / denominator)
        steps += r_steps
        train_s += r_train
        train_cpu_s += r_cpu
        round_steps.append(r_steps)
        round_train_s.append(r_train)
        round_train_cpu_s.append(r_cpu)
    t_eval = time.perf_counter()
    flat.copy_(global_w)
    x_test = torch.from_numpy(ds.x_test).to(device)
    y_test = torch.from_numpy(ds.y_test).to(device)
    acc = plain_accuracy(model, x_test, y_test)
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    return {
        "wall_s": end - t0,
        "round_loop_s": end - t_loop,
        "eval_s": end - t_eval,
        "train_s": train_s,
        "steps": steps,
        "step_ms": 1e3 * train_s / max(1, steps),
        "outside_training_s": (end - t0) - train_s,
        "round_steps": round_steps,
        "round_train_s": round_train_s,
        "round_train_cpu_s": round_train_cpu_s,
        "train_cpu_s": train_cpu_s,
        "layout": used,
        "linear_forms": linear_forms,
        "linear_probe_s": linear_probe_s,
        "client_updates": updates,
        "test_accuracy": acc,
        "mean_update_norm": norm_sum / updates if updates else math.nan,
        "peak_rss_mb": {"driver (plain loop)": mb(read_status_kb("self"))},
        "peak_rss_reset": reset,
        "device": str(device),
        "_weights": fm.logical_weights().cpu().numpy(),
        "_batches": batches,
    }


def minimal_loop(
    w: Workload,
    ds: FederatedDataset,
    batches: list[np.ndarray],
    device: torch.device,
    layout: str,
    linear_forms: list[str] | None = None,
) -> tuple[float, float]:
    """Wall and CPU (this thread's) seconds per local step of the shortest correct
    local-SGD loop (no clipping, no cohorts, no rounds: forward, backward, update)
    replaying ``batches``, whose tensors are gathered before the clock starts; the
    plain loop's step time should match it. CPU time is what to compare on a loaded
    machine: wall time there also counts waiting for a core."""
    torch.set_num_threads(1)
    model = build_model(w.model, ds.input_shape, ds.num_classes, torch_stream(w.seed, MODEL_INIT))
    model = model.to(device)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    if linear_forms is not None:  # the plain loop's forms (faster_linear_forms)
        apply_linear_forms(model, linear_forms)
    params = list(model.parameters())
    data = [
        (torch.from_numpy(ds.x_train[b]).to(device), torch.from_numpy(ds.y_train[b]).to(device))
        for b in batches
    ]
    t, c0 = time.perf_counter(), time.thread_time()
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-w.lr)
    if device.type == "cuda":
        torch.cuda.synchronize()
    n = max(1, len(data))
    return (time.perf_counter() - t) / n, (time.thread_time() - c0) / n
