"""Worker resources: how many client-workers share one GPU, chosen from measured memory.

Ray's fractional ``num_gpus`` is a scheduling label: it does not stop four workers
from each allocating more than a quarter of the GPU. With ``ray.gpu_packing=memory``
the engine measures, once at start-up, the peak GPU memory of one worker (CUDA
context, model, one local step on a group of clients) in a probe task that holds a
whole GPU, and packs ``k = floor(free · (1 − ray.gpu_memory_safety) / peak)``
workers per GPU, i.e. ``num_gpus_per_worker = 1/k``. CPU threads per worker follow
its CPU share (``torch.set_num_threads(max(1, floor(num_cpus_per_worker)))``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuMeasurement:
    """One worker's footprint on one GPU (bytes)."""

    device: str
    total_bytes: int
    free_bytes: int  # free before the probe created its CUDA context
    worker_peak_bytes: int  # CUDA context + allocator peak of one worker


def workers_per_gpu(m: GpuMeasurement, safety: float, max_workers: int = 64) -> int:
    """How many workers fit on the GPU with ``safety`` of its free memory kept spare."""
    if not 0 <= safety < 1:
        raise ValueError(f"ray.gpu_memory_safety={safety}: must be in [0, 1)")
    if m.worker_peak_bytes <= 0:
        raise ValueError(f"measured worker peak {m.worker_peak_bytes} bytes: must be > 0")
    usable = m.free_bytes * (1.0 - safety)
    k = int(math.floor(usable / m.worker_peak_bytes))
    if k < 1:
        raise ValueError(
            f"one worker needs {m.worker_peak_bytes / 2**30:.2f} GiB on {m.device} but only "
            f"{usable / 2**30:.2f} GiB are usable (free {m.free_bytes / 2**30:.2f} GiB, "
            f"ray.gpu_memory_safety={safety}); use a smaller model, "
            "local.batch_size or ray.clients_per_worker_batch"
        )
    return min(k, max_workers)


