"""Federated datasets: sources (synthetic, torchvision layouts, LEAF JSON) + partitions.

:func:`build_dataset` turns a :class:`engine.config.DatasetConfig` into a
:class:`FederatedDataset`; :func:`check_dataset_files` validates that a source's
files exist (called before any work starts).
"""

from __future__ import annotations

import numpy as np

from engine.data.federated import FederatedDataset, split_client_test
from engine.data.partition import dirichlet_partition, iid_partition, natural_partition
from engine.data.sources import DatasetFilesMissing, PooledData

__all__ = [
    "DatasetFilesMissing",
    "FederatedDataset",
    "PooledData",
    "build_dataset",
    "check_dataset_files",
    "load_pooled",
]

TORCHVISION = ("mnist", "emnist", "cifar10", "cifar100", "svhn")
LEAF = ("femnist", "shakespeare")


def check_dataset_files(cfg) -> None:  # cfg: engine.config.DatasetConfig
    """Raise :class:`DatasetFilesMissing` naming the path and format if files are absent."""
    if cfg.name in TORCHVISION and not cfg.download:
        from engine.data.torchvision_sources import check_torchvision_files

        check_torchvision_files(cfg.name, cfg.root, cfg.emnist_split)
    elif cfg.name in LEAF:
        from engine.data.leaf import check_leaf_files

        check_leaf_files(cfg.name, cfg.root)


def load_pooled(cfg, rng: np.random.Generator) -> PooledData:
    """Read (or generate) the pooled arrays of ``cfg.name``."""
    if cfg.name == "synthetic":
        from engine.data.synthetic import generate_synthetic

        return generate_synthetic(
            cfg.num_clients,
            rng,
            alpha=cfg.synthetic_alpha,
            beta=cfg.synthetic_beta,
            dim=cfg.synthetic_dim,
            num_classes=cfg.synthetic_classes,
            mean_samples=cfg.synthetic_mean_samples,
        )
    if cfg.name in TORCHVISION:
        from engine.data.torchvision_sources import load_torchvision_source

        return load_torchvision_source(cfg.name, cfg.root, cfg.download, cfg.emnist_split)
    if cfg.name in LEAF:
        from engine.data.leaf import load_leaf_source

        return load_leaf_source(cfg.name, cfg.root)
    raise ValueError(f"dataset.name={cfg.name!r} is not a known source")


def build_dataset(cfg, rng: np.random.Generator) -> FederatedDataset:
    """Load ``cfg.name``, partition it into ``cfg.num_clients`` clients, split held-out.

    Sources without their own test set (synthetic) use the union of the clients'
    held-out splits as the global test set.
    """
    pooled = load_pooled(cfg, rng)
    n = len(pooled.y_train)
    if cfg.partition == "natural":
        if pooled.groups is None:
            raise ValueError(
                f"dataset.partition=natural: dataset.name={cfg.name} has no natural clients"
            )
        clients = natural_partition(pooled.groups, cfg.num_clients)
    elif cfg.partition == "iid":
        clients = iid_partition(n, cfg.num_clients, rng)
    else:
        clients = dirichlet_partition(pooled.y_train, cfg.num_clients, cfg.alpha, rng)
    train, test = split_client_test(clients, cfg.client_test_fraction, rng)
    x_test, y_test = pooled.x_test, pooled.y_test
    if len(y_test) == 0:
        held = np.concatenate(test) if test else np.zeros(0, np.int64)
        if len(held) == 0:
            raise ValueError(
                f"dataset.client_test_fraction={cfg.client_test_fraction}: "
                f"dataset.name={cfg.name} has no test set, so clients must hold some out"
            )
        x_test, y_test = pooled.x_train[held], pooled.y_train[held]
    return FederatedDataset(
        name=cfg.name,
        x_train=pooled.x_train,
        y_train=pooled.y_train,
        client_train=train,
        client_test=test,
        x_test=x_test,
        y_test=y_test,
        num_classes=pooled.num_classes,
        input_shape=tuple(pooled.input_shape),
        meta={"partition": cfg.partition},
    )
