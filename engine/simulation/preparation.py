"""Everything before the rounds: :func:`prepare` is a run's one validation stage and
its plan. It checks everything that can be checked without training (config values,
the dataset's files and their format, the device, Ray's start settings, the model on
the data, the privacy budget; :mod:`engine.simulation.validation`) and builds the
dataset and the run's one pipeline; ``dpfl run`` calls it before Ray starts and before
it writes a file, and :func:`engine.simulation.simulate` executes the :class:`Prepared`
it returns (``prepared=``) without preparing again. :func:`make_executor` builds the
worker pool (in process or Ray actors) that runs the rounds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import ConfigError, RunConfig
from engine.simulation.validation import check_data_files, check_environment
from engine.telemetry import timeline

if TYPE_CHECKING:  # pragma: no cover
    from engine.data import FederatedDataset
    from engine.runtime.executors import Executor
    from engine.simulation.privacy_plan import PrivacyPlan


@dataclass
class Prepared:
    """A run, checked and built, before its executor: :func:`prepare`'s result."""

    config: RunConfig
    plan: PrivacyPlan
    dataset: FederatedDataset
    pipeline: Any = None
    steps: int | None = None  # public K, when fixed
    adaptive: Any = None  # AdaptiveClipSpec under privacy.clip_mode=adaptive
    audit: Any = None  # engine.privacy.audit.AuditSpec under eval.audit_canaries > 0


