"""Client-side work: local training of a shard of the cohort into one partial sum.

A :class:`ClientWorker` is created once per worker process (a Ray actor, or in
process). It builds the model and the recipe's pipeline once and, for each client,
copies the global weights in, runs the local steps (step rule, regularizer,
constraint; a personal head first for DP²-FedSAM), forms Δ_i = w_i − x^t, applies
the client transforms, then sanitises and clips the whole update to C
(docs/algorithms.md §0 rule 2) and adds it to the shard's sum. Only that sum, counts and non-private
diagnostics leave the worker: one vector per worker per round. Personal heads never
leave: they are zeroed in Δ and kept in this worker's client-state store.

Randomness (minibatch order, client-side noise) comes from streams keyed by
(seed, round, client); clients are assigned to workers by ``client % num_workers``,
so a client's state lives where the client is trained.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from algorithms.pieces.steps import round_lr
from engine import rng as rngs
from engine.client_state import ClientStateStore
from engine.data.federated import FederatedDataset
from engine.models import build_model
from engine.privacy.mechanisms import clip_update, gaussian_noise


@dataclass(frozen=True)
class LocalSpec:
    """What a worker needs to train clients (public, identical for all clients)."""

    seed: int
    model_name: str
    epochs: int
    batch_size: int
    lr: float
    lr_decay: float
    momentum: float
    weight_decay: float
    #: algorithms.pipeline.Pipeline, built once per run (simulate.prepare); the same
    #: object the server holds, so C and the noise's z are read from one privatizer
    pipeline: Any
    num_threads: int = 1
    denominator: float = 1.0
    steps: int | None = None  # exactly this many local steps per client (public K)
    state_dir: str | None = None
    clients_per_batch: int | None = None  # vectorised group size; None: from memory
    memory_format: str = "contiguous"  # model.memory_format: auto | contiguous | channels_last
    model_init: str = "default"  # model.init: default | zeros
    device: str = "cpu"  # ray.worker_device: auto | cpu | cuda (see resolve_worker_device)
    gpu_share: float = 0.0  # this worker's Ray GPU fraction (sizes vectorised groups)
    secure: bool = False  # release mode: client-side noise from the OS CSPRNG


@dataclass
class PartialSum:
    """A shard's contribution to one round.

    ``update_sum`` is the sum of clipped updates (float64). Everything else except
    ``num_clients`` is a non-private diagnostic computed from raw updates.
    """

    update_sum: np.ndarray
    num_clients: int
    norm_sum: float = 0.0
    num_clipped: int = 0
    num_nonfinite: int = 0
    loss_sum: float = 0.0
    num_steps: int = 0
    max_clipped_norm: float = 0.0  # largest norm after clipping (contract checks)


def flatten_params(model: nn.Module) -> torch.Tensor:
    """A new contiguous float32 vector of all trainable parameters (not a view)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def load_flat_(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy ``flat`` into the model's parameters (copies; never makes them views)."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} entries, model has {offset}")


def personal_mask(model: nn.Module, layers: int) -> torch.Tensor:
    """Bool mask over the flat parameters of the last ``layers`` Linear modules."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if layers > len(linears):
        raise ValueError(f"algo.personal_layers={layers}: the model has {len(linears)} Linear")
    head = {id(p) for m in linears[-layers:] for p in m.parameters()}
    parts = [
        torch.full((p.numel(),), id(p) in head, dtype=torch.bool)
        for p in model.parameters()
        if p.requires_grad
    ]
    return torch.cat(parts)


def reduce_partials(partials: list[PartialSum], dim: int) -> PartialSum:
    """Sum partials in the given (shard) order — the one reduction every executor uses."""
    total = PartialSum(update_sum=np.zeros(dim, np.float64), num_clients=0)
    for p in partials:
        total.update_sum += p.update_sum
        total.num_clients += p.num_clients
        total.norm_sum += p.norm_sum
        total.num_clipped += p.num_clipped
        total.num_nonfinite += p.num_nonfinite
        total.loss_sum += p.loss_sum
        total.num_steps += p.num_steps
        total.max_clipped_norm = max(total.max_clipped_norm, p.max_clipped_norm)
    return total


def owner_shard(clients: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (worker) that always trains each client of a recipe with per-client
    state: ``c mod num_shards``, so a client's state lives with one worker."""
    return np.asarray(clients, dtype=np.int64) % num_shards


def shard_cohort(
    cohort: np.ndarray, num_shards: int, costs: np.ndarray | None = None
) -> list[np.ndarray]:
    """Split a round's cohort over ``num_shards`` workers; each shard ascending.

    Without ``costs`` (recipes with per-client state) shard k holds the clients c with
    c % num_shards == k: sticky, a client is always trained by the worker where its
    state lives. With ``costs`` (estimated work per client, indexed by client id) the
    split balances the work: longest first, each client to the shard with the least
    work so far (ties to the lower shard, equal costs by client id). Deterministic in
    (cohort, costs), so every executor and every re-run forms the same shards. It
    decides only which process trains a client and the float64 summation order of the
    clipped updates, never which clients take part or what is released.
    """
    cohort = np.sort(np.asarray(cohort, dtype=np.int64))
    if costs is None or num_shards <= 1:
        owner = owner_shard(cohort, num_shards)
        return [cohort[owner == k] for k in range(num_shards)]
    order = cohort[np.argsort(-np.asarray(costs)[cohort], kind="stable")]
    load = np.zeros(num_shards)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for c in order:
        k = int(np.argmin(load))
        members[k].append(int(c))
        load[k] += costs[c]
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def client_costs(dataset: FederatedDataset, spec: LocalSpec) -> np.ndarray | None:
    """Estimated local work per client (examples processed, plus one batch for the
    per-client overhead of loading, differencing and clipping), for ``shard_cohort``;
    ``None`` for recipes with per-client state, whose shards must stay sticky."""
    if spec.pipeline.personal is not None:
        return None
    sizes = dataset.client_sizes().astype(np.float64)
    bs = spec.batch_size
    if spec.steps is not None:
        examples = np.where(sizes > 0, spec.steps * np.minimum(sizes, bs), 0.0)
    else:
        examples = spec.epochs * sizes
    return examples + bs


def init_process_model(
    seed: int,
    model_name: str,
    dataset: FederatedDataset,
    num_threads: int,
    memory_format: str = "contiguous",
    device: torch.device | str = "cpu",
    model_init: str = "default",
) -> nn.Module:
    """Pin this process's torch threads and build the run's initial model (same on
    every process: it is drawn on the CPU from the (seed, MODEL_INIT) stream, then
    moved to ``device``), laid out in ``memory_format`` (see
    :func:`resolve_memory_format`)."""
    torch.set_num_threads(max(1, int(num_threads)))
    init = rngs.torch_gen(seed, rngs.MODEL_INIT)
    model = build_model(model_name, dataset.input_shape, dataset.num_classes, init, model_init)
    device = torch.device(device)
    model = model.to(device)
    if resolve_memory_format(memory_format, model, device) == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    return model


def configure_cuda_numerics() -> None:
    """IEEE float32 and deterministic kernels for a worker that trains on a GPU.

    * Same seed, same GPU and software: same run. cuDNN's autotuner may pick
      different kernels per process and some kernels accumulate atomically, so the
      autotuner is off and cuDNN is deterministic.
    * TF32 is off for convolutions and matrix products (PyTorch enables it for cuDNN
      convolutions by default): TF32 keeps 10 mantissa bits, so a GPU run would differ
      from the CPU run of the same seed by ~1e-3 relative per step instead of float32
      rounding, and the vectorised probe (``engine.vectorized``), which checks a
      group's gradients against plain autograd, failed on every conv model and left
      GPU workers training one client at a time.
    """
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _ray_gpu_ids() -> list:
    """GPU ids Ray assigned to this process (empty outside a Ray worker or without a
    GPU share). Ray is never imported here: a process that has not imported it is not
    a Ray actor."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    try:
        return list(ray.get_gpu_ids())
    except Exception:  # the driver of a local run, or an older Ray
        return []


def resolve_worker_device(requested: str, gpu_ids: list | None = None) -> torch.device:
    """The device a client worker trains on (``ray.worker_device``).

    ``cpu``: the CPU. ``auto``: the GPU that Ray assigned to this actor (``cuda:0`` of
    the ``CUDA_VISIBLE_DEVICES`` Ray sets from ``ray.num_gpus_per_worker``; workers
    sharing a GPU fractionally all see it as ``cuda:0``), the CPU when Ray gave it
    none. ``cuda``: ``cuda:0`` whether or not Ray assigned it (e.g. ``executor=local``
    on a GPU machine). A GPU that was asked for but that torch cannot use is an error,
    never a silent fallback to the CPU.

    Where training runs changes only float rounding: minibatch order, rand-k masks and
    all noise are drawn from CPU generators (identical on every device), and each
    update is clipped in float64 before it leaves the worker, so the sensitivity C and
    hence ε are those of a CPU run.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"ray.worker_device={requested!r} must be auto, cpu or cuda")
    if requested == "cpu":
        return torch.device("cpu")
    ids = _ray_gpu_ids() if gpu_ids is None else list(gpu_ids)
    if requested == "auto" and not ids:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        given = f"Ray gave this worker GPU ids {ids}, but " if ids else ""
        raise RuntimeError(
            f"ray.worker_device={requested}: {given}torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); install a "
            "CUDA build of torch that matches the driver, or set ray.worker_device=cpu"
        )
    return torch.device("cuda", 0)


