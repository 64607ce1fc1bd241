"""Federated datasets: sources (synthetic, torchvision layouts, LEAF JSON) + partitions.

:func:`build_dataset` turns a :class:`engine.config.DatasetConfig` into a
:class:`FederatedDataset`; :func:`check_dataset_files` validates that a source's
files exist (called before any work starts).

Public evaluation set (README, "Privacy"): the global test set, on which
``test_accuracy``/``test_loss`` are measured, never holds data of a client of the
population, so those columns are public:

* torchvision sources: the official test split (separate images from the training split);
* digits: a fixed 20% of scikit-learn's bundled images, never given to a client
  (:mod:`engine.data.digits`);
* synthetic: ``dataset.public_eval_clients`` extra clients from the same generator,
  disjoint from the population (they never train);
* LEAF: the last ``dataset.public_eval_clients`` writers/roles (in order of first
  appearance in ``train/*.json``), with their train and test JSON data; they are
  excluded from the population. LEAF's ``test/*.json`` data of the population's own
  writers is not used (it is the clients' data, not public).

``FederatedDataset.meta["eval_source"]`` names which one a run used. A public
validation set (``dataset.validation_size``, :mod:`engine.data.validation`) is held out
of the clients' examples the same way, disjoint from the test set.
"""

from __future__ import annotations

import numpy as np

from engine.data.federated import FederatedDataset, split_client_test
from engine.data.partition import dirichlet_partition, iid_partition, natural_partition
from engine.data.shared import segment_of
from engine.data.sources import DatasetFilesMissing, PooledData

__all__ = [
    "DatasetFilesMissing",
    "FederatedDataset",
    "PooledData",
    "build_dataset",
    "check_dataset_files",
    "load_pooled",
]

TORCHVISION = ("mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "svhn")
LEAF = ("femnist", "shakespeare")


def check_dataset_files(cfg) -> None:  # cfg: engine.config.DatasetConfig
    """Raise :class:`DatasetFilesMissing` naming the path and format if files are absent."""
    if cfg.name in TORCHVISION and not cfg.download:
        from engine.data.torchvision_sources import check_torchvision_files

        check_torchvision_files(cfg.name, cfg.root, cfg.emnist_split)
    elif cfg.name == "digits":
        import importlib.util

        if importlib.util.find_spec("sklearn") is None:
            raise DatasetFilesMissing(
                "dataset.name=digits needs scikit-learn (pip install 'dpfl[dev]' or "
                "pip install scikit-learn)"
            )
    elif cfg.name in LEAF:
        from engine.data.leaf import check_leaf_files

        check_leaf_files(cfg.name, cfg.root)


def load_pooled(cfg, rng: np.random.Generator, public_clients: int = 0) -> PooledData:
    """Read (or generate) the pooled arrays of ``cfg.name``; synthetic data gets
    ``public_clients`` extra clients (the last groups) for the public test set."""
    if cfg.name == "synthetic":
        from engine.data.synthetic import generate_synthetic

        return generate_synthetic(
            cfg.num_clients,
            rng,
            model=cfg.synthetic_model,
            alpha=cfg.synthetic_alpha,
            beta=cfg.synthetic_beta,
            dim=cfg.synthetic_dim,
            num_classes=cfg.synthetic_classes,
            mean_samples=cfg.synthetic_mean_samples,
            public_clients=public_clients,
            shared=True,  # engine.data.shared: the Ray pool sends it by reference
        )
    normalize = getattr(cfg, "normalize", None)
    if cfg.name == "digits":
        from engine.data.digits import load_digits_source

        return load_digits_source(normalize)
    if cfg.name in TORCHVISION:
        from engine.data.torchvision_sources import load_torchvision_source

        return load_torchvision_source(
            cfg.name, cfg.root, cfg.download, cfg.emnist_split, normalize
        )
    if cfg.name in LEAF:
        from engine.data.leaf import load_leaf_source

        return load_leaf_source(cfg.name, cfg.root)
    raise ValueError(f"dataset.name={cfg.name!r} is not a known source")


def _nondecreasing(groups: np.ndarray) -> bool:
    """Whether each group's examples are contiguous and in increasing group order (the
    synthetic generator's layout): then the O(n log n) paths below are not needed."""
    return len(groups) > 1 and bool((groups[1:] >= groups[:-1]).all())


def _first_appearance(groups: np.ndarray) -> np.ndarray:
    if _nondecreasing(groups):  # the distinct values, in order: no sort of n values
        return groups[np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])]
    _, first = np.unique(groups, return_index=True)
    return groups[np.sort(first)]