def prepare(config: RunConfig, dataset: FederatedDataset | None = None) -> Prepared:
    """The run's validation stage and plan: every check that needs no training, in
    order of cost, then the dataset (``dataset``: one built already) and the
    pipeline. Raises ConfigError (one line naming the key) and starts nothing."""
    check_environment(config)  # the device; Ray's start settings and address
    if dataset is None:
        check_data_files(config.dataset)  # present, and each file's format
    # The engine's heavy modules (torch, dp-accounting), once the checks that need
    # none of them have passed: those refuse without waiting for the imports.
    from algorithms.recipes import build_pipeline
    from engine.models import build_model
    from engine.simulation.privacy_plan import plan_privacy
    from engine.simulation.validation import check_model_fits, check_shared_body, load_data

    timeline.mark("imports done")
    timeline.mark("privacy start")
    plan = plan_privacy(config)
    timeline.mark("privacy done")
    if dataset is None:
        dataset = load_data(config)
    timeline.mark("data done")
    if dataset.num_clients != config.dataset.num_clients:
        raise ConfigError(
            f"dataset.num_clients={config.dataset.num_clients}: the data has "
            f"{dataset.num_clients} clients"
        )
    try:
        model = build_model(config.model.name, dataset.input_shape, dataset.num_classes)
    except ValueError as e:
        raise ConfigError(
            f"model.name={config.model.name!r} does not fit dataset.name="
            f"{config.dataset.name!r} (input {dataset.input_shape}): {e}"
        ) from None
    check_model_fits(config, dataset, model)
    from engine.privacy.adaptive_clip import adaptive_spec
    from engine.privacy.audit import audit_spec

    try:
        adaptive = adaptive_spec(config, plan)
        audit = audit_spec(config, plan, flatten_dim(model))
        # The run's one pipeline: server and workers receive this object, and noise,
        # clipping and the accountant read C, z (and z_Δ) from its privatizer.
        algo = config.algo
        resolved = plan.sampling.algo_keys()  # what the participation resolved (bands)
        if resolved:
            algo = dataclasses.replace(algo, **resolved)
        pipeline = build_pipeline(
            config.algorithm,
            algo,
            plan.clip_norm,
            plan.noise_multiplier,
            config.model.name,
            config.recipe,
        ).with_adaptive(adaptive)
        validate_pipeline(pipeline, model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_shared_body(config, pipeline, model)
    steps = public_steps(config, pipeline)
    timeline.mark("prepared")
    return Prepared(config, plan, dataset, pipeline, steps, adaptive, audit)


def flatten_dim(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def validate_pipeline(pipeline, model) -> None:
    """Check hyperparameters that need the model (sizes), before any training."""
    from algorithms.pieces.sparsify import num_kept
    from algorithms.pipeline import RandK, ServerTopK, TopK
    from engine.federated.worker_model import flatten_params, personal_mask

    d = int(flatten_params(model).numel())
    for t in (*pipeline.client_transforms, *pipeline.server_transforms):
        if isinstance(t, (TopK, RandK, ServerTopK)):
            num_kept(d, t.fraction)
    if pipeline.personal is not None:
        personal_mask(model, pipeline.personal.layers)


#: K for recipes that need a fixed number of local steps (``Pipeline.fixed_steps``) when
#: ``local.steps`` is unset. A public constant: K enters such a method's public drift and step size
#: γ = η·K and every client's work, so it may not depend on the clients' data (a
#: median over client sizes changes when one client leaves).
DEFAULT_FIXED_STEPS = 10


def public_steps(config: RunConfig, pipeline) -> int | None:
    """K, the public number of local steps, when every client must run exactly K steps:
    ``local.steps`` if set; for recipes that need a fixed K, otherwise
    :data:`DEFAULT_FIXED_STEPS`. A function of the config only, never of the data."""
    if config.local.steps is not None:
        return config.local.steps
    if not pipeline.fixed_steps:
        return None
    return DEFAULT_FIXED_STEPS


def make_executor(prep: Prepared, run_name: str = "dpfl", state_dir: str | None = None) -> Executor:
    """The worker pool of a prepared run: in process, in forked processes, or Ray
    actors (Ray starts here)."""
    from engine.federated.client import LocalSpec
    from engine.federated.server import ServerSpec
    from engine.runtime.local_pool import local_executor
    from engine.runtime.ray_pool import ray_executor

    cfg, plan = prep.config, prep.plan
    threads = max(1, int(cfg.ray.num_cpus_per_worker))
    local = LocalSpec(
        seed=cfg.seed,
        model_name=cfg.model.name,
        epochs=cfg.local.epochs,
        batch_size=cfg.local.batch_size,
        lr=cfg.local.lr,
        lr_decay=cfg.local.lr_decay,
        momentum=cfg.local.momentum,
        weight_decay=cfg.local.weight_decay,
        pipeline=prep.pipeline,
        num_threads=threads,
        denominator=plan.sampling.denominator,
        steps=prep.steps,
        state_dir=state_dir,
        clients_per_batch=cfg.ray.clients_per_worker_batch,
        memory_format=cfg.model.memory_format,
        model_init=cfg.model.init,
        device=cfg.ray.worker_device,
        # groups sized for this share of a GPU (a Tune trial's 1/tune.trials_per_gpu);
        # the Ray pool replaces it with the share it plans (engine.runtime.resources)
        gpu_share=float(cfg.ray.num_gpus_per_worker),
        secure=cfg.privacy.secure_noise,
    )
    server = ServerSpec(
        seed=cfg.seed,
        model_name=cfg.model.name,
        pipeline=prep.pipeline,
        server_lr=cfg.server.lr,
        delta=plan.delta,
        accountant=plan.accountant,
        sampling=plan.sampling,
        eval_every=cfg.eval.every,
        rounds=cfg.rounds,
        num_threads=threads,
        local_lr=cfg.local.lr,
        lr_decay=cfg.local.lr_decay,
        steps=prep.steps,
        membership_inference=cfg.eval.membership_inference,
        secure=cfg.privacy.secure_noise,
        audit=prep.audit,
        model_init=cfg.model.init,
    )
    if cfg.ray.executor == "local":
        return local_executor(prep.dataset, server, local, cfg.ray.num_workers)
    if cfg.ray.executor == "processes":
        from engine.runtime.process_pool import process_executor

        return process_executor(prep.dataset, server, local, cfg.ray.num_workers)
    return ray_executor(prep.dataset, server, local, cfg.ray, run_name=run_name)


def privacy_options(prep: Prepared) -> dict[str, Any]:
    """Columns (and config.json entries) of adaptive clipping and the canary audit."""
    ad = prep.adaptive
    out: dict[str, Any] = {
        "clip_mode": "adaptive" if ad else ("fixed" if prep.plan.private else "none")
    }
    if ad is not None:
        out.update(
            update_noise_multiplier=ad.update_noise_multiplier,
            clip_count_stddev=ad.count_stddev,
            target_quantile=ad.target_quantile,
            clip_lr=ad.lr,
        )
    if prep.audit is not None:
        out.update(prep.audit.summary())
    return out
