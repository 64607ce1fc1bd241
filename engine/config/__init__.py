"""Typed run configuration: frozen dataclasses, YAML files and ``--set`` overrides.

The tree (``RunConfig`` at the root) mirrors the config keys documented in the README.
Every section validates itself in ``__post_init__`` and raises :class:`ConfigError`
(a ``ValueError``) with one line naming the key and the bad value. Cross-section
checks that need the whole tree (cohort vs. clients, exactly one of ε / σ) live in
:meth:`RunConfig.__post_init__`. Checks that need the data (files present) or the
accountant (ε reachable) run in :func:`engine.simulation.prepare` before any work starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from algorithms.catalog import CATALOG
from algorithms.compose import RecipeConfig
from engine.errors import ConfigError
from engine.errors import check as _check

#: Share of each client's data held out when a metric needs it (personalised recipes,
#: membership inference) and ``dataset.client_test_fraction`` is null; also what a
#: DatasetConfig built outside a RunConfig (tests, benchmarks) holds out.
HELD_OUT_FRACTION = 0.2


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
    # false: synthetic clients generated on demand from (seed, client), nothing stored per
    # client (engine.data.on_demand); needs dataset.partition=natural
    materialize: bool = True
    # Input preprocessing of image sources (standardize | unit_interval); None:
    # the source's own recipe (standardize for torchvision and digits, LEAF's [0, 1]).
    normalize: str | None = None

    def __post_init__(self) -> None:
        names = (
            "synthetic",
            "digits",
            "mnist",
            "fashion_mnist",
            "emnist",
            "cifar10",
            "cifar100",
            "svhn",
            "femnist",
            "shakespeare",
        )
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
        natural_ok = ("synthetic", "femnist", "shakespeare")
        _check(
            self.partition != "natural" or self.name in natural_ok,
            "dataset.partition",
            self.partition,
            f"natural clients exist only for {natural_ok}; "
            f"use iid or dirichlet for dataset.name={self.name}",
        )
        modes = {
            "standardize": (
                "mnist",
                "fashion_mnist",
                "emnist",
                "cifar10",
                "cifar100",
                "svhn",
                "digits",
            ),
            "unit_interval": (
                "mnist",
                "fashion_mnist",
                "emnist",
                "cifar10",
                "cifar100",
                "svhn",
                "digits",
                "femnist",
            ),
        }
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
class AlgoConfig:
    """Recipe hyperparameters; ``None`` means the recipe's (paper's) default."""

    rho: float | None = None
    asam: bool | None = None
    beta: float | None = None
    sigma_ls: float | None = None
    ls_scope: str = "tensor"
    ls_local: str = "project"  # DP-Fed-LS local bounding: project (paper) or clip_once
    keep_fraction: float | None = None  # top-k, rand-k, server top-k: kept fraction p
    zero_fraction: float | None = None  # LUS: zeroed fraction c
    topk_site: str = "server"
    randk_rescale: bool = False
    blur_lambda: float | None = None
    server_momentum: float | None = None  # DP-FTRL: momentum γ on noisy prefix sums
    bands: int | None = None  # DP-BandMF: bands b of the strategy (b-min-separation)
    head_steps: int | None = None
    body_steps: int | None = None
    personal_layers: int = 1
    noise_site: str = "server"
    client_state: str = "memory"

    def __post_init__(self) -> None:
        for key in ("rho", "sigma_ls", "blur_lambda"):
            v = getattr(self, key)
            _check(v is None or v >= 0, f"algo.{key}", v, "must be >= 0")
        _check(
            self.beta is None or 0 <= self.beta <= 1, "algo.beta", self.beta, "must be in [0, 1]"
        )
        _check(
            self.keep_fraction is None or 0 < self.keep_fraction <= 1,
            "algo.keep_fraction",
            self.keep_fraction,
            "(kept fraction) must be in (0, 1]",
        )
        _check(
            self.zero_fraction is None or 0 <= self.zero_fraction < 1,
            "algo.zero_fraction",
            self.zero_fraction,
            "(zeroed fraction) must be in [0, 1)",
        )
        _check(
            self.ls_scope in ("tensor", "model", "weights"),
            "algo.ls_scope",
            self.ls_scope,
            "must be tensor, model or weights",
        )
        _check(
            self.ls_local in ("project", "clip_once"),
            "algo.ls_local",
            self.ls_local,
            "must be project (per-step ball projection) or clip_once",
        )
        _check(
            self.topk_site in ("server", "client"),
            "algo.topk_site",
            self.topk_site,
            "must be server (top-k of the noisy aggregate) or client (before clipping)",
        )
        for key in ("head_steps", "body_steps"):
            v = getattr(self, key)
            _check(v is None or v >= 1, f"algo.{key}", v, "must be >= 1")
        m = self.server_momentum
        _check(m is None or 0 <= m < 1, "algo.server_momentum", m, "must be in [0, 1)")
        _check(self.bands is None or self.bands >= 1, "algo.bands", self.bands, "must be >= 1")
        _check(
            self.personal_layers >= 1, "algo.personal_layers", self.personal_layers, "must be >= 1"
        )
        _check(
            self.noise_site in ("server", "client"),
            "algo.noise_site",
            self.noise_site,
            "must be server or client",
        )
        _check(
            self.client_state in ("memory", "disk"),
            "algo.client_state",
            self.client_state,
            "must be memory or disk",
        )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    lr: float = 1.0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "server.lr", self.lr, "must be > 0")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Execution. ``executor=ray`` runs client workers as Ray actors and the server as
    an actor or in the driver (``server``); ``executor=local`` runs the identical
    computation in-process (same results)."""

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

    def __post_init__(self) -> None:
        _check(
            self.executor in ("ray", "local"), "ray.executor", self.executor, "must be ray or local"
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


#: The built-in recipes, from the registry's torch-free catalog (algorithms.catalog).
ALGORITHMS = tuple(CATALOG)
NON_PRIVATE = tuple(name for name, entry in CATALOG.items() if not entry.private)
#: ``algorithm: custom`` runs the pieces named in the ``recipe:`` section (algorithms.compose).
CUSTOM = "custom"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    algorithm: str = "dp_fedavg"
    seed: int = 0
    rounds: int = 60
    out: str | None = None
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)

    def __post_init__(self) -> None:
        _check(
            self.algorithm in (*ALGORITHMS, CUSTOM),
            "algorithm",
            self.algorithm,
            f"must be one of {ALGORITHMS} or {CUSTOM!r} (with a recipe: section)",
        )
        if self.dataset.client_test_fraction is None:  # resolved here, so config.json has it
            resolved = dataclasses.replace(
                self.dataset, client_test_fraction=self.default_client_test_fraction()
            )
            object.__setattr__(self, "dataset", resolved)
        if self.algorithm != CUSTOM and self.recipe != RecipeConfig():
            changed = [
                f.name
                for f in dataclasses.fields(RecipeConfig)
                if getattr(self.recipe, f.name) != f.default
            ]
            _check(
                False,
                f"recipe.{changed[0]}",
                getattr(self.recipe, changed[0]),
                f"a recipe: section is read only with algorithm={CUSTOM} "
                f"(algorithm={self.algorithm} is a built-in recipe)",
            )
        _check(self.rounds >= 1, "rounds", self.rounds, "must be >= 1")
        _check(self.seed >= 0, "seed", self.seed, "must be >= 0")
        n = self.dataset.num_clients
        s = self.sampling
        if s.mode == "fixed" and s.cohort_size is not None:
            _check(
                s.cohort_size <= n,
                "sampling.cohort_size",
                s.cohort_size,
                f"exceeds dataset.num_clients={n}",
            )
        if s.max_cohort is not None:
            _check(
                s.max_cohort <= n,
                "sampling.max_cohort",
                s.max_cohort,
                f"exceeds dataset.num_clients={n}",
            )
        if self.is_private:
            p = self.privacy
            given = (p.epsilon is not None) + (p.noise_multiplier is not None)
            _check(
                given == 1,
                "privacy.epsilon",
                p.epsilon,
                "give exactly one of privacy.epsilon and privacy.noise_multiplier "
                f"(noise_multiplier={p.noise_multiplier!r})",
            )
            if self.algo.noise_site == "client":
                _check(
                    s.mode == "fixed",
                    "algo.noise_site",
                    self.algo.noise_site,
                    "client-side noise is exact only for sampling.mode=fixed (known m)",
                )
            if s.max_cohort is not None:
                _check(
                    p.accountant != "rdp",
                    "privacy.accountant",
                    p.accountant,
                    "sampling.max_cohort (truncated Poisson) is accounted by PLD only",
                )
            if s.mode == "fixed":
                _check(
                    p.accountant != "pld",
                    "privacy.accountant",
                    p.accountant,
                    "fixed-size sampling is accounted by RDP only (replace-one)",
                )

    def default_client_test_fraction(self) -> float:
        """``dataset.client_test_fraction`` when it is null: 0 for a recipe that trains
        one global model (clients train on all their data, as in the papers), and
        :data:`HELD_OUT_FRACTION` when a metric needs each client's held-out split (a
        personalised recipe's ``personal_accuracy_nonprivate``, or
        ``eval.membership_inference``'s non-members)."""
        if self.algorithm == CUSTOM:
            personal = self.recipe.personal
        else:
            personal = CATALOG[self.algorithm].personal
        return HELD_OUT_FRACTION if personal or self.eval.membership_inference else 0.0

    @property
    def is_private(self) -> bool:
        if self.algorithm == CUSTOM:
            return self.recipe.private
        return self.algorithm not in NON_PRIVATE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# --------------------------------------------------------------------------- building