def hold_out_public(
    pooled: PooledData, k: int, name: str
) -> tuple[PooledData, np.ndarray, np.ndarray]:
    """Remove the last ``k`` groups (in order of first appearance) from ``pooled``.

    Returns the population's :class:`PooledData` (without those groups; a view when
    they are the arrays' tail) and the public test arrays: every example of the
    held-out groups, from ``x_train`` and, where ``test_groups`` is known, ``x_test``.
    """
    assert pooled.groups is not None
    order = _first_appearance(pooled.groups)
    if len(order) <= k:
        raise ValueError(
            f"dataset.public_eval_clients={k}: dataset.name={name} has only {len(order)} "
            "clients/writers, and the public evaluation set must leave some for the population"
        )
    public = order[-k:]
    if k > 0 and _nondecreasing(pooled.groups):  # the public groups are the tail
        cut = int(np.searchsorted(pooled.groups, public[0]))
        x_tr, y_tr, g_tr = (a[:cut] for a in (pooled.x_train, pooled.y_train, pooled.groups))
        x_parts, y_parts = [pooled.x_train[cut:]], [pooled.y_train[cut:]]
    else:
        in_pub = np.isin(pooled.groups, public)
        pop = np.flatnonzero(~in_pub)
        if pop[-1] == len(pop) - 1:  # the held-out groups are the tail: views, no copy
            x_tr, y_tr, g_tr = (
                a[: len(pop)] for a in (pooled.x_train, pooled.y_train, pooled.groups)
            )
        else:
            x_tr, y_tr, g_tr = pooled.x_train[pop], pooled.y_train[pop], pooled.groups[pop]
        x_parts, y_parts = [pooled.x_train[in_pub]], [pooled.y_train[in_pub]]
    if pooled.test_groups is not None:
        t_pub = np.isin(pooled.test_groups, public)
        x_parts.append(pooled.x_test[t_pub])
        y_parts.append(pooled.y_test[t_pub])
    population = PooledData(
        x_train=x_tr,
        y_train=y_tr,
        x_test=pooled.x_test[:0],
        y_test=pooled.y_test[:0],
        num_classes=pooled.num_classes,
        input_shape=pooled.input_shape,
        groups=g_tr,
    )
    if len(x_parts) == 1:  # one part (the held-out tail or a fancy-indexed copy): no copy
        return population, x_parts[0], y_parts[0]
    return population, np.concatenate(x_parts), np.concatenate(y_parts)


