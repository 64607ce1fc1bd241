"""Client workers: a shard of the cohort trained into one partial sum.

A :class:`ClientWorker` is created once per worker process (a Ray actor, or in
process). It is a thin shell around the local trainer
(:mod:`engine.federated.local_training`: one client at a time, or vectorised groups from
:mod:`engine.federated.vectorized`, chosen once at start). For each client the trainer returns
its local model w_i; the worker forms Δ_i = w_i − x^t, zeroes a personal head, applies
the client transforms, then sanitises and clips the whole update to C
(docs/algorithms.md §0 rule 2) and adds it to the shard's sum (with client-side noise
when the recipe adds it there). Only that sum, counts and non-private diagnostics
leave the worker: one vector per worker per round. Personal heads never leave: they
are zeroed in Δ and kept in this worker's client-state store.

Randomness (minibatch order, client-side noise) comes from streams keyed by
(seed, round, client); clients with per-client state are assigned to workers by
``client % num_workers`` (:func:`owner_shard`), so a client's state lives where the
client is trained.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms.pieces.steps import round_lr
from engine.data.federated import FederatedDataset
from engine.federated.local_training import LocalResult, OneByOneTrainer
from engine.federated.vectorized import choose_trainer
from engine.federated.worker_model import (
    batch_to_tensors,
    configure_cuda_numerics,
    init_process_model,
    load_flat_,
    resolve_worker_device,
)
from engine.privacy import rng as rngs
from engine.privacy.kernels import ClipScratch, clip_and_add_
from engine.privacy.mechanism import GaussianMechanism
from engine.telemetry.phases import OFF, PhaseTimer, timed


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
    #: keep a second model for evaluations beside training (ray.overlap_evaluation)
    apart_evaluation: bool = False


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
    ``None`` for recipes with per-client state, whose shards must stay sticky, and for
    an on-demand population (``dataset.materialize=false``), whose sizes are known only
    by drawing every client's (O(N) time and memory once per run): its shards are then
    count-balanced and sticky (``owner_shard``)."""
    if spec.pipeline.personal is not None:
        return None
    if dataset.meta.get("materialize", True) is False:
        return None
    sizes = dataset.client_sizes().astype(np.float64)
    bs = spec.batch_size
    if spec.steps is not None:
        examples = np.where(sizes > 0, spec.steps * np.minimum(sizes, bs), 0.0)
    else:
        examples = spec.epochs * sizes
    return examples + bs


