"""Benchmark dpfl against a plain single-process PyTorch DP-FedAvg loop on one workload.

Usage::

    python benchmarks/bench.py [--workload cnn|logreg|resnet18_gn] [--rounds N]
        [--workers 2] [--clients-per-batch K] [--repeats R] [--quick] [--json FILE]
        [--num-clients N] [--mean-samples S] [--test-size T]

Issue 16's CNN target (500 clients of ~35 examples, 10,000 test images, 2 workers)::

    python benchmarks/bench.py --workload cnn --mean-samples 35 --test-size 10000

One invocation runs the same workload twice — once through dpfl (``simulate`` with the
Ray executor: ``--workers`` client-worker actors of one CPU each plus the server actor)
and once through a plain loop written in this file (one process, one torch thread) —
and prints wall time, round-loop time, client updates per second, peak memory
(``VmHWM`` of the driver and of every Ray actor process) and final test accuracy of
each, the ratio dpfl / plain, and PASS/MISS against the targets "cnn on 2 CPU
workers: dpfl ≤ 0.75 × plain" and "≤ 0.6 × with dpfl's own speed-ups" (the issue names
vectorised clients and parallel evaluation; for the cnn on a CPU the gain comes from
balanced shards, the ``channels_last`` layout and the lighter clip instead, so the
verdict is printed with the configuration used). dpfl runs with
``model.memory_format=--memory-format`` (default ``auto``), the plain loop in the same
layout (``auto``: ``channels_last`` for convolutions on the CPU, the faster there).
With ``--repeats R`` the two sides run alternately R times and the medians are
reported.

The plain loop is a tight floor (issue 30): the data as tensors once, one model
reused, parameters as views of one flat vector (in-place SGD,
the clip on a flat update, no per-client allocations), batched evaluation under
``no_grad``. It prints its time per local step next to a minimal
forward/backward/update loop's on the same minibatches (its first
``--minimal-rounds`` rounds), and its time outside training. ``--workload w1`` times
the floor and ``dpfl run`` as whole processes (see :func:`w1_main`), and prints, for
each dpfl run, the CPU seconds its processes used from spawn to the rounds' start, by
role (driver, client workers, Ray's dashboard, agents, monitors, GCS and raylet),
next to the machine's busy core-seconds over that span (:func:`cpu_until_mark`): a
start whose cores are busy throughout can only get shorter by doing less.

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

What is measured
----------------
* ``wall``: plain — model build, all rounds, final evaluation; dpfl — the whole
  ``simulate(...)`` call (checks, ``ray.put`` of the dataset, starting the worker and
  server actors, all rounds, final evaluation, shutting the actors down). Starting Ray
  itself (``ray.init(address="local", num_cpus=max(2, W), include_dashboard=False)``,
  once per invocation) is in neither and is printed as ``ray startup``.
* ``round loop``: plain — the rounds and the final evaluation; dpfl — the last
  round's ``wall_time_s_nonprivate`` (from the first round's start to the end of the last round,
  evaluation included).
* ``time per local step``: plain — the time inside its local-step loops over the
  number of steps; the minimal loop's on the same batches (gathered before its clock);
  ``outside training`` = plain wall − that time.
* ``ratio`` = dpfl wall / plain wall (the PASS/MISS basis); the round-loop ratio is
  printed too. ``client updates/s`` = trained clients / wall (and / round loop).
* Peak memory: ``VmHWM`` from ``/proc/<pid>/status``. The driver's high-water mark is
  reset (``/proc/self/clear_refs``) before each side, so the plain figure is the plain
  loop's peak in the driver and the dpfl figures are sampled in ``simulate``'s
  ``on_round`` callback at the last round, for the driver and for each actor of the
  run (PIDs from ``ray.util.state.list_actors`` when the dashboard's API server
  runs — it does not here —, else from the GCS actor table, else from the actors).
  Each process's figure includes the ~0.8 GiB of imported libraries (torch, Ray).
* Timings are wall-clock on a possibly shared machine: the load average at start and
  end is printed; use ``--repeats`` (alternating sides, medians) to smooth noise.

Workloads (``--quick`` shrinks each to seconds: 200 clients with ~20 examples, q = 0.25,
4 rounds, z = 0.3 so that four rounds visibly learn, 12×12 images for ``cnn``):

* ``cnn``: MNIST-shaped (1×28×28, 10 classes) synthetic data generated here (class
  templates + noise + random shifts; offline), 500 clients with ~60 training examples
  each, the FedAvg CNN, Poisson q = 0.1 (expected cohort 50), 1 local epoch of batch 10,
  lr 0.05, C = 1, z = 1, 20 rounds, evaluation once at the end.
* ``logreg``: the engine's Synthetic(1, 1) data, 1000 clients, q = 0.05 (cohort 50),
  logistic regression, 1 local epoch of batch 10, lr 0.2, C = 1, z = 1, 20 rounds.
* ``resnet18_gn``: CIFAR-shaped (3×32×32) synthetic data, GN-ResNet-18. The plain loop
  uses CUDA when available; dpfl then gets ``ray.num_gpus_per_worker = 1/W`` and the
  device its workers actually trained on is reported. Small on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# Run as ``python benchmarks/bench.py``: use the checkout this file lives in (Ray's
# workers inherit the driver's sys.path), whether or not dpfl is installed.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engine.config import load_config  # noqa: E402
from engine.data import build_dataset  # noqa: E402
from engine.data.federated import FederatedDataset  # noqa: E402
from engine.models import build_model  # noqa: E402

ACCURACY_TOLERANCE = 0.03
TARGET_RATIO = 0.75  # cnn on 2 CPU workers
TARGET_RATIO_VECTORISED = 0.6  # ... with dpfl's own speed-ups (issue: vectorised clients and
# parallel evaluation; on a CPU the cnn gains from its memory format, not from vmap)

# Stream ids, as documented in engine/privacy/rng.py (re-implemented below, not imported).
SAMPLING, NOISE, CLIENT_DATA, MODEL_INIT, DATA = 1, 2, 3, 4, 5


# --------------------------------------------------------------------------- streams
def derive_seed(seed: int, *key: int) -> int:
    """A 63-bit seed from (seed, *key): ``SeedSequence`` state, shifted right by one."""
    ss = np.random.SeedSequence([int(seed), *[int(k) for k in key]])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_stream(seed: int, *key: int) -> np.random.Generator:
    """A numpy generator keyed by (seed, *key)."""
    return np.random.default_rng(derive_seed(seed, *key))


NORMAL_BLOCK = 2**18  # engine/privacy/rng.py's block of seeded Gaussian values


def block_normals(seed: int, key: tuple[int, ...], n: int) -> np.ndarray:
    """The first n float64 N(0, 1) values of the noise stream (seed, *key): blocks of
    ``NORMAL_BLOCK``, block j from PCG64 seeded with ``SeedSequence(seed,
    spawn_key=(len(key), *key, j))``, drawn by a few threads (numpy frees the GIL)."""
    out = np.empty(n, dtype=np.float64)

    def fill(j: int) -> None:
        ss = np.random.SeedSequence(int(seed), spawn_key=(len(key), *key, j))
        part = out[j * NORMAL_BLOCK : (j + 1) * NORMAL_BLOCK]
        np.random.Generator(np.random.PCG64(ss)).standard_normal(out=part)

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        list(pool.map(fill, range(-(-n // NORMAL_BLOCK))))
    return out


def torch_stream(seed: int, *key: int) -> torch.Generator:
    """A CPU torch generator keyed by (seed, *key)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, *key))
    return g