def build_dataset(cfg, rng: np.random.Generator) -> FederatedDataset:
    """Load ``cfg.name``, partition it into ``cfg.num_clients`` clients, split held-out.

    The global test set is public (module docstring): torchvision's test split, or
    ``cfg.num_public_eval_clients`` clients (synthetic) / writers (LEAF) held out of
    the population. Each client's held-out split (``client_test_fraction``) is the
    client's own data, used only for the non-private personal metrics.
    """
    k_pub = cfg.num_public_eval_clients
    if not getattr(cfg, "materialize", True):
        return build_on_demand(cfg, rng)
    pooled = load_pooled(cfg, rng, public_clients=k_pub)
    if cfg.name == "synthetic" or cfg.name in LEAF:
        if cfg.partition == "natural" and pooled.groups is not None:
            have = len(_first_appearance(pooled.groups))
            if cfg.num_clients + k_pub > have:
                raise ValueError(
                    f"dataset.num_clients={cfg.num_clients} plus dataset.public_eval_clients="
                    f"{k_pub} exceed the {have} natural clients (writers/roles) in the data"
                )
        pooled, x_test, y_test = hold_out_public(pooled, k_pub, cfg.name)
        kind = "clients" if cfg.name == "synthetic" else "writers/roles"
        eval_source = f"public: {k_pub} held-out {kind}"
    elif cfg.name == "digits":  # engine.data.digits: a fixed split no client ever holds
        from engine.data.digits import DIGITS_TEST_FRACTION

        x_test, y_test = pooled.x_test, pooled.y_test
        eval_source = f"public: fixed held-out {DIGITS_TEST_FRACTION:.0%} of the digits"
    else:
        x_test, y_test = pooled.x_test, pooled.y_test
        eval_source = "public: official test split"
    if len(y_test) == 0:
        raise ValueError(f"dataset.name={cfg.name}: the public evaluation set is empty")
    x_val = y_val = None
    meta = {"partition": cfg.partition, "eval_source": eval_source}
    if getattr(cfg, "validation_size", 0):  # before the partition: no client holds them
        from engine.data.validation import hold_out_validation

        pooled, x_val, y_val = hold_out_validation(pooled, cfg.validation_size, rng)
        meta["validation_source"] = (
            f"public: {cfg.validation_size} training examples held out of every client"
        )
    n = len(pooled.y_train)
    # indices go where the examples are: shared memory for a generated population
    shared = segment_of(pooled.x_train) is not None
    if cfg.partition == "natural":
        if pooled.groups is None:
            raise ValueError(
                f"dataset.partition=natural: dataset.name={cfg.name} has no natural clients"
            )
        clients = natural_partition(pooled.groups, cfg.num_clients)
    elif cfg.partition == "iid":
        clients = iid_partition(n, cfg.num_clients, rng, shared=shared)
    else:
        clients = dirichlet_partition(pooled.y_train, cfg.num_clients, cfg.alpha, rng)
    train, test = split_client_test(clients, cfg.held_out_fraction, rng, shared=shared)
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
        meta=meta,
        x_val=x_val,
        y_val=y_val,
    )


def build_on_demand(cfg, rng: np.random.Generator) -> FederatedDataset:
    """``dataset.materialize=false``: a synthetic population whose clients are generated
    when read (:mod:`engine.data.on_demand`); the public clients are generated now.
    ``rng`` is used as :func:`generate_synthetic` uses it (one draw, the seed), so
    client k is client k of the materialised natural partition with the same seed."""
    from engine.data.on_demand import OnDemandArray, OnDemandClientIndex, OnDemandPopulation
    from engine.data.synthetic import SyntheticGenerator

    if cfg.name != "synthetic" or cfg.partition != "natural":
        raise ValueError("dataset.materialize=false needs synthetic data, partition natural")
    seed = int(rng.integers(0, 2**63 - 1))
    gen = SyntheticGenerator(
        seed,
        cfg.synthetic_alpha,
        cfg.synthetic_beta,
        cfg.synthetic_dim,
        cfg.synthetic_classes,
        cfg.synthetic_mean_samples,
        cfg.synthetic_model,
    )
    k_pub = cfg.num_public_eval_clients
    x_test, y_test, _ = gen.clients([(1, np.arange(k_pub))])
    population = OnDemandPopulation(gen, cfg.num_clients, cfg.held_out_fraction)
    return FederatedDataset(
        name=cfg.name,
        x_train=OnDemandArray(population, 0),  # type: ignore[arg-type]
        y_train=OnDemandArray(population, 1),  # type: ignore[arg-type]
        client_train=OnDemandClientIndex(population, held_out=False),
        client_test=OnDemandClientIndex(population, held_out=True),
        x_test=x_test,
        y_test=y_test,
        num_classes=cfg.synthetic_classes,
        input_shape=(cfg.synthetic_dim,),
        meta={
            "partition": "natural",
            "eval_source": f"public: {k_pub} held-out clients",
            "materialize": False,
        },
    )
