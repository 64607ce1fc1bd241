"""A worker process's model: its device, memory layout and flat parameter vectors.

Shared by the client workers (:mod:`engine.federated.client`,
:mod:`engine.federated.local_training`) and
the server (:mod:`engine.federated.server`): every process builds the run's initial model the
same way (from the (seed, MODEL_INIT) stream, on the CPU, then moved), and moves
parameters in and out as one flat float32 vector. Nothing here touches data or
privacy: where a model lives changes only float rounding (see
:func:`resolve_worker_device`).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import nn

from engine.data.federated import FederatedDataset
from engine.models import build_model
from engine.privacy import rng as rngs


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
    if 8 * sum(p.numel() for p in model.parameters()) > GLIBC_MMAP_THRESHOLD_MAX:
        keep_large_allocations()  # its float64 vectors would be mapped afresh every time
    device = torch.device(device)
    model = model.to(device)
    if resolve_memory_format(memory_format, model, device) == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    return model


#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LARGE_ALLOCATIONS_KEPT = False
#: glibc's largest automatic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


def keep_large_allocations(limit: int = 1 << 30) -> bool:
    """Serve allocations up to ``limit`` bytes from the heap and keep freed memory
    there, in this process (glibc only; once per process; True if set).

    glibc maps every block above its mmap threshold (at most 32 MiB) freshly from the
    kernel and unmaps it when freed, so each O(d) temporary of a large model (44 MiB of
    float32, 88 MiB of float64 for 11M parameters: an update, its clipped copy, the
    float64 partial sum, the weights) page-faults its memory in again, every client
    and round: on this project's CPU machine that was more than half of a worker's
    per-client work outside training (``benchmarks/round_phases.py --kernels``). With
    the threshold raised, freed blocks are reused. Values are untouched (torch's
    64-byte alignment is the same either way). The cost is memory: a process keeps its
    heap instead of returning it to the kernel, and freed blocks fragment it; a loop of
    a worker's per-client steps for 11M parameters peaked at 1.5-1.8 GiB instead of
    1.2 GiB (bounded: the same after 3 and 10 rounds). Hence :func:`init_process_model`
    calls it only for models whose float64 vectors exceed glibc's largest automatic
    threshold (32 MiB, about 4.2M parameters); below that glibc already reuses them."""
    global _LARGE_ALLOCATIONS_KEPT
    if _LARGE_ALLOCATIONS_KEPT:
        return True
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): leave malloc alone
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(limit))) and bool(
        mallopt(_M_TRIM_THRESHOLD, int(2 * limit))
    )
    _LARGE_ALLOCATIONS_KEPT = ok
    return ok


def configure_cuda_numerics() -> None:
    """IEEE float32 and deterministic kernels for a worker that trains on a GPU.

    * Same seed, same GPU and software: same run. cuDNN's autotuner may pick
      different kernels per process and some kernels accumulate atomically, so the
      autotuner is off and cuDNN is deterministic.
    * TF32 is off for convolutions and matrix products (PyTorch enables it for cuDNN
      convolutions by default): TF32 keeps 10 mantissa bits, so a GPU run would differ
      from the CPU run of the same seed by ~1e-3 relative per step instead of float32
      rounding, and the vectorised probe (``engine.federated.vectorized``), which checks a
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