def poisson_cohort(num_clients: int, rate: float, seed: int, rnd: int) -> np.ndarray:
    """Round ``rnd``'s Poisson cohort: every client joins with probability ``rate``."""
    g = numpy_stream(seed, SAMPLING, rnd)
    return np.flatnonzero(g.random(num_clients) < rate).astype(np.int64)


def minibatches(
    idx: np.ndarray, batch_size: int, epochs: int, seed: int, rnd: int, client: int
) -> Iterator[np.ndarray]:
    """``epochs`` shuffled passes over ``idx`` in batches (last one may be short);
    each batch's indices sorted."""
    n = len(idx)
    if n == 0:
        return
    gen = torch_stream(seed, CLIENT_DATA, rnd, client)
    for _ in range(epochs):
        order = idx[torch.randperm(n, generator=gen).numpy()]
        for start in range(0, n, batch_size):
            yield np.sort(order[start : start + batch_size])


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """One fixed benchmark workload: data, model, cohort, local steps, clip and noise."""

    name: str
    model: str
    data: str  # "templates" (generated here) or "synthetic" (engine's generator)
    config_dataset: str  # dataset.name given to dpfl (the data object is passed in)
    num_clients: int
    mean_samples: int  # average training examples per client
    input_shape: tuple[int, ...]
    num_classes: int
    test_size: int
    rate: float  # Poisson sampling rate q
    rounds: int
    epochs: int
    batch_size: int
    lr: float
    clip_norm: float
    noise_multiplier: float
    seed: int = 0
    gpu: bool = False  # use CUDA in both when available


WORKLOADS: dict[str, Workload] = {
    "cnn": Workload(
        name="cnn",
        model="cnn",
        data="templates",
        config_dataset="mnist",
        num_clients=500,
        mean_samples=60,
        input_shape=(1, 28, 28),
        num_classes=10,
        test_size=2000,
        rate=0.1,
        rounds=20,
        epochs=1,
        batch_size=10,
        lr=0.05,
        clip_norm=1.0,
        noise_multiplier=1.0,
    ),
    "logreg": Workload(
        name="logreg",
        model="logreg",
        data="synthetic",
        config_dataset="synthetic",
        num_clients=1000,
        mean_samples=60,
        input_shape=(60,),
        num_classes=10,
        test_size=0,  # the engine's public set: dataset.public_eval_clients held-out clients
        rate=0.05,
        rounds=20,
        epochs=1,
        batch_size=10,
        lr=0.2,
        clip_norm=1.0,
        noise_multiplier=1.0,
    ),
    "resnet18_gn": Workload(
        name="resnet18_gn",
        model="resnet18_gn",
        data="templates",
        config_dataset="cifar10",
        num_clients=100,
        mean_samples=40,
        input_shape=(3, 32, 32),
        num_classes=10,
        test_size=1000,
        rate=0.1,
        rounds=5,
        epochs=1,
        batch_size=16,
        lr=0.05,
        clip_norm=1.0,
        noise_multiplier=1.0,
        gpu=True,
    ),
    # pfl-research's CIFAR-10 cross-device benchmark shape: 1,000 clients of 50
    # images, 50 per round (Poisson, expected 50), 1 local epoch of batch 10, lr 0.1.
    "cifar10_pfl": Workload(
        name="cifar10_pfl",
        model="cnn",
        data="templates",
        config_dataset="cifar10",
        num_clients=1000,
        mean_samples=50,
        input_shape=(3, 32, 32),
        num_classes=10,
        test_size=2000,
        rate=0.05,
        rounds=100,
        epochs=1,
        batch_size=10,
        lr=0.1,
        clip_norm=1.0,
        noise_multiplier=1.0,
        gpu=True,
    ),
}

RESNET_CPU = {"num_clients": 20, "mean_samples": 24, "rate": 0.25, "rounds": 2, "test_size": 200}


def workload_for(
    name: str, cuda: bool, quick: bool = False, rounds: int | None = None
) -> tuple[Workload, bool]:
    """Workload ``name`` as a benchmark runs it, and whether it uses the GPU: a GPU
    workload without CUDA at its small CPU sizes (:data:`RESNET_CPU`), ``quick``'s
    tiny sizes (:func:`quick_variant`), then ``rounds`` when given."""
    w = WORKLOADS[name]
    gpu = w.gpu and cuda
    if w.gpu and not cuda:
        w = dataclasses.replace(w, **RESNET_CPU)
    if quick:
        w = quick_variant(w)
    if rounds is not None:
        w = dataclasses.replace(w, rounds=rounds)
    return w, gpu


def quick_variant(w: Workload) -> Workload:
    """Tiny sizes for CI (seconds per side on 2 cores). The noise multiplier is lowered
    to 0.3 (in both sides) so that four rounds visibly learn."""
    small: dict[str, Any] = {
        "num_clients": 200,
        "mean_samples": 20,
        "rate": 0.25,
        "rounds": 4,
        "noise_multiplier": 0.3,
    }
    if w.data == "templates":
        small["test_size"] = 400
        small["lr"] = 0.2
        if w.model == "cnn":
            small["input_shape"] = (1, 12, 12)
        else:
            small.update(input_shape=(w.input_shape[0], 8, 8), num_clients=16, mean_samples=8)
    return dataclasses.replace(w, **small)


