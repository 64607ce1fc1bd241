"""The config sections that stand on their own: dataset, model, sampling, evaluation,
privacy, local training, server and execution (``ray:``).

Each section is a frozen dataclass that validates itself in ``__post_init__`` and raises
:class:`~engine.base.errors.ConfigError` (a ``ValueError``) with one line naming the key and
the bad value. The recipe's own keys (``algo:``) are declared by the pieces that read
them (:mod:`engine.config.algo`); checks that need the whole tree live in
:class:`engine.config.schema.RunConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.base.errors import check as _check
from engine.data.leaf import LEAF_SOURCES
from engine.data.torchvision_sources import DEFAULT_NORMALIZE, TORCHVISION_SOURCES

#: ``dataset.name``: the sources engine.data reads (synthetic, digits, torchvision's, LEAF's).
DATASET_NAMES = ("synthetic", "digits", *TORCHVISION_SOURCES, *LEAF_SOURCES)
#: Sources whose clients exist in the data (``dataset.partition=natural``).
NATURAL_PARTITIONS = ("synthetic", *LEAF_SOURCES)
#: The image sources each ``dataset.normalize`` mode applies to (FEMNIST's LEAF files
#: hold pixels already in [0, 1], without published per-channel constants).
NORMALIZE_MODES: dict[str, tuple[str, ...]] = {
    "standardize": (*TORCHVISION_SOURCES, "digits"),
    "unit_interval": (*TORCHVISION_SOURCES, "digits", "femnist"),
}

#: Share of each client's data held out when a metric needs it (personalised recipes,
#: membership inference) and ``dataset.client_test_fraction`` is null; also what a
#: DatasetConfig built outside a RunConfig (tests, benchmarks) holds out.
HELD_OUT_FRACTION = 0.2


def default_normalize(name: str) -> str | None:
    """What ``dataset.normalize: null`` means for source ``name`` (each loader's own
    default): ``unit_interval`` for the 28x28 grey-scale torchvision sources and
    FEMNIST (LEAF's pixels are in [0, 1]), ``standardize`` for CIFAR and the digits;
    ``None`` for the synthetic source, which has no pixels to normalise."""
    if name in DEFAULT_NORMALIZE:
        return DEFAULT_NORMALIZE[name]
    if name == "digits":
        return "standardize"
    if name in NORMALIZE_MODES["unit_interval"]:  # femnist
        return "unit_interval"
    return None


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    name: str = "synthetic"
    root: str | None = None
    download: bool = False
    num_clients: int = 1000
    partition: str = "iid"
    alpha: float = 0.5
    # None: resolved by RunConfig from the algorithm (RunConfig.default_client_test_fraction:
    # 0, or HELD_OUT_FRACTION for a personal metric); config.json records the resolved value.
    client_test_fraction: float | None = None
    emnist_split: str = "byclass"
    synthetic_model: str = "shared"  # shared labelling rule | per_client (FedProx as published)
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    synthetic_dim: int = 60
    synthetic_classes: int = 10
    synthetic_mean_samples: int = 60
    public_eval_clients: int | None = None
    # > 0: that many training examples, drawn from the seed, held out of every client as a
    # public validation set (engine.data.validation_split); iid/dirichlet partitions only
    validation_size: int = 0
    # false: synthetic clients generated on demand from (seed, client), nothing stored per
    # client (engine.data.on_demand); needs dataset.partition=natural
    materialize: bool = True
    # Input preprocessing of image sources (standardize | unit_interval); None:
    # the source's own recipe (standardize for torchvision and digits, LEAF's [0, 1]).
    normalize: str | None = None

    def __post_init__(self) -> None:
        names = DATASET_NAMES
        _check(self.name in names, "dataset.name", self.name, f"must be one of {names}")
        _check(self.num_clients >= 1, "dataset.num_clients", self.num_clients, "must be >= 1")
        _check(
            self.partition in ("iid", "dirichlet", "natural"),
            "dataset.partition",
            self.partition,
            "must be iid, dirichlet or natural",
        )
        _check(self.alpha > 0, "dataset.alpha", self.alpha, "must be > 0")
        _check(
            self.client_test_fraction is None or 0 <= self.client_test_fraction < 1,
            "dataset.client_test_fraction",
            self.client_test_fraction,
            "must be in [0, 1)",
        )
        natural_ok = NATURAL_PARTITIONS
        _check(
            self.partition != "natural" or self.name in natural_ok,
            "dataset.partition",
            self.partition,
            f"natural clients exist only for {natural_ok}; "
            f"use iid or dirichlet for dataset.name={self.name}",
        )
        modes = NORMALIZE_MODES
        _check(
            self.normalize is None or self.normalize in modes,
            "dataset.normalize",
            self.normalize,
            "must be null (the source's recipe), standardize or unit_interval",
        )
        _check(
            self.normalize is None or self.name in modes[self.normalize],
            "dataset.normalize",
            self.normalize,
            f"applies to dataset.name in {modes.get(self.normalize or '', ())}, not {self.name}",
        )
        _check(
            self.synthetic_model in ("shared", "per_client"),
            "dataset.synthetic_model",
            self.synthetic_model,
            "must be shared or per_client",
        )
        for key in ("synthetic_alpha", "synthetic_beta"):
            value = getattr(self, key)
            _check(value >= 0, f"dataset.{key}", value, "must be >= 0 (a variance scale)")
        _check(
            self.synthetic_mean_samples >= 4,
            "dataset.synthetic_mean_samples",
            self.synthetic_mean_samples,
            "must be >= 4",
        )
        _check(
            self.materialize or (self.name == "synthetic" and self.partition == "natural"),
            "dataset.materialize",
            self.materialize,
            "false (clients built on demand) needs dataset.name=synthetic and "
            "dataset.partition=natural",
        )
        _check(self.validation_size >= 0, "dataset.validation_size", self.validation_size, ">= 0")
        _check(
            self.validation_size == 0 or self.partition in ("iid", "dirichlet"),
            "dataset.validation_size",
            self.validation_size,
            "needs dataset.partition iid or dirichlet (a natural client's examples are its "
            "writer's: holding some out would not make them public)",
        )
        _check(
            self.public_eval_clients is None or self.public_eval_clients >= 1,
            "dataset.public_eval_clients",
            self.public_eval_clients,
            "must be >= 1 (or null for the default, ceil(N/10))",
        )

    @property
    def held_out_fraction(self) -> float:
        """``client_test_fraction``, or :data:`HELD_OUT_FRACTION` while it is unresolved
        (only in a DatasetConfig built outside a RunConfig)."""
        f = self.client_test_fraction
        return HELD_OUT_FRACTION if f is None else f

    @property
    def num_public_eval_clients(self) -> int:
        """Held-out clients (synthetic) or writers/roles (LEAF) forming the public
        evaluation set: ``public_eval_clients``, or ceil(N/10) when it is null."""
        if self.public_eval_clients is not None:
            return self.public_eval_clients
        return -(-self.num_clients // 10)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """``memory_format``: the layout of conv weights and activations in client training.
    ``auto`` = ``channels_last`` for models with 2-d convolutions trained on the CPU
    (measured 3–25% faster per step there), else ``contiguous``. Same mathematics either
    way; the float rounding of the kernels differs, so runs that must match bit for bit
    use the same setting."""

    name: str = "mlp"
    memory_format: str = "auto"
    init: str = "default"  # default: PyTorch's layer init from the seed; zeros (logreg)

    def __post_init__(self) -> None:
        names = ("logreg", "mlp", "cnn", "resnet10_gn", "resnet18_gn", "char_lstm")
        _check(self.name in names, "model.name", self.name, f"must be one of {names}")
        _check(
            self.init in ("default", "zeros"), "model.init", self.init, "must be default or zeros"
        )
        _check(
            self.init != "zeros" or self.name == "logreg",
            "model.init",
            self.init,
            f"zeros is valid only for model.name=logreg (a convex model), not {self.name}",
        )
        formats = ("auto", "contiguous", "channels_last")
        _check(
            self.memory_format in formats,
            "model.memory_format",
            self.memory_format,
            f"must be one of {formats}",
        )


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Client sampling. ``poisson`` (default): each client joins with prob. ``rate``.
    ``fixed``: ``cohort_size`` clients uniformly without replacement."""

    mode: str = "poisson"
    rate: float = 0.1
    cohort_size: int | None = None
    max_cohort: int | None = None

    def __post_init__(self) -> None:
        _check(
            self.mode in ("poisson", "fixed"),
            "sampling.mode",
            self.mode,
            "must be poisson or fixed",
        )
        _check(0 < self.rate <= 1, "sampling.rate", self.rate, "must be in (0, 1]")
        if self.mode == "fixed":
            _check(
                self.cohort_size is not None and self.cohort_size >= 1,
                "sampling.cohort_size",
                self.cohort_size,
                "must be a positive integer when sampling.mode=fixed",
            )
        if self.max_cohort is not None:
            _check(
                self.mode == "poisson",
                "sampling.max_cohort",
                self.max_cohort,
                "applies only to sampling.mode=poisson",
            )
            _check(self.max_cohort >= 1, "sampling.max_cohort", self.max_cohort, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every: int = 5
    membership_inference: bool = False
    # Empirical privacy audit (engine.privacy.audit): K canary clients (0 = off), and whether
    # the statistic is the max over every round's update instead of the final model.
    audit_canaries: int = 0
    audit_every_round: bool = False

    def __post_init__(self) -> None:
        _check(self.every >= 1, "eval.every", self.every, "must be >= 1")
        _check(self.audit_canaries >= 0, "eval.audit_canaries", self.audit_canaries, "must be >= 0")


DEFAULT_EPSILON = 4.0


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """Client-level DP. Give at most one of ``epsilon`` and ``noise_multiplier``; with
    neither, ``epsilon`` defaults to ``DEFAULT_EPSILON``. ``delta`` defaults to
    ``min(N^-1.1, 0.01/N)`` (``engine.privacy.accounting.default_delta``).
    ``secure_noise``: release mode (see :mod:`engine.privacy.rng`)."""

    epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    clip_norm: float = 1.0
    accountant: str | None = None
    secure_noise: bool = False  # release mode: cohorts and noise from the OS CSPRNG
    # Adaptive (quantile) clipping (engine.privacy.adaptive_clip); clip_norm is C_0.
    clip_mode: str = "fixed"
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_count_stddev: float | None = None  # None: expected cohort size / 20

    def __post_init__(self) -> None:
        _check(
            self.clip_mode in ("fixed", "adaptive"),
            "privacy.clip_mode",
            self.clip_mode,
            "must be fixed or adaptive",
        )
        _check(
            0 < self.target_quantile < 1,
            "privacy.target_quantile",
            self.target_quantile,
            "must be in (0, 1)",
        )
        _check(
            self.clip_lr > 0 and math.isfinite(self.clip_lr),
            "privacy.clip_lr",
            self.clip_lr,
            "must be finite and > 0",
        )
        _check(
            self.clip_count_stddev is None or self.clip_count_stddev >= 0,
            "privacy.clip_count_stddev",
            self.clip_count_stddev,
            "must be >= 0",
        )
        if self.epsilon is None and self.noise_multiplier is None:
            object.__setattr__(self, "epsilon", DEFAULT_EPSILON)
        if self.epsilon is not None:
            _check(
                math.isfinite(self.epsilon) or self.epsilon < 0,
                "privacy.epsilon",
                self.epsilon,
                "a private recipe needs a finite budget; for a run without privacy choose "
                "a non-private recipe without the key, e.g. algorithm=fedavg (dpfl algorithms)",
            )
            _check(self.epsilon > 0, "privacy.epsilon", self.epsilon, "must be > 0")
        if self.delta is not None:
            _check(0 < self.delta < 1, "privacy.delta", self.delta, "must be in (0, 1)")
        if self.noise_multiplier is not None:
            _check(
                self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier),
                "privacy.noise_multiplier",
                self.noise_multiplier,
                "must be finite and >= 0",
            )
        _check(self.clip_norm > 0, "privacy.clip_norm", self.clip_norm, "must be > 0")
        _check(
            self.accountant in (None, "rdp", "pld"),
            "privacy.accountant",
            self.accountant,
            "must be rdp or pld",
        )


@dataclass(frozen=True, kw_only=True)
class LocalConfig:
    epochs: int = 2
    steps: int | None = None
    batch_size: int = 16
    lr: float = 0.3
    lr_decay: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "local.epochs", self.epochs, "must be >= 1")
        _check(
            self.steps is None or self.steps >= 1,
            "local.steps",
            self.steps,
            "must be >= 1 (or null: local.epochs passes over the data)",
        )
        _check(self.batch_size >= 1, "local.batch_size", self.batch_size, "must be >= 1")
        _check(self.lr > 0, "local.lr", self.lr, "must be > 0")
        _check(0 < self.lr_decay <= 1, "local.lr_decay", self.lr_decay, "must be in (0, 1]")
        _check(0 <= self.momentum < 1, "local.momentum", self.momentum, "must be in [0, 1)")
        _check(self.weight_decay >= 0, "local.weight_decay", self.weight_decay, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    lr: float = 1.0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "server.lr", self.lr, "must be > 0")