class ClientWorker:
    """Trains clients of a shard and returns their summed clipped updates."""

    def __init__(self, dataset: FederatedDataset, spec: LocalSpec) -> None:
        self.dataset = dataset
        self.spec = spec
        self.pipeline = spec.pipeline
        priv = spec.pipeline.privatizer
        #: this worker's mechanism (clips with the round's C_t, draws client-side noise
        #: from the seeded or secure stream); None for a non-private recipe
        self.mechanism: GaussianMechanism | None = (
            priv.mechanism.bind(rngs.Randomness(spec.seed, spec.secure))
            if priv is not None
            else None
        )
        self.device = resolve_worker_device(spec.device)
        if self.device.type == "cuda":
            configure_cuda_numerics()
        model = init_process_model(
            spec.seed,
            spec.model_name,
            dataset,
            spec.num_threads,
            spec.memory_format,
            self.device,
            spec.model_init,
        )
        model.train()
        #: the reference trainer; it owns the model and the personal-head state
        self.one_by_one = OneByOneTrainer(dataset, spec, model, self.device)
        self.model, self.params = model, self.one_by_one.params
        self.shapes, self.head_mask = self.one_by_one.shapes, self.one_by_one.head_mask
        # One by one or vectorised groups (engine.federated.vectorized): decided once,
        # never per round.
        self.trainer = choose_trainer(self.one_by_one)
        self.timer: Any = OFF  # engine.telemetry.phases; a benchmark's PhaseTimer (set_timing)
        #: A second model for evaluations that run beside training
        #: (:meth:`evaluate_slice_apart`), copied here, before anything else runs. None
        #: unless ``spec.apart_evaluation``, and for a model with buffers (state besides
        #: its parameters, which training would change and the copy would not see).
        self.apart_model: torch.nn.Module | None = None
        if spec.apart_evaluation and not any(True for _ in model.buffers()):
            self.apart_model = copy.deepcopy(model)

    def set_timing(self, on: bool) -> None:
        """Record this worker's phase times (``benchmarks/round_phases.py``) or stop."""
        self.timer = PhaseTimer() if on else OFF

    def take_phase_times(self) -> dict[str, float]:
        """Phase seconds recorded since the last call (empty when not timing)."""
        return self.timer.take()

    # What the local trainer decided, for logs, results and tests.
    @property
    def vectorized(self) -> Any:
        """The VectorizedTrainer when groups are used, else None."""
        return self.trainer.vectorized

    @property
    def clients_per_batch(self) -> int:
        return int(self.trainer.group_size)

    @property
    def min_group(self) -> int:
        """Smaller groups (the rest of a shard) train one by one."""
        return int(self.trainer.min_group)

    @property
    def vectorized_note(self) -> str:
        return self.trainer.note

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

    def public_context(self, rnd: int, public: dict | None) -> dict:
        """Tensors of the round's public state: each model-sized vector the server step
        made public, as a float32 vector ``name`` on this
        worker's device and per tensor as ``name_list``; the rand-k mask."""
        ctx: dict[str, Any] = {}
        for name, value in (public or {}).items():
            if not isinstance(value, np.ndarray):
                continue  # None (nothing yet), or a scalar such as C_t
            vec = torch.as_tensor(np.array(value, dtype=np.float32)).to(self.device)
            ctx[name] = vec
            parts = torch.split(vec, [math.prod(s) for s in self.shapes])
            ctx[f"{name}_list"] = [t.view(s) for t, s in zip(parts, self.shapes)]
        rk = self.pipeline.randk
        if rk is not None:
            d = sum(math.prod(s) for s in self.shapes)
            gen = rngs.torch_gen(self.spec.seed, rngs.SERVER_PUBLIC, rnd)  # a CPU stream
            ctx["randk_mask"] = rk.mask(d, gen).to(self.device)
        return ctx

    def _update(
        self,
        res: LocalResult,
        global_flat: torch.Tensor,
        lr: float,
        ctx,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Δ = w_i − x^t with a personal head zeroed (it never leaves the client), then
        the recipe's client transforms — the same for every trainer. Δ is written into
        ``out`` when given (a buffer reused from client to client: nothing keeps a
        client's Δ past its clip and addition)."""
        if res.delta is not None:  # computed by the trainer (engine.federated.dense_training)
            delta = res.delta
        elif out is not None:
            delta = torch.sub(res.local, global_flat, out=out)
        else:
            delta = res.local - global_flat
        if self.head_mask is not None:
            delta[self.head_mask] = 0.0
        tctx = {
            **ctx,  # the round's public state (the server step's vectors, rand-k's mask)
            "steps": res.steps,
            "lr": lr,
            "local_gradient": lambda: self.trainer.local_gradient(res.client, res.local),
        }
        for t in self.pipeline.client_transforms:
            delta = t.apply(delta, tctx)
        return delta

    def train_shard(
        self,
        global_weights: np.ndarray,
        rnd: int,
        clients: np.ndarray,
        public: dict | None = None,
        sum_out: np.ndarray | None = None,
    ) -> PartialSum:
        """Train the shard's clients and sum their clipped updates in client order.

        Clients are trained one by one, or ``clients_per_batch`` at a time as one
        vectorised computation (``engine.federated.vectorized``; same local models to float
        rounding). Either way each client's update is clipped individually and added
        to the float64 total in the given client order, and noise is added (by the
        server, or here per client) exactly as before: vectorisation changes no
        privacy-relevant quantity.

        ``sum_out`` (float64, one entry per parameter): the sum is accumulated there
        (on the CPU) or copied there (on a GPU) and returned as ``update_sum``, so a
        caller that shares the buffer with another process moves no copy of it (the
        process executor); the same additions either way.
        """
        global_flat = self._global_flat(global_weights)
        ctx = self.public_context(rnd, public)
        d = global_flat.numel()
        if sum_out is not None and (sum_out.dtype != np.float64 or sum_out.shape != (d,)):
            raise ValueError(
                f"sum_out must be float64 of shape ({d},), got {sum_out.dtype} {sum_out.shape}"
            )
        if sum_out is not None and self.device.type == "cpu":
            total = torch.from_numpy(sum_out)
            total.zero_()
        else:
            total = torch.zeros(d, dtype=torch.float64, device=self.device)
        out = PartialSum(update_sum=np.zeros(0), num_clients=0)
        mech = self.mechanism
        client_noise = mech is not None and mech.site == "client"
        # where client noise goes (public, per round); unused without client noise
        support = self.noise_support(ctx) if client_noise else torch.ones(0)
        clients = np.asarray(clients, dtype=np.int64)
        lr = round_lr(self.spec.lr, self.spec.lr_decay, rnd)
        if mech is not None:  # C_t: the round's public clip norm (adaptive), else C_0
            mech.follow(public)
        scratch = ClipScratch()  # one float64 image of an update, reused by every client
        delta_out = torch.empty_like(global_flat)  # each client's Δ, reused likewise
        trained = self.trainer.train(global_flat, rnd, clients, ctx)
        for res in timed(trained, self.timer, "local_training"):
            delta = self._update(res, global_flat, lr, ctx, delta_out)
            if client_noise:
                assert mech is not None
                update = mech.clip(delta)
                # N(0, (z_Δ·C_t)²/m) drawn on the CPU: the same on every device
                noise = mech.client_noise(delta.numel(), rnd, res.client, self.spec.denominator)
                total += update.update.double() + noise.to(self.device) * support
            elif mech is not None:  # clipped, then added to the float64 total exactly
                update = mech.clip_and_add_(delta, total, scratch)
            else:  # non-private recipes only sanitise (C = inf), for the same diagnostics
                update = clip_and_add_(total, delta, math.inf, scratch)
            out.max_clipped_norm = max(out.max_clipped_norm, update.out_norm)
            out.num_clients += 1
            out.norm_sum += update.norm if math.isfinite(update.norm) else 0.0
            out.num_clipped += int(update.clipped)
            out.num_nonfinite += int(update.nonfinite)
            out.loss_sum += res.loss_sum
            out.num_steps += res.steps
        if sum_out is None:
            out.update_sum = total.cpu().numpy()
        else:
            if self.device.type != "cpu":
                sum_out[:] = total.cpu().numpy()
            out.update_sum = sum_out
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
            saved = self.one_by_one.state.get(int(c))
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
        with self.timer.phase("worker_shard"):
            partial = self.train_shard(global_weights, rnd, clients, public)
        return partial, partial.num_clients

    @torch.no_grad()
    def evaluate_slice(
        self, global_weights: np.ndarray, start: int, stop: int
    ) -> tuple[int, float, int]:
        """(correct, loss sum, n) of the global model on test examples [start, stop).

        Executors spread the test set over the workers so evaluation runs in parallel.
        """
        from engine.federated.evaluation import evaluate_sums

        load_flat_(self.model, self._global_flat(global_weights))
        ds = self.dataset
        return evaluate_sums(self.model, ds.x_test[start:stop], ds.y_test[start:stop])

    def evaluates_apart(self) -> bool:
        """Whether :meth:`evaluate_slice_apart` can run (``LocalSpec.apart_evaluation``
        and a model without buffers)."""
        return self.apart_model is not None

    @torch.no_grad()
    def evaluate_slice_apart(
        self, global_weights: np.ndarray, start: int, stop: int
    ) -> tuple[int, float, int]:
        """:meth:`evaluate_slice` on the apart model: the same sums bit for bit (same
        architecture, weights, batches and order), touching nothing training uses —
        the training model, its optimiser state, the random streams or the client
        state — so it may run while this worker trains the next round."""
        from engine.federated.evaluation import evaluate_sums

        if self.apart_model is None:
            raise RuntimeError("evaluate_slice_apart needs LocalSpec.apart_evaluation")
        load_flat_(self.apart_model, self._global_flat(global_weights))
        ds = self.dataset
        return evaluate_sums(self.apart_model, ds.x_test[start:stop], ds.y_test[start:stop])

    def client_state(self) -> dict[int, np.ndarray]:
        """A checkpointable copy of this worker's per-client state."""
        return self.one_by_one.state.snapshot()

    def restore_client_state(self, state: dict[int, np.ndarray]) -> None:
        self.one_by_one.state.restore(state)