@functools.cache
def _section_types(cls: type) -> dict[str, Any]:
    """A config class's field annotations, resolved once per class (``get_type_hints``
    evaluates the string annotations again at every call: 0.14 ms each, eleven per
    config built, and a sweep of tiny trials builds several configs per trial). The
    dict is shared: read it, never change it."""
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Coerce ``value`` (from YAML or a ``--set`` string) to annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r}: expected a string")
    if origin is tuple:  # tuple[str, ...]: a YAML list, or a comma-separated string
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{key}={value!r}: expected a list of names")
    raise ConfigError(f"{key}: unsupported type {tp}")


#: Keys that were renamed, with what to write instead (a one-line error, never a guess).
RENAMED = {
    "algo.sparsity": (
        "write algo.keep_fraction for the kept fraction p of top-k / rand-k / server "
        "top-k, or algo.zero_fraction for the zeroed fraction c of LUS"
    ),
}


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}={data!r}: expected a mapping")
    hints = _section_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in known:
            if key in RENAMED:
                raise ConfigError(f"{key}: renamed; {RENAMED[key]}")
            raise ConfigError(f"{key}: unknown config key (known: {', '.join(sorted(known))})")
        tp = hints[k]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, f"{key}.")
        else:
            kwargs[k] = _coerce(key, v, tp)
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``key=value``; the value is read as YAML (so ``1e-5``, ``true``, ``null``)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; ConfigError naming ``--config`` otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(p)!r}: no such file")
    loaded = yaml.safe_load(p.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {str(p)!r}: expected a YAML mapping at top level")
    return loaded


def user_tree(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the user wrote, as a nested mapping: ``base``, then the YAML file (a diff),
    then the ``key=value`` overrides, in that order; no defaults filled in."""
    tree: dict[str, Any] = json.loads(json.dumps(base)) if base else {}
    if path is not None:
        loaded = read_yaml_mapping(path)
        if "preset" in loaded:  # engine.config.presets: a paper table, several runs
            raise ConfigError(
                f"--config {str(path)!r}: is a paper preset (preset: section); run it with "
                "dpfl compare --config FILE [--scale cpu]"
            )
        tree = _merge(tree, loaded)
    for item in overrides or []:
        key, value = parse_override(item)
        _set_path(tree, key, value)
    return tree


def dotted_leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: every non-mapping value by its dotted key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(dotted_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Build a :class:`RunConfig` from defaults, a YAML file (a diff over the defaults)
    and ``key=value`` overrides, in that order (:func:`user_tree`)."""
    return _build(RunConfig, user_tree(path, overrides, base), "")


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a config from :meth:`RunConfig.to_dict` output (or any nested mapping)."""
    return _build(RunConfig, data, "")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def with_algorithm(config: RunConfig, algorithm: str, **changes: Any) -> RunConfig:
    """``config`` run by ``algorithm`` (plus dotted ``changes``). A built-in recipe gets
    the default ``recipe:`` section: a config's composed recipe belongs to its
    ``custom`` row only, so ``dpfl compare``/``tune`` can set it beside built-in ones."""
    if algorithm != CUSTOM:
        changes = {"recipe": dataclasses.asdict(RecipeConfig()), **changes}
    return replace(config, algorithm=algorithm, **changes)


def replace(config: RunConfig, **changes: Any) -> RunConfig:
    """``dataclasses.replace`` that accepts dotted keys, e.g. ``{"privacy.epsilon": 4}``."""
    tree = config.to_dict()
    for k, v in changes.items():
        _set_path(tree, k.replace("__", "."), v)
    return config_from_dict(tree)
