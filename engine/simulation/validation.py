"""The checks of a run that need more than its config, and no training.

:func:`engine.simulation.preparation.prepare` runs them, and ``dpfl run`` runs
``prepare`` before Ray starts and before it writes its first file, so that a run that
cannot work is refused in one line (:class:`~engine.config.ConfigError`, exit status 2)
with nothing started and nothing written:

* the data: the source's files exist and each begins as its format does (IDX, CIFAR's
  pickles, SVHN's MATLAB files, LEAF's JSON), and reading them succeeds (an error while
  reading a file source names the source, its root and the error);
* the device: ``ray.worker_device=cuda`` needs a CUDA device this machine's torch can
  use (a cluster's workers are not visible from here and are not checked);
* Ray's start (:func:`engine.runtime.ray_start.check_ray_start`): its resource minima,
  and a bounded connect to ``ray.address``;
* the model on the data: one forward and backward pass on two examples of the public
  evaluation set (nothing is trained, released or drawn from a run's random streams);
* a personal head (DP²-FedSAM) that leaves the model a shared body to train and
  privatise.

Each check reads public facts only (the config, file headers, the public evaluation
set, the model's structure): none touches a client's data beyond reading the files.
"""

from __future__ import annotations

import gzip
import os
from typing import Any

import numpy as np

from engine.config import ConfigError, RunConfig
from engine.data import FederatedDataset, build_dataset, check_dataset_files

#: The sources dpfl reads from files (their read errors are the user's to fix).
FILE_SOURCES = ("mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "svhn")
LEAF_SOURCES = ("femnist", "shakespeare")


def check_environment(config: RunConfig) -> None:
    """The device and, with the Ray executor, Ray's start settings."""
    check_device(config)
    if config.ray.executor == "ray":
        from engine.runtime.ray_start import check_ray_start

        check_ray_start(config.ray)


def check_device(config: RunConfig) -> None:
    """``ray.worker_device=cuda`` on a machine whose torch has no usable CUDA device
    (in process, or under a Ray that dpfl starts on this machine)."""
    attached = config.ray.executor == "ray" and (
        config.ray.address or os.environ.get("RAY_ADDRESS")
    )
    if config.ray.worker_device != "cuda" or attached:
        return
    from engine.federated.worker_model import resolve_worker_device

    try:
        resolve_worker_device("cuda", gpu_ids=[])
    except RuntimeError as e:
        raise ConfigError(str(e)) from None


def check_data_files(cfg: Any) -> None:
    """The source's files exist (:func:`engine.data.check_dataset_files`) and each
    begins as its format does; ConfigError naming the file otherwise."""
    try:
        check_dataset_files(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.download:
        return
    if cfg.name in FILE_SOURCES:
        from engine.data.torchvision_sources import source_files

        for path in source_files(cfg.name, cfg.root, cfg.emnist_split):
            _check_header(cfg.name, path)
    elif cfg.name in LEAF_SOURCES:
        import glob

        root = os.path.expanduser(str(cfg.root))
        for split in ("train", "test"):
            for path in sorted(glob.glob(os.path.join(root, split, "*.json"))):
                _check_header(cfg.name, path)


def _first_bytes(path: str, n: int = 32) -> bytes:
    with open(path, "rb") as f:
        head = f.read(n)
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                return f.read(n)
        except (OSError, EOFError) as e:
            raise ConfigError(f"{path}: not a readable gzip file ({e})") from None
    return head


def _check_header(name: str, path: str) -> None:
    """``path`` begins as a file of ``name``'s format does (a few bytes are read)."""
    head = _first_bytes(path)
    if name in ("mnist", "fashion_mnist", "emnist"):
        ok = len(head) >= 4 and head[:2] == b"\0\0" and head[2] == 0x08 and 1 <= head[3] <= 3
        fmt = "an unsigned-byte IDX file (magic 0x0000080n)"
    elif name in ("cifar10", "cifar100"):
        ok = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
        fmt = "a CIFAR python pickle (protocol 2 or later)"
    elif name == "svhn":
        ok = head.startswith(b"MATLAB 5.0 MAT-file")
        fmt = "a MATLAB 5.0 .mat file"
    else:  # LEAF
        ok = head.lstrip()[:1] == b"{"
        fmt = "a LEAF JSON object"
    if not ok:
        raise ConfigError(
            f"dataset.name={name}: {path} is not {fmt} (it begins {head[:8]!r}); "
            "check dataset.root and the files in it"
        )


def load_data(config: RunConfig) -> FederatedDataset:
    """The run's dataset (:func:`engine.data.build_dataset` from the seed's DATA
    stream). A file source that cannot be read is a ConfigError naming it; the
    generated sources (synthetic, digits) raise as they are."""
    from engine.privacy import rng as rngs

    cfg = config.dataset
    try:
        return build_dataset(cfg, rngs.numpy_rng(config.seed, rngs.DATA))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a damaged file raises many types
        if cfg.name not in (*FILE_SOURCES, *LEAF_SOURCES):
            raise
        text = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"dataset.name={cfg.name}: cannot read its files under dataset.root={cfg.root!r} "
            f"({type(e).__name__}: {text}); check or replace them"
        ) from None


def _examples(dataset: FederatedDataset) -> tuple[np.ndarray, np.ndarray]:
    """Two examples of the public evaluation set (a client's, when it is empty)."""
    if len(dataset.x_test):
        return np.asarray(dataset.x_test[:2]), np.asarray(dataset.y_test[:2])
    idx = np.sort(np.asarray(dataset.client_train[0])[:2])
    return np.asarray(dataset.x_train[idx]), np.asarray(dataset.y_train[idx])


def check_model_fits(config: RunConfig, dataset: FederatedDataset, model: Any) -> None:
    """One forward and backward pass of ``model`` (a freshly built, throw-away copy) on
    two examples as the run will feed them: the model must accept the data's shape and
    type, give one score per class and a gradient. ConfigError naming both keys."""
    import torch

    x, y = _examples(dataset)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        model.eval()  # no dropout: no random draw, nothing changes
        scores = model(torch.from_numpy(np.ascontiguousarray(x)))
        want = (len(x), dataset.num_classes)
        if tuple(scores.shape) != want:
            raise ValueError(f"it gives scores of shape {tuple(scores.shape)}, not {want}")
        loss = torch.nn.functional.cross_entropy(scores, torch.from_numpy(y))
        torch.autograd.grad(loss, params)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"model.name={config.model.name!r} does not fit dataset.name="
            f"{config.dataset.name!r}: its examples are {x.dtype} of shape "
            f"{tuple(x.shape[1:])} and the model fails on them ({text})"
        ) from None


def check_shared_body(config: RunConfig, pipeline: Any, model: Any) -> None:
    """A personalised recipe keeps the last ``algo.personal_layers`` Linear layers on
    each client and trains, clips and privatises the rest: the rest must not be empty
    (a one-layer model, e.g. ``logreg``, is all head)."""
    if pipeline.personal is None:
        return
    from engine.federated.worker_model import personal_mask

    layers = pipeline.personal.layers
    try:
        mask = personal_mask(model, layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if bool(mask.all()):
        raise ConfigError(
            f"algorithm={config.algorithm} with model.name={config.model.name}: its personal "
            f"head (algo.personal_layers={layers}: the last {layers} Linear layer(s)) is the "
            "whole model, which leaves no shared body to train and privatise; choose a "
            "model with more layers (e.g. model.name=mlp or cnn)"
        )