def measure_worker_gpu(
    model_name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    batch_size: int,
    group: int = 1,
) -> GpuMeasurement:
    """Peak GPU memory of one worker running one local SGD step on ``group`` clients'
    batches (run where a GPU is visible; a Ray task with ``num_gpus=1``)."""
    import torch
    from torch import nn

    from engine.models import build_model

    if not torch.cuda.is_available():
        raise RuntimeError("measure_worker_gpu needs a visible CUDA GPU")
    dev = torch.device("cuda", 0)
    free0, total = torch.cuda.mem_get_info(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = build_model(model_name, input_shape, num_classes).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if model_name == "char_lstm":
        x = torch.randint(0, num_classes, (batch_size * group, *input_shape), device=dev)
    else:
        x = torch.randn(batch_size * group, *input_shape, device=dev)
    y = torch.randint(0, num_classes, (batch_size * group,), device=dev)
    for _ in range(2):  # SAM-style recipes take two gradients per step
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    torch.cuda.synchronize(dev)
    free1, _ = torch.cuda.mem_get_info(dev)
    # Context + caching allocator as the driver sees it, plus copies of the flat
    # weights, the global vector and the float64 partial sum a worker keeps.
    d = sum(p.numel() for p in model.parameters())
    peak = (free0 - free1) + max(
        0, torch.cuda.max_memory_reserved(dev) - torch.cuda.memory_reserved(dev)
    )
    peak += d * (4 * 2 + 8)
    return GpuMeasurement(torch.cuda.get_device_name(dev), int(total), int(free0), int(peak))


def default_gpu_share(num_workers: int) -> float:
    """The GPU share each worker gets when the config asks for none
    (``ray.num_gpus_per_worker=0`` with ``ray.worker_device=auto``): the cluster's
    GPUs spread evenly over the ``ray.num_workers`` workers, at most one each; 0 when
    the cluster has no GPU or this (driver) process cannot use CUDA.

    Measured on one H100 (README, GPU table): for the MNIST-shaped ``cnn`` with
    vectorised groups, 1 worker per GPU ran 248 clients/s and 2, 4, 8 per GPU 233,
    219, 179; for ``resnet18_gn``, 1 and 2 per GPU ran 9.6 and 9.9. So the default
    packs the configured workers on the GPUs rather than leaving them idle. The
    driver check keeps a cluster that only *declares* GPUs (CI's fake GPU) on CPUs.
    """
    import ray

    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    if gpus < 1.0:
        return 0.0
    try:
        import torch

        if not torch.cuda.is_available():
            return 0.0
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0.0
    return min(1.0, math.floor(gpus) / max(1, int(num_workers)))


def plan_gpu_share(ray_cfg, model_name: str, dataset, batch_size: int) -> tuple[float, dict]:
    """``num_gpus_per_worker`` for ``ray.gpu_packing``: the configured share, or 1/k from
    a measurement on one of the cluster's GPUs. Returns (share, what was measured)."""
    import ray

    if ray_cfg.gpu_packing != "memory":
        share = float(ray_cfg.num_gpus_per_worker)
        if share == 0.0 and ray_cfg.worker_device == "auto":
            auto = default_gpu_share(ray_cfg.num_workers)
            if auto > 0.0:
                return auto, {"gpu_packing": f"default: {auto:g} GPU per worker"}
        return share, {}
    if ray.cluster_resources().get("GPU", 0) < 1:
        return 0.0, {"gpu_packing": "memory: no GPU in the cluster, workers use CPUs"}
    probe: Any = ray.remote(num_gpus=1, num_cpus=0)(measure_worker_gpu)
    group = ray_cfg.clients_per_worker_batch or 1
    m = ray.get(
        probe.remote(model_name, tuple(dataset.input_shape), dataset.num_classes, batch_size, group)
    )
    k = workers_per_gpu(m, ray_cfg.gpu_memory_safety)
    return 1.0 / k, {
        "gpu": m.device,
        "gpu_free_gib": m.free_bytes / 2**30,
        "worker_peak_gib": m.worker_peak_bytes / 2**30,
        "workers_per_gpu": k,
    }


#: A Ray that dpfl starts on this machine declares at most this many CPUs per core
#: and starts at most this many worker processes per core. Ray's CPU counts are
#: scheduling labels, so a little oversubscription lets e.g. two one-CPU workers and a
#: Tune trial's 0.5-CPU head share 2 cores; without a bound, ``ray.num_workers=1000``
#: on 2 cores declared 1000 CPUs and Ray started worker processes without end (89
#: ``ray::IDLE`` at peak, load average 79, no round in 120 s).
LOCAL_SLOTS_PER_CORE = 2


def local_gpus() -> int:
    """GPUs a local Ray would find (CUDA devices visible to this process)."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0


def check_local_fit(
    ray_cfg, extra_cpus: float = 0.0, cores: int | None = None, gpus: int | None = None
) -> None:
    """Refuse, with one line saying what fits, a configuration a Ray started on this
    machine cannot hold: ``ray.num_workers`` x ``ray.num_cpus_per_worker`` (plus
    ``extra_cpus``, a Tune trial's own CPU) above :data:`LOCAL_SLOTS_PER_CORE` per core,
    more worker processes than that, or ``ray.num_workers`` x ``ray.num_gpus_per_worker``
    above the visible GPUs (``ray.gpu_packing=memory`` decides the share later, from
    a measurement). ``cores``/``gpus``: this machine's, unless given (tests).

    Raises ConfigError. An attached cluster (``ray.address``) is not checked here: its
    nodes may be added by an autoscaler, and the workers' start waits for them up to
    ``engine.runtime.ray_pool.ACTOR_START_TIMEOUT_S``, then fails naming the resources."""
    from engine.config import ConfigError

    cores = int(cores if cores is not None else (os.cpu_count() or 1))
    slots = LOCAL_SLOTS_PER_CORE * cores
    n, per = int(ray_cfg.num_workers), float(ray_cfg.num_cpus_per_worker)
    need = n * per + extra_cpus
    fit = int(min(slots, math.floor(max(0.0, slots - extra_cpus) / per + 1e-9)))
    if need > slots + 1e-9 or n > slots:
        head = f" + {extra_cpus:g} for the trial" if extra_cpus else ""
        what = (
            f"at most {fit} workers of {per:g} CPU fit"
            if fit >= 1
            else f"not one worker of {per:g} CPU fits: lower ray.num_cpus_per_worker"
        )
        raise ConfigError(
            f"ray.num_workers={n} x ray.num_cpus_per_worker={per:g} needs {need:g} CPUs"
            f"{head}, but a local Ray on this machine's {cores} cores runs at most {slots} "
            f"({LOCAL_SLOTS_PER_CORE} per core): {what}; lower ray.num_workers, or attach "
            "to a larger cluster with ray.address"
        )
    share = float(ray_cfg.num_gpus_per_worker)
    if share > 0 and ray_cfg.gpu_packing != "memory":
        have = local_gpus() if gpus is None else int(gpus)
        if n * share > have + 1e-9:
            fits = int(math.floor(have / share + 1e-9))
            raise ConfigError(
                f"ray.num_workers={n} x ray.num_gpus_per_worker={share:g} needs "
                f"{n * share:g} GPUs, but this machine has {have}: "
                + (
                    f"at most {fits} workers of {share:g} GPU fit"
                    if fits
                    else "set ray.num_gpus_per_worker=0 (CPU workers)"
                )
            )


def check_processes(ray_cfg, cluster_cpus: float) -> None:
    """A Ray already running in this process (a notebook's, a test's, a Tune trial's):
    at most :data:`LOCAL_SLOTS_PER_CORE` worker processes per CPU it declares, whatever
    CPU share each asks for (1000 workers of 0.001 CPU are 1000 processes)."""
    from engine.config import ConfigError

    slots = LOCAL_SLOTS_PER_CORE * max(1, math.floor(cluster_cpus))
    if ray_cfg.num_workers > slots:
        raise ConfigError(
            f"ray.num_workers={ray_cfg.num_workers}: the running Ray has {cluster_cpus:g} "
            f"CPUs and dpfl starts at most {slots} worker processes on it "
            f"({LOCAL_SLOTS_PER_CORE} per CPU); lower ray.num_workers"
        )