def make_template_data(w: Workload, sizes_given: np.ndarray | None = None) -> FederatedDataset:
    """Learnable image data: per-class smooth random templates, a random shift of up to
    2 pixels, per-example contrast and pixel noise; IID clients with 0.5–1.5× the mean
    number of examples (or ``sizes_given``); a separate test set. Deterministic in
    ``w.seed``."""
    rng = numpy_stream(w.seed, DATA)
    c, h, wd = w.input_shape
    coarse = rng.normal(0.0, 1.0, (w.num_classes, c, max(2, h // 4), max(2, wd // 4)))
    shared = rng.normal(0.0, 1.0, (1, c, max(2, h // 4), max(2, wd // 4)))
    coarse = 0.6 * shared + 0.8 * coarse  # classes share structure: not linearly trivial
    ry, rx = -(-h // coarse.shape[2]), -(-wd // coarse.shape[3])
    templates = np.kron(coarse, np.ones((1, 1, ry, rx)))[:, :, :h, :wd]
    sizes = rng.integers(w.mean_samples // 2, w.mean_samples * 3 // 2 + 1, w.num_clients)
    if sizes_given is not None:  # drawn above all the same: the stream is unchanged
        sizes = np.asarray(sizes_given, dtype=np.int64)
    n_train = int(sizes.sum())

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, w.num_classes, n)
        x = templates[y] * rng.uniform(0.5, 1.5, (n, 1, 1, 1))
        shifts = rng.integers(-2, 3, (n, 2))
        for s in np.unique(shifts, axis=0):
            m = (shifts == s).all(1)
            x[m] = np.roll(x[m], (int(s[0]), int(s[1])), axis=(2, 3))
        x = x + rng.normal(0.0, 1.5, x.shape)
        return x.astype(np.float32), y.astype(np.int64)

    x_train, y_train = draw(n_train)
    x_test, y_test = draw(w.test_size)
    mu, sd = x_train.mean(), x_train.std() + 1e-6
    x_train = ((x_train - mu) / sd).astype(np.float32)
    x_test = ((x_test - mu) / sd).astype(np.float32)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    client_train = [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(len(sizes))]
    return FederatedDataset(
        name=f"{w.name}-templates",
        x_train=x_train,
        y_train=y_train,
        client_train=client_train,
        client_test=[np.zeros(0, np.int64) for _ in client_train],
        x_test=x_test,
        y_test=y_test,
        num_classes=w.num_classes,
        input_shape=tuple(w.input_shape),
        meta={"partition": "iid", "generator": "benchmarks/bench.py templates"},
    )


def make_dataset(w: Workload) -> FederatedDataset:
    """The workload's federated dataset (the same object is used by both sides)."""
    if w.data == "templates":
        return make_template_data(w)
    cfg = load_config(
        overrides=[
            "dataset.name=synthetic",
            f"dataset.num_clients={w.num_clients}",
            f"dataset.synthetic_mean_samples={w.mean_samples}",
            f"dataset.synthetic_dim={w.input_shape[0]}",
            f"dataset.synthetic_classes={w.num_classes}",
            f"seed={w.seed}",
        ]
    )
    # The stream engine.simulation.prepare() uses: (seed, DATA).
    return build_dataset(cfg.dataset, numpy_stream(w.seed, DATA))


# --------------------------------------------------------------------------- memory
def read_status_kb(pid: int | str, field_name: str = "VmHWM") -> int | None:
    """A ``/proc/<pid>/status`` field in kB (None if the process or field is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mb(kb: int | None) -> float | None:
    """kB → MiB (None stays None)."""
    return None if kb is None else kb / 1024.0


def actor_pids(run_name: str, executor: Any) -> tuple[dict[str, int], str]:
    """PIDs of this run's ALIVE actors (names ``<run>:…``) and how they were found.

    ``ray.util.state.list_actors`` needs the dashboard's API server, which the
    benchmark does not start; then the GCS actor table is read instead, and as a
    last resort each actor handle of the executor reports ``os.getpid()``.
    """
    import ray

    prefix = f"{run_name}:"
    try:
        from ray.util.state import list_actors

        found = {
            a.name: int(a.pid)
            for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True, timeout=5)
            if a.name and a.name.startswith(prefix) and a.pid
        }
        if found:
            return found, "ray.util.state.list_actors"
    except Exception:  # noqa: BLE001 - no API server without the dashboard
        pass
    try:
        from ray._private import state as gcs_state

        found = {
            v["Name"]: int(v["Pid"])
            for v in gcs_state.actors().values()
            if v.get("State") == "ALIVE" and str(v.get("Name", "")).startswith(prefix)
        }
        if found:
            return found, "gcs actor table (ray._private.state.actors)"
    except Exception:  # noqa: BLE001 - private API may change
        pass
    found = {}
    pool = executor.pool  # engine.runtime.ray_pool.RayWorkerPool
    server = None if getattr(pool, "server_in_driver", False) else getattr(pool, "server", None)
    handles = [*getattr(pool, "workers", []), server]
    for i, h in enumerate(handles):
        if h is None:
            continue
        name = f"{prefix}server" if i == len(handles) - 1 else f"{prefix}client-worker-{i}"
        found[name] = int(ray.get(h.__ray_call__.remote(lambda self: os.getpid())))
    return found, "actor.__ray_call__(os.getpid)"


class LastRoundSampler:
    """``simulate(on_round=...)`` callback: at the last round, record VmHWM of the
    driver and of every actor of the run (before the executor closes them)."""

    def __init__(self, run_name: str, rounds: int) -> None:
        self.run_name = run_name
        self.rounds = rounds
        self.peak_mb: dict[str, float | None] = {}
        self.pids: dict[str, int] = {}
        self.pid_source = ""
        self.worker_device = "unknown"
        self.server_placement = "unknown"

    def __call__(self, row: dict, executor: Any) -> None:
        if int(row["round"]) != self.rounds:
            return
        # ray.server=auto keeps the server in the driver on one node: then "driver"
        # is the driver plus the server, and there is no server actor.
        in_driver = bool(getattr(executor.pool, "server_in_driver", False))
        self.server_placement = "driver" if in_driver else "actor"
        self.pids = {"driver": os.getpid()}
        self.peak_mb = {"driver": mb(read_status_kb("self"))}
        try:
            pids, self.pid_source = actor_pids(self.run_name, executor)
        except Exception as e:  # noqa: BLE001 - memory is reported best-effort
            pids, self.pid_source = {}, f"failed: {type(e).__name__}: {e}"
        for name in sorted(pids):
            self.pids[name] = pids[name]
            self.peak_mb[name] = mb(read_status_kb(pids[name]))
        workers = getattr(executor.pool, "workers", [])  # Ray actors; none in process
        if workers:
            try:
                import ray

                self.worker_device = str(
                    ray.get(
                        workers[0].__ray_call__.remote(
                            lambda self: str(next(self.model.parameters()).device)
                        )
                    )
                )
            except Exception:  # noqa: BLE001 - engine internals may change
                self.worker_device = "unknown"


# --------------------------------------------------------------------------- plain loop
def plain_layout(model: nn.Module, device: torch.device, requested: str = "auto") -> str:
    """The plain loop's memory layout: ``auto`` is the faster one on this hardware,
    ``channels_last`` for a model with 2-d convolutions on the CPU (cnn step ~8.7 →
    ~7.4 ms on the 2-core CPU), else contiguous; or the layout given."""
    if requested != "auto":
        return requested
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    return "channels_last" if has_conv and device.type == "cpu" else "contiguous"


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
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    model = build_model(w.model, ds.input_shape, ds.num_classes, torch_stream(w.seed, MODEL_INIT))
    model = model.to(device)
    used = plain_layout(model, device, layout)
    if used == "channels_last":
        model = model.to(memory_format=torch.channels_last)
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
    w: Workload, ds: FederatedDataset, batches: list[np.ndarray], device: torch.device, layout: str
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


# --------------------------------------------------------------------------- dpfl side
def dpfl_overrides(
    w: Workload,
    workers: int,
    clients_per_batch: int | None,
    gpu: bool,
    memory_format: str = "auto",
) -> list:
    """``--set`` overrides expressing the workload for dpfl."""
    out = [
        "algorithm=dp_fedavg",
        f"seed={w.seed}",
        f"rounds={w.rounds}",
        f"dataset.name={w.config_dataset}",
        f"dataset.num_clients={w.num_clients}",
        f"model.name={w.model}",
        f"model.memory_format={memory_format}",
        "sampling.mode=poisson",
        f"sampling.rate={w.rate}",
        f"eval.every={w.rounds}",
        "privacy.epsilon=null",
        f"privacy.noise_multiplier={w.noise_multiplier}",
        f"privacy.clip_norm={w.clip_norm}",
        f"local.epochs={w.epochs}",
        f"local.batch_size={w.batch_size}",
        f"local.lr={w.lr}",
        "ray.executor=ray",
        f"ray.num_workers={workers}",
        "ray.num_cpus_per_worker=1",
    ]
    if clients_per_batch is not None:
        out.append(f"ray.clients_per_worker_batch={clients_per_batch}")
    if gpu:
        out.append(f"ray.num_gpus_per_worker={1.0 / workers}")
    return out


def run_dpfl(
    w: Workload, ds: FederatedDataset, overrides: list[str], run_name: str
) -> dict[str, Any]:
    """``simulate`` on the prepared dataset (Ray already started); the measurements."""
    from engine.simulation import simulate

    cfg = load_config(overrides=overrides)
    sampler = LastRoundSampler(run_name, w.rounds)
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    res = simulate(
        cfg, dataset=ds, write=False, progress=False, on_round=sampler, run_name=run_name
    )
    wall = time.perf_counter() - t0
    rows = res.rounds
    return {
        "wall_s": wall,
        "round_loop_s": float(rows["wall_time_s_nonprivate"].iloc[-1]),
        "client_updates": int(rows["realised_cohort_size_nonprivate"].sum()),
        "test_accuracy": res.final_accuracy,
        "mean_update_norm": float(
            (rows["mean_update_norm_nonprivate"] * rows["realised_cohort_size_nonprivate"]).sum()
            / max(1, int(rows["realised_cohort_size_nonprivate"].sum()))
        ),
        "epsilon": res.final_epsilon,
        "delta": float(res.privacy["delta"]),
        "accountant": str(res.privacy["accountant"]),
        "peak_rss_mb": sampler.peak_mb,
        "peak_rss_reset": reset,
        "pids": sampler.pids,
        "pid_source": sampler.pid_source,
        "worker_device": sampler.worker_device,
        "server_placement": sampler.server_placement,
        "_weights": np.asarray(res.weights, dtype=np.float32),
    }


# --------------------------------------------------------------------------- W1: whole processes
#: W1: the held-out workload of issue 30 (MNIST-shaped images, 500 clients of 34–35
#: examples, all trained on, Poisson q = 0.1, the cnn, 20 rounds, 10,000 test images
#: evaluated once at the end). Both sides run as whole processes from the same IDX
#: files; every figure is whole-process wall time or a phase of it.
W1 = Workload(
    name="w1",
    model="cnn",
    data="idx",
    config_dataset="mnist",
    num_clients=500,
    mean_samples=35,  # 17,250 examples: 250 clients of 35, 250 of 34
    input_shape=(1, 28, 28),
    num_classes=10,
    test_size=10000,
    rate=0.1,
    rounds=20,
    epochs=1,
    batch_size=10,
    lr=0.05,
    clip_norm=1.0,
    noise_multiplier=1.0,
)
W1_TRAIN = 17250


def write_idx(path: Path, array: np.ndarray) -> None:
    """``array`` (uint8) as an IDX file (the MNIST format: magic, dims, bytes)."""
    magic = bytes([0, 0, 8, array.ndim])
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(magic + dims + np.ascontiguousarray(array, np.uint8).tobytes())


def write_w1_files(w: Workload, root: Path, n_train: int = W1_TRAIN) -> Path:
    """MNIST-format files under ``root/MNIST/raw`` holding ``n_train`` training and
    ``w.test_size`` test images of :func:`make_template_data`'s generator, scaled to
    bytes; what ``dataset.name=mnist dataset.root=root`` reads."""
    one = dataclasses.replace(w, data="templates", num_clients=1, mean_samples=n_train)
    ds = make_template_data(one, sizes_given=np.array([n_train]))
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def to_bytes(x: np.ndarray) -> np.ndarray:
        return np.clip(np.rint((x[:, 0] / 6.0 + 0.5) * 255.0), 0, 255).astype(np.uint8)

    write_idx(raw / "train-images-idx3-ubyte", to_bytes(ds.x_train[:n_train]))
    write_idx(raw / "train-labels-idx1-ubyte", ds.y_train[:n_train].astype(np.uint8))
    write_idx(raw / "t10k-images-idx3-ubyte", to_bytes(ds.x_test))
    write_idx(raw / "t10k-labels-idx1-ubyte", ds.y_test.astype(np.uint8))
    return root


def w1_overrides(w: Workload, root: Path, workers: int, memory_format: str) -> list[str]:
    """``dpfl run --set`` overrides for W1: dpfl's defaults otherwise. Every client's
    examples are trained on: ``dataset.client_test_fraction=0`` explicitly (the
    default holds out a share of each client for personal metrics)."""
    out = dpfl_overrides(w, workers, None, False, memory_format)
    out = [o for o in out if not o.startswith("dataset.name=")]
    return out + [
        "dataset.name=mnist",
        f"dataset.root={root}",
        "dataset.partition=iid",
        "dataset.client_test_fraction=0",
    ]


def floor_process(args: argparse.Namespace) -> int:
    """``--floor-process FILE``: the tight floor as a whole process (what the parent
    times from spawn to exit): load W1's files with the engine's reader, run the
    plain loop, write the phase marks (``time.time()``) to FILE."""
    from engine.config import load_config
    from engine.data import build_dataset

    t_imports = time.time()
    w = dataclasses.replace(W1, seed=args.seed, rounds=args.rounds or W1.rounds)
    cfg = load_config(overrides=w1_overrides(w, args.data_root, 2, args.memory_format))
    ds = build_dataset(cfg.dataset, numpy_stream(w.seed, DATA))
    t_data = time.time()
    pr = run_plain(w, ds, torch.device("cpu"), args.memory_format)
    t_end = time.time()
    pr.pop("_batches")
    weights = pr.pop("_weights")
    pr.update(
        imports_done=t_imports,
        data_done=t_data,
        end=t_end,
        data_s=t_data - t_imports,
        client_sizes=[int(ds.client_sizes().min()), int(ds.client_sizes().max())],
        weights_norm=float(np.linalg.norm(weights)),
    )
    args.floor_process.write_text(json.dumps(pr, default=str))
    return 0


def timed_process(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """Run ``cmd``; (spawn time, exit time, exit status, its output's tail)."""
    import subprocess

    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    t1 = time.time()
    return t0, t1, proc.returncode, (proc.stdout + proc.stderr)[-3000:]


#: Ray's processes by role, from their command lines (first match wins).
CPU_ROLES = (
    ("ClientWorker", "client workers"),  # ray::<run>:client-worker-<i>:ClientWorker...
    (":Server", "server actor"),
    ("dashboard_agent", "Ray dashboard agent"),
    ("DashboardAgent", "Ray dashboard agent"),
    ("ray-dashboard-", "Ray dashboard"),
    ("dashboard.py", "Ray dashboard"),
    ("multiprocessing", "Ray dashboard"),  # the dashboard head's helper processes
    ("runtime_env_agent", "Ray runtime-env agent"),
    ("RuntimeEnvAgent", "Ray runtime-env agent"),
    ("log_monitor", "Ray monitors"),
    ("monitor.py", "Ray monitors"),
    ("default_worker", "Ray idle workers"),  # before "raylet": in its arguments
    ("ray::", "Ray idle workers"),
    ("gcs_server", "Ray GCS + raylet"),
    ("raylet", "Ray GCS + raylet"),
)


def _proc_cpu(pid: int) -> tuple[float, str] | None:
    """(user + system CPU seconds, command line) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), cmd


def _machine_busy() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the machine since boot, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def cpu_until_mark(
    cmd: list[str],
    env: dict[str, str],
    timeline: Path,
    label: str,
    every_s: float = 0.1,
    stop_title: str | None = None,
) -> tuple[float, float, int, str, dict[str, Any]]:
    """:func:`timed_process`, also sampling ``/proc`` every ``every_s`` while it runs;
    afterwards, from the sample last before the ``DPFL_TIMELINE`` mark ``label`` (the
    marks are written at exit): the CPU seconds (user + system) the process and each
    of its descendants had used since spawn, summed by role (:data:`CPU_ROLES`), and
    the machine's busy core-seconds over the same span (every process, from
    ``/proc/stat``). A process that exited before the mark keeps its last reading.
    Sampling stops once a descendant's command line contains ``stop_title`` (a Ray
    worker's title names the method it runs: something that happens only after the
    mark), so that it does not compete with what follows. Linux only."""
    import subprocess
    import tempfile

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from run_memory import descendants  # the process tree below a PID, from /proc

    with tempfile.TemporaryFile("w+") as out:
        busy0 = _machine_busy()
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=out, text=True)
        samples: list[tuple[float, tuple[int, int], dict[int, tuple[float, str]]]] = []
        sampling = True
        while sampling and proc.poll() is None:
            now = {}
            for pid in descendants(proc.pid):
                got = _proc_cpu(pid)
                if got is not None:
                    now[pid] = got
            samples.append((time.time(), _machine_busy(), now))
            sampling = stop_title is None or not any(stop_title in c for _, c in now.values())
            time.sleep(every_s)
        proc.wait()
        t1 = time.time()
        out.seek(0)
        tail = out.read()[-3000:]
    marks = read_timeline(timeline) if timeline.exists() else {}
    t_mark = marks.get(label, math.nan)
    before = [smp for smp in samples if smp[0] <= t_mark]
    usage: dict[str, Any] = {"span_s": t_mark - t0, "samples": len(before)}
    if not before:
        return t0, t1, proc.returncode, tail, usage
    seen: dict[int, tuple[float, str]] = {}
    for _, _, now in before:  # each process's last reading and command line
        for pid, (cpu, line) in now.items():
            seen[pid] = (cpu, line or (seen[pid][1] if pid in seen else ""))
    by_role: dict[str, float] = {}
    for pid, (cpu, line) in seen.items():
        role = "driver"
        if pid != proc.pid:
            role = next((r for key, r in CPU_ROLES if key in line), "other")
        by_role[role] = by_role.get(role, 0.0) + cpu
    busy1, hz = before[-1][1], os.sysconf("SC_CLK_TCK")
    jiffies = busy1[0] - busy0[0]
    usage.update(
        span_s=before[-1][0] - t0,
        by_role=dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
        total_cpu_s=sum(by_role.values()),
        machine_busy_core_s=(jiffies - (busy1[1] - busy0[1])) / hz,
        machine_core_s=jiffies / hz,
    )
    return t0, t1, proc.returncode, tail, usage


def read_timeline(path: Path) -> dict[str, float]:
    """``DPFL_TIMELINE``'s marks (label → time.time()); a repeated label keeps its
    first time, except round and evaluation marks (the last)."""
    marks: dict[str, float] = {}
    for line in path.read_text().splitlines():
        label, t = json.loads(line)
        if label not in marks or label.startswith(("round", "eval")):
            marks[label] = float(t)
    return marks


def run_w1_floor(args: argparse.Namespace, root: Path, tmp: Path, tag: str) -> dict[str, Any]:
    """One whole-process run of the tight floor; its phases (seconds)."""
    out = tmp / f"floor-{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--floor-process", str(out)]
    cmd += ["--data-root", str(root), "--seed", str(args.seed)]
    cmd += ["--memory-format", args.memory_format]
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    t0, t1, rc, tail = timed_process(cmd, dict(os.environ))
    if rc != 0:
        raise RuntimeError(f"floor process exited {rc}:\n{tail}")
    f = json.loads(out.read_text())
    loop = f["round_loop_s"] - f["eval_s"]
    whole = t1 - t0
    return {
        "whole_s": whole,
        "round_loop_s": loop,
        "eval_s": f["eval_s"],
        "fixed_s": whole - loop - f["eval_s"],
        "breakdown": {
            "interpreter + imports": f["imports_done"] - t0,
            "data": f["data_s"],
            "model + flat buffers": f["wall_s"] - f["round_loop_s"],
            "exit": t1 - f["end"],
        },
        "step_ms": f["step_ms"],
        "train_s": f["train_s"],
        "steps": f["steps"],
        "client_updates": f["client_updates"],
        "test_accuracy": f["test_accuracy"],
        "client_sizes": f["client_sizes"],
        "layout": f["layout"],
    }


def run_w1_dpfl(args: argparse.Namespace, root: Path, tmp: Path, tag: str) -> dict[str, Any]:
    """One whole ``dpfl run -q`` process; its phases from ``DPFL_TIMELINE``."""
    import pandas as pd

    w = dataclasses.replace(W1, seed=args.seed, rounds=args.rounds or W1.rounds)
    timeline = tmp / f"timeline-{tag}.jsonl"
    out = tmp / f"dpfl-{tag}"
    exe = Path(sys.executable).with_name("dpfl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "engine.cli"]
    cmd += ["run", "-q", "--out", str(out)]
    for o in w1_overrides(w, root, args.workers, args.memory_format):
        cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["DPFL_TIMELINE"] = str(timeline)
    # sampled until a client worker runs its first shard (its title names the method)
    t0, t1, rc, tail, cpu = cpu_until_mark(
        cmd, env, timeline, "rounds start", stop_title="train_shard"
    )
    if rc != 0:
        raise RuntimeError(f"dpfl run exited {rc}:\n{tail}")
    m = read_timeline(timeline)
    rows = pd.read_parquet(out / "rounds.parquet")
    first, last = m["rounds start"], m[f"round {w.rounds}"]
    ev = m["eval end"] - m["eval start"]
    loop = last - first - ev
    whole = t1 - t0

    def span(a: str, b: str) -> float:
        return m[b] - m[a] if a in m and b in m else math.nan

    # The driver's path to round 1 is a sequence; Ray starts in its own thread from
    # before the imports (engine.runtime.ray_start), so its span overlaps that path and
    # only what the driver waited for it after "prepared" is on the path.
    ray_ready = max(m["prepared"], m["ray.init done"]) if "ray.init done" in m else math.nan
    return {
        "whole_s": whole,
        "round_loop_s": loop,
        "eval_s": ev,
        "fixed_s": whole - loop - ev,
        "start_to_round1_s": m["round 1"] - t0,
        "last_round_to_exit_s": t1 - last,
        "breakdown": {
            "interpreter + imports": m.get("imports done", m["main"]) - t0,
            "config + checks": span("imports done", "privacy start"),
            "sigma calibration": span("privacy start", "privacy done"),
            "data": span("privacy done", "data done"),
            "model + pipeline": span("data done", "prepared"),
            "waiting for ray.init": ray_ready - m["prepared"],
            "workers + server start": m["workers ready"] - ray_ready
            if "workers ready" in m
            else math.nan,
            "until the first round": span("workers ready", "rounds start"),
            "first round": m["round 1"] - first,
            "final evaluation": ev,
            "last round's callbacks": span(f"round {w.rounds}", "closing"),
            "closing actors + ray.shutdown": span("closing", "executor closed"),
            "queued writes + config.json": span("executor closed", "results written"),
            "printing + exit": t1 - m.get("results written", last),
        },
        # not on the path above: Ray's start in its thread, overlapping the imports,
        # the calibration and the data
        "concurrent": {"ray.init (own thread)": span("ray.init start", "ray.init done")},
        "cpu_to_rounds": cpu,
        "marks": {k: v - t0 for k, v in sorted(m.items(), key=lambda kv: kv[1])},
        "client_updates": int(rows["realised_cohort_size_nonprivate"].sum()),
        "test_accuracy": float(rows["test_accuracy"].iloc[-1]),
        "epsilon": float(rows["epsilon"].iloc[-1]),
    }


def w1_main(args: argparse.Namespace) -> int:
    """``--workload w1``: the tight floor and ``dpfl run`` as whole processes,
    alternately ``--repeats`` times; prints the phases and the ratios (medians)."""
    import tempfile

    w = dataclasses.replace(W1, seed=args.seed, rounds=args.rounds or W1.rounds)
    print(f"== dpfl benchmark: W1, whole processes ({args.repeats} alternating pair(s)) ==")
    print(
        f"workload: cnn, MNIST-format files of generated images, {w.num_clients} clients of "
        f"34-35 examples (dataset.client_test_fraction=0), Poisson q={w.rate}, "
        f"{w.rounds} rounds, 1 epoch of batch {w.batch_size}, lr {w.lr}, C={w.clip_norm}, "
        f"z={w.noise_multiplier}, {w.test_size} test images at the end; dpfl run -q with "
        f"{args.workers} workers, model.memory_format={args.memory_format}; floor: "
        f"the tight plain loop, 1 thread; load average {load_average()}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="dpfl-w1-"))
    root = write_w1_files(w, tmp / "data")
    floors: list[dict[str, Any]] = []
    dpfls: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for side, fn, runs in (("floor", run_w1_floor, floors), ("dpfl", run_w1_dpfl, dpfls)):
            load0 = load_average()
            res = fn(args, root, tmp, f"{r}")
            res["load"] = f"{load0} -> {load_average()}"
            runs.append(res)
            print(
                f"[{r + 1}/{args.repeats}] {side:5s}: whole {res['whole_s']:.2f} s = fixed "
                f"{res['fixed_s']:.2f} + round loop {res['round_loop_s']:.2f} + final "
                f"evaluation {res['eval_s']:.2f}; {res['client_updates']} client updates, "
                f"test_accuracy={res['test_accuracy']:.4f} [load {res['load']}]",
                flush=True,
            )
            print("    " + ", ".join(f"{k} {v:.2f}" for k, v in res["breakdown"].items()))
            cpu = res.get("cpu_to_rounds")
            if cpu and "by_role" in cpu:
                print(
                    f"    CPU from spawn to the rounds' start ({cpu['span_s']:.2f} s): "
                    f"{cpu['total_cpu_s']:.2f} CPU-s in dpfl's processes ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in cpu["by_role"].items())
                    + f"); the machine's cores busy {cpu['machine_busy_core_s']:.2f} of "
                    f"{cpu['machine_core_s']:.2f} core-s"
                )
            if res.get("concurrent"):
                print(
                    "    overlapping the above: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in res["concurrent"].items())
                )
    med = {
        k: (median_of(floors, k), median_of(dpfls, k))
        for k in ("whole_s", "round_loop_s", "eval_s", "fixed_s")
    }
    print(f"\n== W1 against the tight floor (medians of {args.repeats}) ==")
    targets = {"whole_s": 0.65, "round_loop_s": 0.55, "eval_s": 0.55}
    names = {
        "whole_s": "whole process",
        "round_loop_s": "round loop",
        "eval_s": "final evaluation",
        "fixed_s": "fixed costs",
    }
    for k, (f, d) in med.items():
        tgt = targets.get(k)
        verdict = f" (target <= {tgt}: {'met' if d / f <= tgt else 'missed'})" if tgt else ""
        print(f"{names[k]:18s} floor {f:7.2f} s  dpfl {d:7.2f} s  ratio {d / f:.3f}{verdict}")
    fixed = median_of(dpfls, "fixed_s")
    print(
        f"dpfl fixed costs: start to round 1 {median_of(dpfls, 'start_to_round1_s'):.2f} s "
        f"(first round included), last round to exit "
        f"{median_of(dpfls, 'last_round_to_exit_s'):.2f} s (final evaluation included); "
        f"outside rounds and final evaluation {fixed:.2f} s (target <= 4 s: "
        f"{'met' if fixed <= 4.0 else 'missed'})"
    )
    print(
        f"floor time per local step {median_of(floors, 'step_ms'):.2f} ms "
        f"({floors[-1]['steps']} steps, layout {floors[-1]['layout']}); "
        f"load average at end {load_average()}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"floor": floors, "dpfl": dpfls}, indent=2))
        print(f"json: {args.json}")
    return 0


# --------------------------------------------------------------------------- report
def hardware() -> dict[str, Any]:
    """CPU model, core counts, GPU, library versions."""
    import ray

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable = os.cpu_count() or 1
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "load_average_at_start": load_average(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "gpu": gpu,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
    }


def start_local_ray(num_cpus: int = 2) -> float:
    """A fresh local Ray for a benchmark (no dashboard, workers' output off the
    console); returns its start-up seconds, which no benchmark figure includes."""
    import ray

    t = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    return time.perf_counter() - t


def load_average() -> str:
    """``/proc/loadavg``'s 1/5/15-minute load (other work on the machine skews timings)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    """Median of ``key`` over repeats."""
    return float(statistics.median(r[key] for r in runs))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats plus the last repeat's non-timing fields (no arrays)."""
    out = {k: v for k, v in runs[-1].items() if not k.startswith("_")}
    out["wall_s"] = median_of(runs, "wall_s")
    out["round_loop_s"] = median_of(runs, "round_loop_s")
    out["updates_per_s"] = out["client_updates"] / out["wall_s"]
    out["updates_per_s_round_loop"] = out["client_updates"] / out["round_loop_s"]
    out["repeats"] = [{k: r[k] for k in ("wall_s", "round_loop_s", "test_accuracy")} for r in runs]
    return out


def fmt(v: float | None, spec: str = ".2f") -> str:
    """Format a number or '-'."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_report(rep: dict[str, Any]) -> None:
    """The final table, ratios and target verdicts."""
    p, d = rep.get("plain"), rep.get("dpfl")
    print(f"\n== results (medians over {rep['repeats']} repeat(s)) ==")
    print(f"{'':28s} {'plain (1 thread)':>18s} {'dpfl (Ray)':>18s}")

    def line(label: str, key: str, spec: str = ".2f") -> None:
        a = fmt(p.get(key) if p else None, spec)
        b = fmt(d.get(key) if d else None, spec)
        print(f"{label:28s} {a:>18s} {b:>18s}")

    line("wall time (s)", "wall_s")
    line("round loop (s)", "round_loop_s")
    line("client updates", "client_updates", "d")
    line("client updates/s (wall)", "updates_per_s")
    line("client updates/s (loop)", "updates_per_s_round_loop")
    line("final test accuracy", "test_accuracy", ".4f")
    eps = "-"
    if d:
        eps = f"{d['epsilon']:.4f}"
    print(f"{'epsilon (dpfl accountant)':28s} {'not accounted':>18s} {eps:>18s}")
    if d:
        print(f"  (dpfl: {d['accountant']} accountant, delta={d['delta']:.3g}; from dpfl only)")
    if p and "minimal_step_ms" in p:
        print(
            f"plain loop (tight floor, {p['layout']}): {p['step_ms']:.2f} ms per local step "
            f"over {p['steps']} steps; on the {p['minimal_steps']} steps of its first rounds "
            f"{p['same_batches_step_ms']:.2f} ms against the minimal loop's "
            f"{p['minimal_step_ms']:.2f} ms (ratio "
            f"{p['same_batches_step_ms'] / p['minimal_step_ms']:.3f}; in CPU time "
            f"{p['same_batches_step_cpu_ms'] / p['minimal_step_cpu_ms']:.3f}, the basis "
            f"on a loaded machine); outside training "
            f"{p['outside_training_s']:.2f} s of {p['wall_s']:.2f} s (last repeat)"
        )
    print(f"ray startup (ray.init, in neither wall time): {rep['ray_startup_s']:.2f} s")
    print(
        f"load average (1/5/15 min): {rep['hardware']['load_average_at_start']} at start, "
        f"{rep['load_average_at_end']} at end"
    )
    print("peak memory, VmHWM (MiB), sampled at the end of each side:")
    if p:
        for name, v in p["peak_rss_mb"].items():
            print(f"  plain  {name:34s} {fmt(v, '.0f'):>8s}")
    if d:
        for name, v in d["peak_rss_mb"].items():
            pid = d["pids"].get(name, "")
            print(f"  dpfl   {name:34s} {fmt(v, '.0f'):>8s}   pid {pid}")
        print(
            f"  (actor pids from: {d['pid_source']}; dpfl workers trained on: "
            f"{d['worker_device']}; server in: {d['server_placement']}; "
            f"plain on: {p['device'] if p else '-'})"
        )
    if rep.get("ratio") is not None:
        r, rl = rep["ratio"], rep["round_loop_ratio"]
        print(f"ratio dpfl/plain: wall {r:.3f}, round loop {rl:.3f}")
    if rep.get("accuracy_diff") is not None:
        flag = "OK" if rep["accuracy_agree"] else "FLAG: DISAGREE"
        print(
            f"accuracy difference dpfl - plain: {rep['accuracy_diff']:+.4f} "
            f"(|diff| <= {ACCURACY_TOLERANCE}: {flag})"
        )
    if rep.get("final_weights_rel_diff") is not None:
        print(
            f"final models: ||w_dpfl - w_plain|| / ||w_plain|| = "
            f"{rep['final_weights_rel_diff']:.2e}; mean client update norm (non-private): "
            f"plain {p['mean_update_norm']:.4f}, dpfl {d['mean_update_norm']:.4f}"
        )
    if rep.get("same_client_updates") is False:
        print("WARNING: the two sides trained different numbers of client updates")
    for t in rep.get("targets", []):
        print(
            f"target {t['name']}: dpfl <= {t['target']} x plain (wall): "
            f"{t['status']} (ratio {t['ratio']:.3f})"
        )
    for e in rep.get("errors", []):
        print(f"ERROR: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workload",
        choices=[*sorted(WORKLOADS), "w1"],
        default="cnn",
        help="w1: the tight floor and dpfl run as whole processes (issue 30's W1 shape)",
    )
    p.add_argument("--rounds", type=int, default=None, help="override the workload's rounds")
    p.add_argument("--num-clients", type=int, default=None, help="override N")
    p.add_argument(
        "--mean-samples",
        type=int,
        default=None,
        help="override the mean training examples per client (issue 16's cnn target: 35)",
    )
    p.add_argument(
        "--test-size", type=int, default=None, help="override the global test set's size"
    )
    p.add_argument("--workers", type=int, default=2, help="dpfl client-worker actors")
    p.add_argument(
        "--clients-per-batch", type=int, default=None, help="ray.clients_per_worker_batch"
    )
    p.add_argument(
        "--memory-format",
        choices=["auto", "contiguous", "channels_last"],
        default="auto",
        help="dpfl's model.memory_format; the plain loop uses the same layout (auto: "
        "channels_last for convolutions on the CPU, the faster one there)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--minimal-rounds",
        type=int,
        default=2,
        help="replay the plain loop's minibatches of its first N rounds in the minimal "
        "loop and compare their time per local step",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes for CI (< 60 s)")
    p.add_argument("--json", type=Path, default=None, help="write every measured number here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--floor-process", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-root", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.workers < 1 or (a.rounds is not None and a.rounds < 1):
        p.error("--repeats, --workers and --rounds must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the exit status (0 ok, 1 a side failed or accuracies disagree)."""
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.floor_process is not None:
        return floor_process(args)
    if args.workload == "w1":
        return w1_main(args)
    import ray

    w = WORKLOADS[args.workload]
    use_cuda = w.gpu and torch.cuda.is_available()
    if w.gpu and not use_cuda:
        w = dataclasses.replace(w, **RESNET_CPU)
    if args.quick:
        w = quick_variant(w)
    changes: dict[str, Any] = {"seed": args.seed}
    if args.rounds is not None:
        changes["rounds"] = args.rounds
    if args.num_clients is not None:
        changes["num_clients"] = args.num_clients
    if args.mean_samples is not None:
        changes["mean_samples"] = args.mean_samples
    if args.test_size is not None:
        changes["test_size"] = args.test_size
    w = dataclasses.replace(w, **changes)
    device = torch.device("cuda" if use_cuda else "cpu")
    hw = hardware()
    probe = build_model(w.model, w.input_shape, w.num_classes, torch.Generator().manual_seed(0))
    has_conv = any(isinstance(m, nn.Conv2d) for m in probe.modules())
    fmt_used = args.memory_format
    if (
        fmt_used == "auto"
    ):  # the engine's rule (engine.federated.worker_model.resolve_memory_format)
        fmt_used = "channels_last" if has_conv and device.type == "cpu" else "contiguous"
    print(f"== dpfl benchmark: workload {w.name}{' (quick)' if args.quick else ''} ==")
    gpu = hw["gpu"] or "none"
    print(
        f"hardware: CPU {hw['cpu']} ({hw['cores']} cores, {hw['usable_cores']} usable), "
        f"GPU {gpu}; torch {hw['torch']}, ray {hw['ray']}, python {hw['python']}; "
        f"load average {hw['load_average_at_start']}"
    )
    print(
        f"workload: model={w.model} data={w.data} {w.input_shape} N={w.num_clients} "
        f"~{w.mean_samples}/client, Poisson q={w.rate} (expected cohort "
        f"{w.rate * w.num_clients:g}), rounds={w.rounds}, local epochs={w.epochs} "
        f"batch={w.batch_size} lr={w.lr}, C={w.clip_norm}, z={w.noise_multiplier}, "
        f"eval at the end; dpfl workers={args.workers} x 1 CPU, "
        f"clients_per_worker_batch={args.clients_per_batch}, "
        f"model.memory_format={args.memory_format} ({fmt_used} here); "
        f"plain: 1 thread on {device}, {fmt_used}"
    )
    t = time.perf_counter()
    ds = make_dataset(w)
    n_train = int(sum(len(c) for c in ds.client_train))
    print(
        f"data: {n_train} training examples over {ds.num_clients} clients, "
        f"{len(ds.y_test)} test examples ({time.perf_counter() - t:.1f} s to build)"
    )
    overrides = dpfl_overrides(
        w, args.workers, args.clients_per_batch, use_cuda, args.memory_format
    )
    errors: list[str] = []
    startup = start_local_ray(max(2, args.workers))
    print(f"ray startup: {startup:.2f} s")
    plain_runs: list[dict[str, Any]] = []
    dpfl_runs: list[dict[str, Any]] = []
    try:
        for r in range(args.repeats):
            tag = f"[{r + 1}/{args.repeats}]"
            try:
                pr = run_plain(w, ds, device, fmt_used, record_rounds=args.minimal_rounds)
                replay = pr.pop("_batches")
                k = min(args.minimal_rounds, w.rounds)
                pr["same_batches_step_ms"] = (
                    1e3 * sum(pr["round_train_s"][:k]) / max(1, sum(pr["round_steps"][:k]))
                )
                pr["same_batches_step_cpu_ms"] = (
                    1e3 * sum(pr["round_train_cpu_s"][:k]) / max(1, sum(pr["round_steps"][:k]))
                )
                mw, mc = minimal_loop(w, ds, replay, device, pr["layout"])
                pr["minimal_step_ms"], pr["minimal_step_cpu_ms"] = 1e3 * mw, 1e3 * mc
                pr["minimal_steps"] = len(replay)
                pr["minimal_load"] = load_average()
                plain_runs.append(pr)
                print(
                    f"{tag} plain: wall {pr['wall_s']:.2f} s, round loop {pr['round_loop_s']:.2f}"
                    f" s, {pr['client_updates']} client updates, {pr['steps']} local steps, "
                    f"test_accuracy={pr['test_accuracy']:.4f} [load {load_average()}]",
                    flush=True,
                )
                print(
                    f"{tag} plain: {pr['step_ms']:.2f} ms per local step over the run; on the "
                    f"{len(replay)} steps of round(s) 1..{k}: plain "
                    f"{pr['same_batches_step_ms']:.2f} ms, minimal loop "
                    f"{pr['minimal_step_ms']:.2f} ms (plain/minimal "
                    f"{pr['same_batches_step_ms'] / pr['minimal_step_ms']:.3f}; CPU time "
                    f"{pr['same_batches_step_cpu_ms']:.2f} / {pr['minimal_step_cpu_ms']:.2f} ms "
                    f"= {pr['same_batches_step_cpu_ms'] / pr['minimal_step_cpu_ms']:.3f}); outside "
                    f"training {pr['outside_training_s']:.2f} s of {pr['wall_s']:.2f} s "
                    f"(final evaluation {pr['eval_s']:.2f} s) [load {pr['minimal_load']}]",
                    flush=True,
                )
            except Exception:  # noqa: BLE001 - report and go on with the other side
                errors.append(f"plain loop failed:\n{traceback.format_exc()}")
            try:
                dr = run_dpfl(w, ds, overrides, run_name=f"bench{r}")
                dpfl_runs.append(dr)
                print(
                    f"{tag} dpfl:  wall {dr['wall_s']:.2f} s, round loop {dr['round_loop_s']:.2f}"
                    f" s, {dr['client_updates']} client updates, "
                    f"test_accuracy={dr['test_accuracy']:.4f}, epsilon={dr['epsilon']:.4f}",
                    flush=True,
                )
            except Exception:  # noqa: BLE001
                errors.append(f"dpfl run failed:\n{traceback.format_exc()}")
    finally:
        ray.shutdown()
    rep: dict[str, Any] = {
        "workload": dataclasses.asdict(w),
        "quick": args.quick,
        "repeats": args.repeats,
        "workers": args.workers,
        "clients_per_batch": args.clients_per_batch,
        "memory_format": args.memory_format,
        "hardware": hw,
        "ray_startup_s": startup,
        "dpfl_overrides": overrides,
        "plain": summarise(plain_runs) if len(plain_runs) == args.repeats else None,
        "dpfl": summarise(dpfl_runs) if len(dpfl_runs) == args.repeats else None,
        "accuracy_tolerance": ACCURACY_TOLERANCE,
        "errors": errors,
    }
    p, d = rep["plain"], rep["dpfl"]
    if p and d:
        rep["ratio"] = d["wall_s"] / p["wall_s"]
        rep["round_loop_ratio"] = d["round_loop_s"] / p["round_loop_s"]
        rep["accuracy_diff"] = d["test_accuracy"] - p["test_accuracy"]
        rep["accuracy_agree"] = bool(abs(rep["accuracy_diff"]) <= ACCURACY_TOLERANCE)
        rep["same_client_updates"] = p["client_updates"] == d["client_updates"]
        wp, wd = plain_runs[-1]["_weights"], dpfl_runs[-1]["_weights"]
        rep["final_weights_rel_diff"] = (
            float(np.linalg.norm(wd.astype(np.float64) - wp) / max(np.linalg.norm(wp), 1e-30))
            if wp.shape == wd.shape
            else math.inf
        )
        targets = []
        if w.name == "cnn":
            targets.append(("cnn on 2 CPU workers", TARGET_RATIO))
            targets.append(
                (
                    "cnn with dpfl's own speed-ups (parallel evaluation, balanced shards, "
                    f"memory format {args.memory_format}, clients_per_worker_batch="
                    f"{args.clients_per_batch})",
                    TARGET_RATIO_VECTORISED,
                )
            )
        rep["targets"] = [
            {
                "name": name,
                "target": tgt,
                "ratio": rep["ratio"],
                "status": "PASS" if rep["ratio"] <= tgt else "MISS",
            }
            for name, tgt in targets
        ]
    rep["load_average_at_end"] = load_average()
    status = 0
    if errors or not (p and d):
        status = 1
    elif not args.quick and not rep["accuracy_agree"]:
        status = 1
    rep["exit_status"] = status
    print_report(rep)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=2, default=str))
        print(f"json: {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