#: Where a run's client workers and server run (``ray.executor``).
EXECUTORS = ("ray", "processes", "local")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Execution. ``executor=ray`` runs client workers as Ray actors and the server as
    an actor or in the driver (``server``); ``executor=processes`` runs them in
    processes forked on this machine with the server here, and no Ray;
    ``executor=local`` runs the identical computation in-process (same results)."""

    executor: str = "ray"
    address: str | None = None
    num_workers: int = 2
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    object_store_memory_mb: int | None = None
    clients_per_worker_batch: int | None = None  # None: chosen from memory; 1: one by one
    max_worker_restarts: int = 3
    gpu_memory_safety: float = 0.2
    gpu_packing: str = "fixed"  # fixed: num_gpus_per_worker; memory: measured workers/GPU
    worker_device: str = "auto"  # auto: the GPU Ray assigned, else CPU; cpu; cuda
    server: str = "auto"  # auto: driver on a one-node cluster, else actor; actor; driver
    # evaluate round t in each worker's second thread while round t+1 trains
    overlap_evaluation: bool = True

    def __post_init__(self) -> None:
        _check(
            self.executor in EXECUTORS,
            "ray.executor",
            self.executor,
            "must be " + ", ".join(EXECUTORS),
        )
        _check(self.num_workers >= 1, "ray.num_workers", self.num_workers, "must be >= 1")
        _check(
            self.num_cpus_per_worker > 0,
            "ray.num_cpus_per_worker",
            self.num_cpus_per_worker,
            "must be > 0",
        )
        _check(
            self.num_gpus_per_worker >= 0,
            "ray.num_gpus_per_worker",
            self.num_gpus_per_worker,
            "must be >= 0",
        )
        _check(
            self.clients_per_worker_batch is None or self.clients_per_worker_batch >= 1,
            "ray.clients_per_worker_batch",
            self.clients_per_worker_batch,
            "must be >= 1 (or null: chosen from memory)",
        )
        _check(
            self.max_worker_restarts >= 0,
            "ray.max_worker_restarts",
            self.max_worker_restarts,
            "must be >= 0",
        )
        _check(
            self.gpu_packing in ("fixed", "memory"),
            "ray.gpu_packing",
            self.gpu_packing,
            "must be fixed or memory",
        )
        _check(
            self.server in ("auto", "actor", "driver"),
            "ray.server",
            self.server,
            "must be auto, actor or driver",
        )
        _check(
            self.worker_device in ("auto", "cpu", "cuda"),
            "ray.worker_device",
            self.worker_device,
            "must be auto, cpu or cuda",
        )
        _check(
            0 <= self.gpu_memory_safety < 1,
            "ray.gpu_memory_safety",
            self.gpu_memory_safety,
            "must be in [0, 1)",
        )