def resolve_memory_format(
    requested: str, model: nn.Module, device: torch.device | str = "cpu"
) -> str:
    """``model.memory_format``: ``auto`` is ``channels_last`` for a model with a 2-d
    convolution trained on the CPU (measured faster there), else ``contiguous`` (on a
    GPU too: unmeasured, so PyTorch's default). Parameters keep their logical shape
    either way: flattening and loading go through ``reshape``/``copy_``, which follow
    the strides, so only the kernels' speed and rounding change."""
    if requested == "auto":
        has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
        on_cpu = torch.device(device).type == "cpu"
        return "channels_last" if has_conv and on_cpu else "contiguous"
    return requested


def batch_to_tensors(
    dataset: FederatedDataset, idx: np.ndarray, device: torch.device | None = None
) -> tuple[torch.Tensor, ...]:
    """Training examples ``idx`` (in sorted order) as tensors on ``device``."""
    batch = np.sort(idx)
    x = torch.from_numpy(np.ascontiguousarray(dataset.x_train[batch]))
    y = torch.from_numpy(np.ascontiguousarray(dataset.y_train[batch]))
    if device is not None:  # .to() of a tensor already there returns it, no copy
        x, y = x.to(device), y.to(device)
    return x, y


class LocalSGD:
    """``torch.optim.SGD``'s update (dampening 0, no Nesterov) without ``torch.optim``.

    The first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``
    (~1 s of one core): every client-worker paid it in round 1. This replicates the
    single-tensor path that ``torch.optim.SGD`` takes for CPU tensors, operation for
    operation, so the parameters are bit-identical (``tests/engine/test_engine.py`` checks it
    against ``torch.optim.SGD``): g ← g + wd·w; b ← g on the first step, else
    b ← m·b + g; w ← w − lr·b (b = g when m = 0).
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

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            if self.weight_decay != 0:
                g = g.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = torch.clone(g).detach()
                else:
                    buf.mul_(self.momentum).add_(g, alpha=1.0)
                g = buf
            p.add_(g, alpha=-self.lr)


class ClientWorker:
    """Trains clients of a shard and returns their summed clipped updates."""

    def __init__(self, dataset: FederatedDataset, spec: LocalSpec) -> None:
        self.dataset = dataset
        self.spec = spec
        self.device = resolve_worker_device(spec.device)
        if self.device.type == "cuda":
            configure_cuda_numerics()
        self.model = init_process_model(
            spec.seed,
            spec.model_name,
            dataset,
            spec.num_threads,
            spec.memory_format,
            self.device,
            spec.model_init,
        )
        self.model.train()
        self.params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.pipeline = spec.pipeline
        self.loss_fn = nn.CrossEntropyLoss()
        self.head_mask: torch.Tensor | None = None
        self.head_params: list[torch.Tensor] = []
        self.body_params: list[torch.Tensor] = []
        if self.pipeline.personal is not None:
            self.head_mask = personal_mask(self.model, self.pipeline.personal.layers).to(
                self.device
            )
            self.head_params = self._select(self.head_mask, True)
            self.body_params = self._select(self.head_mask, False)
        self.state = ClientStateStore(spec.state_dir)
        # Vectorised groups (engine.vectorized): decided once here, never per round.
        self.vectorized: Any = None  # a VectorizedTrainer when groups are used
        self.min_group = 2  # smaller groups (the rest of a shard) train one by one
        self.clients_per_batch, self.vectorized_note = self._choose_group_size()

    def ping(self) -> int:
        return int(sum(p.numel() for p in self.params))

    def device_name(self) -> str:
        """Where this worker trains: ``cpu`` or ``cuda:0 (<GPU name>)``."""
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)

    def _global_flat(self, global_weights: np.ndarray) -> torch.Tensor:
        """The round's global model as a float32 vector on this worker's device."""
        return torch.from_numpy(np.array(global_weights, dtype=np.float32)).to(self.device)

    # ------------------------------------------------------------------ batches
    def _batches(self, rnd: int, client: int, steps: int | None, epochs: int):
        """Minibatch index arrays: ``epochs`` shuffled passes, or exactly ``steps``."""
        idx = self.dataset.client_train[client]
        n, bs = len(idx), self.spec.batch_size
        if n == 0:
            return
        gen = rngs.torch_gen(self.spec.seed, rngs.CLIENT_DATA, rnd, client)
        done, passes = 0, 0
        while True:
            order = idx[torch.randperm(n, generator=gen).numpy()]
            for start in range(0, n, bs):
                yield order[start : start + bs]
                done += 1
                if steps is not None and done >= steps:
                    return
            passes += 1
            if steps is None and passes >= epochs:
                return

    def _run_steps(self, params, step_rule, batches, anchor, public, lr, plain: bool) -> tuple:
        spec, pipe = self.spec, self.pipeline
        opt = LocalSGD(
            params,
            lr=lr,
            momentum=0.0 if plain else spec.momentum,
            weight_decay=0.0 if plain else spec.weight_decay,
        )
        loss_sum, steps = 0.0, 0
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

    def _local_gradient(self, client: int) -> torch.Tensor:
        """Gradient of the client's mean training loss at the current local model."""
        from algorithms.pieces.steps import gradients

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

    def _train_one(
        self, global_flat: torch.Tensor, rnd: int, client: int, public: dict | None = None
    ) -> tuple[torch.Tensor, float, int]:
        """Local training of ``client`` from ``global_flat``; returns (Δ, loss sum, steps)."""
        from algorithms.pipeline import SGDStep

        spec, pipe = self.spec, self.pipeline
        public = dict(public or {})
        load_flat_(self.model, global_flat)
        anchor = [p.detach().clone() for p in self.params]
        lr = round_lr(spec.lr, spec.lr_decay, rnd)
        personal = pipe.personal
        loss_sum, steps = 0.0, 0
        if personal is not None:
            assert self.head_mask is not None
            saved = self.state.get(client)
            if saved is not None:
                flat = flatten_params(self.model)
                flat[self.head_mask] = saved.to(self.device)
                load_flat_(self.model, flat)
            head, body = self.head_params, self.body_params
            n_batches = math.ceil(len(self.dataset.client_train[client]) / spec.batch_size)
            hs = personal.head_steps or n_batches
            ls, st = self._run_steps(
                head, SGDStep(), self._batches(rnd, client, hs, 1), anchor, public, lr, False
            )
            bsteps = personal.body_steps or spec.steps
            ls2, st2 = self._run_steps(
                body,
                pipe.step,
                self._batches(rnd, client, bsteps, spec.epochs),
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
                self._batches(rnd, client, spec.steps, spec.epochs),
                anchor,
                public,
                lr,
                pipe.plain_sgd,
            )
        local = flatten_params(self.model)
        delta = local - global_flat
        if self.head_mask is not None:
            self.state.put(client, local[self.head_mask].cpu())  # the store clones
            delta[self.head_mask] = 0.0  # the head never leaves the client
        ctx = {
            "g_tilde": public.get("g_tilde"),
            "steps": steps,
            "lr": lr,
            "randk_mask": public.get("randk_mask"),
            "local_gradient": lambda: self._local_gradient(client),
        }
        for t in pipe.client_transforms:
            delta = t.apply(delta, ctx)
        return delta, loss_sum, steps

    def _select(self, mask: torch.Tensor, value: bool) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            n = p.numel()
            if bool(mask[offset]) == value:
                out.append(p)
            offset += n
        return out

    def public_context(self, rnd: int, public: dict | None) -> dict:
        """Tensors of the round's public state (g̃, the rand-k mask)."""
        ctx: dict[str, Any] = {}
        g = (public or {}).get("g_tilde")
        if g is not None:
            gt = torch.as_tensor(np.array(g, dtype=np.float32)).to(self.device)
            ctx["g_tilde"] = gt
            ctx["g_tilde_list"] = list(torch.split(gt, [math.prod(s) for s in self.shapes]))
            ctx["g_tilde_list"] = [t.view(s) for t, s in zip(ctx["g_tilde_list"], self.shapes)]
        rk = self.pipeline.randk
        if rk is not None:
            d = sum(math.prod(s) for s in self.shapes)
            gen = rngs.torch_gen(self.spec.seed, rngs.SERVER_PUBLIC, rnd)  # a CPU stream
            ctx["randk_mask"] = rk.mask(d, gen).to(self.device)
        return ctx

    def _choose_group_size(self) -> tuple[int, str]:
        """(group size, why): ``spec.clients_per_batch`` if set, else automatic; 1 when
        the pipeline or model cannot be vectorised (probed once, here)."""
        from engine.vectorized import (
            VectorizedTrainer,
            auto_group_size,
            cpu_prefers_one_by_one,
            unsupported_reason,
        )

        requested = self.spec.clients_per_batch
        if requested == 1:
            return 1, "ray.clients_per_worker_batch=1"
        reason = unsupported_reason(self)
        if reason is not None:
            return 1, f"one by one: {reason}"
        if requested is None:
            reason = cpu_prefers_one_by_one(self)
            if reason is not None:
                return 1, reason
        trainer = VectorizedTrainer(self)
        reason = trainer.probe()
        if reason is not None:
            return 1, f"one by one: {reason}"
        if requested is None:
            size, self.min_group, why = auto_group_size(self, trainer)
        else:
            size, why = int(requested), f"ray.clients_per_worker_batch={requested}"
        if size > 1:
            self.vectorized = trainer
        return size, why

    def _trained_clients(self, global_flat: torch.Tensor, rnd: int, clients: np.ndarray, ctx):
        """Yield (client, Δ after client transforms, loss sum, steps) in client order:
        consecutive groups of ``clients_per_batch`` clients trained vectorised (a group
        under ``min_group`` clients, e.g. a short rest, one by one), else one by one."""
        size = self.clients_per_batch if self.vectorized is not None else 1
        for start in range(0, len(clients), size):
            group = [int(c) for c in clients[start : start + size]]
            if len(group) < self.min_group:
                for c in group:
                    delta, loss_sum, steps = self._train_one(global_flat, rnd, c, ctx)
                    yield c, delta, loss_sum, steps
                continue
            local, loss_sums, steps_list = self.vectorized.train_group(global_flat, rnd, group, ctx)
            lr = round_lr(self.spec.lr, self.spec.lr_decay, rnd)
            for i, c in enumerate(group):
                delta = self._client_transforms(local[i], global_flat, c, steps_list[i], lr, ctx)
                yield c, delta, loss_sums[i], steps_list[i]

    def _client_transforms(
        self, local: torch.Tensor, global_flat: torch.Tensor, client: int, steps: int, lr, ctx
    ) -> torch.Tensor:
        """Δ = local − global and the client transforms, as at the end of ``_train_one``
        (no personal head: such pipelines are never vectorised)."""
        delta = local - global_flat

        def local_gradient() -> torch.Tensor:
            load_flat_(self.model, local)
            return self._local_gradient(client)

        tctx = {
            "g_tilde": ctx.get("g_tilde"),
            "steps": steps,
            "lr": lr,
            "randk_mask": ctx.get("randk_mask"),
            "local_gradient": local_gradient,
        }
        for t in self.pipeline.client_transforms:
            delta = t.apply(delta, tctx)
        return delta

    def train_shard(
        self, global_weights: np.ndarray, rnd: int, clients: np.ndarray, public: dict | None = None
    ) -> PartialSum:
        """Train the shard's clients and sum their clipped updates in client order.

        Clients are trained one by one, or ``clients_per_batch`` at a time as one
        vectorised computation (``engine.vectorized``; same local models to float
        rounding). Either way each client's update is clipped individually and added
        to the float64 total in the given client order, and noise is added (by the
        server, or here per client) exactly as before: vectorisation changes no
        privacy-relevant quantity.
        """
        global_flat = self._global_flat(global_weights)
        ctx = self.public_context(rnd, public)
        total = torch.zeros(global_flat.numel(), dtype=torch.float64, device=self.device)
        out = PartialSum(update_sum=np.zeros(0), num_clients=0)
        priv = self.pipeline.privatizer
        client_noise = priv is not None and priv.site == "client"
        # where client noise goes (public, per round); unused without client noise
        support = self.noise_support(ctx) if client_noise else torch.ones(0)
        clients = np.asarray(clients, dtype=np.int64)
        # C_t: the round's public clip norm under adaptive clipping, else the fixed C.
        clip = float((public or {}).get("clip_norm", self.pipeline.clip_norm))
        # z_Δ under adaptive clipping (the count release spends the rest of the budget), else z.
        z_noise = priv.update_noise_multiplier if priv is not None else 0.0
        for c, delta, loss_sum, steps in self._trained_clients(global_flat, rnd, clients, ctx):
            res = clip_update(delta, clip)
            out.max_clipped_norm = max(out.max_clipped_norm, res.out_norm)
            if client_noise:
                std = z_noise * clip / math.sqrt(self.spec.denominator)
                source = (
                    rngs.SecureRandom()
                    if self.spec.secure
                    else rngs.torch_gen(self.spec.seed, rngs.NOISE, rnd, int(c) + 1)
                )
                # drawn on the CPU: the same on every device
                noise = gaussian_noise(delta.numel(), std, source).to(self.device)
                total += res.update.double() + noise * support
            else:
                total.add_(res.update)  # promoted to float64 element-wise, no copy
            out.num_clients += 1
            out.norm_sum += res.norm if math.isfinite(res.norm) else 0.0
            out.num_clipped += int(res.clipped)
            out.num_nonfinite += int(res.nonfinite)
            out.loss_sum += loss_sum
            out.num_steps += steps
        out.update_sum = total.cpu().numpy()
        return out

    def noise_support(self, ctx: dict) -> torch.Tensor:
        """1.0 where noise is added: all released coordinates, or the public rand-k mask."""
        support = self.pipeline.noise_support(self.head_mask, lambda: ctx["randk_mask"])
        if support is None:
            d = sum(math.prod(s) for s in self.shapes)
            return torch.ones(d, dtype=torch.float64, device=self.device)
        return support

    @torch.no_grad()
    def personal_eval(self, global_weights: np.ndarray, clients: np.ndarray) -> tuple[int, int]:
        """(correct, total) of each client's own head + global body on its held-out split."""
        global_flat = self._global_flat(global_weights)
        correct, total = 0, 0
        self.model.eval()
        for c in np.asarray(clients, dtype=np.int64):
            flat = global_flat.clone()
            saved = self.state.get(int(c))
            if saved is not None and self.head_mask is not None:
                flat[self.head_mask] = saved.to(self.device)
            load_flat_(self.model, flat)
            idx = self.dataset.client_test[int(c)]
            for s in range(0, len(idx), 1024):
                x, y = batch_to_tensors(self.dataset, idx[s : s + 1024], self.device)
                correct += int((self.model(x).argmax(1) == y).sum())
                total += len(y)
        self.model.train()
        return correct, total

    def train_shard_counted(
        self, global_weights: np.ndarray, rnd: int, clients: np.ndarray, public: dict | None = None
    ) -> tuple[PartialSum, int]:
        """``train_shard`` plus its client count as a second (tiny) return value, which
        the Ray executor fetches to learn that the shard finished without moving the
        O(d) partial sum through the driver."""
        partial = self.train_shard(global_weights, rnd, clients, public)
        return partial, partial.num_clients

    @torch.no_grad()
    def evaluate_slice(
        self, global_weights: np.ndarray, start: int, stop: int
    ) -> tuple[int, float, int]:
        """(correct, loss sum, n) of the global model on test examples [start, stop).

        Executors spread the test set over the workers so evaluation runs in parallel.
        """
        from engine.evaluation import evaluate_sums

        load_flat_(self.model, self._global_flat(global_weights))
        ds = self.dataset
        return evaluate_sums(self.model, ds.x_test[start:stop], ds.y_test[start:stop])

    def client_state(self) -> dict[int, np.ndarray]:
        """A checkpointable copy of this worker's per-client state."""
        return self.state.snapshot()

    def restore_client_state(self, state: dict[int, np.ndarray]) -> None:
        self.state.restore(state)
