"""``simulate(config)``: validate, resolve privacy, build data, run rounds, write results.

Everything that can be checked is checked in :func:`prepare` before any training:
config values, dataset files, model/data compatibility, and the privacy budget (σ is
calibrated from ε, or ε computed from σ, by dp-accounting with the sampling actually
used). The ε recorded for each round is the accountant's cumulative ε after that
round; the final ε is the accountant's value for the rounds actually run.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from algorithms.recipes import build_pipeline, resolved_hyperparameters
from engine.config import ConfigError, RunConfig
from engine.data import FederatedDataset, build_dataset, check_dataset_files
from engine.federated.client import LocalSpec
from engine.federated.server import ServerSpec
from engine.models import build_model
from engine.privacy import rng as rngs
from engine.privacy.accounting import MAX_DELTA_TIMES_N
from engine.results import RoundWriter, atomic_write, write_json
from engine.runtime.executors import Executor, local_executor, ray_executor
from engine.simulation.privacy_plan import PrivacyPlan, plan_privacy, sampling_spec
from engine.telemetry import timeline
from engine.telemetry.metrics import RunMetrics, run_label

__all__ = [
    "PrivacyPlan",
    "Prepared",
    "SimulationResult",
    "load_run",
    "make_executor",
    "plan_privacy",
    "prepare",
    "sampling_spec",
    "simulate",
]

timeline.mark("imports done")  # dpfl run: engine.simulation (torch, dp-accounting, pandas) loaded


@dataclass
class Prepared:
    config: RunConfig
    plan: PrivacyPlan
    dataset: FederatedDataset
    pipeline: Any = None
    steps: int | None = None  # public K, when fixed
    adaptive: Any = None  # AdaptiveClipSpec under privacy.clip_mode=adaptive
    audit: Any = None  # engine.privacy.audit.AuditSpec under eval.audit_canaries > 0


def prepare(config: RunConfig, dataset: FederatedDataset | None = None) -> Prepared:
    """All checks that need no training; builds the dataset. Raises ConfigError."""
    try:
        if dataset is None:
            check_dataset_files(config.dataset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    timeline.mark("privacy start")
    plan = plan_privacy(config)
    timeline.mark("privacy done")
    if dataset is None:
        try:
            dataset = build_dataset(config.dataset, rngs.numpy_rng(config.seed, rngs.DATA))
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
    from engine.privacy.adaptive_clip import adaptive_spec
    from engine.privacy.audit import audit_spec

    try:
        adaptive = adaptive_spec(config, plan)
        audit = audit_spec(config, plan, flatten_dim(model))
        # The run's one pipeline: server and workers receive this object, and noise,
        # clipping and the accountant read C, z (and z_Δ) from its privatizer.
        algo = config.algo
        if plan.sampling.mode == "bands":  # the bands the participation was built with
            algo = dataclasses.replace(algo, bands=plan.sampling.bands)
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
    steps = public_steps(config, pipeline)
    timeline.mark("prepared")
    return Prepared(config, plan, dataset, pipeline, steps, adaptive, audit)


def flatten_dim(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def validate_pipeline(pipeline, model) -> None:
    """Check hyperparameters that need the model (sizes), before any training."""
    from algorithms.pieces.sparsify import num_kept
    from algorithms.pipeline import LUS, RandK, ServerTopK, TopK
    from engine.federated.worker_model import flatten_params, personal_mask

    d = int(flatten_params(model).numel())
    for t in (*pipeline.client_transforms, *pipeline.server_transforms):
        if isinstance(t, (TopK, RandK, ServerTopK)):
            num_kept(d, t.fraction)
        if isinstance(t, LUS) and not 0 <= t.zero_fraction < 1:
            raise ValueError(
                f"algo.zero_fraction={t.zero_fraction}: LUS zeroes this fraction; use [0, 1)"
            )
    if pipeline.personal is not None:
        personal_mask(model, pipeline.personal.layers)


#: K for recipes that need a fixed number of local steps (PGN) when ``local.steps`` is
#: unset. A public constant: K enters the public drift (1 − β)·K·η·g̃, the step size
#: γ = η·K and every client's work, so it may not depend on the clients' data (a
#: median over client sizes changes when one client leaves).
DEFAULT_FIXED_STEPS = 10


def public_steps(config: RunConfig, pipeline) -> int | None:
    """K, the public number of local steps, when every client must run exactly K steps:
    ``local.steps`` if set; for recipes that need a fixed K (PGN), otherwise
    :data:`DEFAULT_FIXED_STEPS`. A function of the config only, never of the data."""
    if config.local.steps is not None:
        return config.local.steps
    if not pipeline.fixed_steps:
        return None
    return DEFAULT_FIXED_STEPS


@dataclass
class SimulationResult:
    config: RunConfig
    privacy: dict[str, Any]
    rounds: pd.DataFrame
    weights: np.ndarray
    out_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_accuracy(self) -> float:
        acc = self.rounds["test_accuracy"].dropna()
        return float(acc.iloc[-1]) if len(acc) else math.nan

    @property
    def final_epsilon(self) -> float:
        return float(self.rounds["epsilon"].iloc[-1])


def default_out_dir(config: RunConfig) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")  # microseconds: no collisions
    return Path("results") / f"{stamp}-{config.algorithm}"


def make_executor(prep: Prepared, run_name: str = "dpfl", state_dir: str | None = None) -> Executor:
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


CHECKPOINT_FILE = "checkpoint.pkl"


def save_checkpoint(out_dir: Path, state: dict) -> None:
    """Atomically write the round checkpoint (before the round's row is released)."""
    import pickle

    # a full disk: one error naming the file, the old one kept
    with atomic_write(Path(out_dir) / CHECKPOINT_FILE) as tmp:
        tmp.write_bytes(pickle.dumps(state))


def load_run(out_dir: str | Path) -> tuple[RunConfig, dict]:
    """(config, checkpoint) of an interrupted ``dpfl run`` whose results are in
    ``out_dir``, after :func:`engine.results.run_folder.check_run_folder` checked the config,
    the checkpoint and every released row; raises ConfigError naming the missing or
    damaged file."""
    from engine.results.run_folder import check_run_folder

    folder = check_run_folder(out_dir)
    if folder.state is None:
        path = Path(out_dir) / CHECKPOINT_FILE
        raise ConfigError(f"--resume {out_dir}: {path} is missing (no round has ended)")
    return folder.config, folder.state


def simulate(
    config: RunConfig,
    *,
    progress: bool = False,
    write: bool = True,
    dataset: FederatedDataset | None = None,
    resume: dict | None = None,
    on_round: Callable[[dict, Executor], None] | None = None,
    on_checkpoint: Callable[[dict, dict], None] | None = None,
    run_name: str = "dpfl",
    trial: str = "",
) -> SimulationResult:
    """Run one simulation and return its rounds as a DataFrame.

    Args:
        config: The run configuration.
        progress: Show a progress bar (round, accuracy, ε spent).
        write: Write ``config.json``, ``rounds.parquet`` and, after every round and
            before its row, ``checkpoint.pkl`` (model, server and per-client state) under
            ``config.out`` (default ``results/<timestamp>-<algorithm>/``); a crashed
            run continues with ``dpfl run --resume DIR`` (:func:`load_run`).
        dataset: Use this dataset instead of building one from ``config.dataset``.
        resume: A checkpoint to continue from (the rounds it holds are not re-run;
            results are identical to an uninterrupted run). A checkpoint written by
            ``simulate`` also holds its round's row, released here if it was not yet.
        on_round: Called after every round with the row and the executor: the
            release of the round (after its checkpoint).
        on_checkpoint: Called after every round, *before* the round is released, with
            the checkpoint (``Executor.checkpoint()`` plus ``"row"``) and the row; a
            caller that persists checkpoints itself (Tune) does it here, so that a
            released round is never recomputed on resume.
        run_name: Prefix of the Ray actor names (unique per concurrent run); also the
            ``run`` tag of the dashboard metrics (:mod:`engine.telemetry.metrics`).
        trial: The ``trial`` tag of the dashboard metrics (Tune's trial id).
    """
    prep = prepare(config, dataset)
    plan = prep.plan
    out_dir = Path(config.out) if config.out else default_out_dir(config)
    writer = RoundWriter(out_dir) if write else None
    if write:
        write_json(out_dir / "config.json", {"config": config.to_dict(), "privacy": plan.summary()})
    if plan.private and plan.delta * config.dataset.num_clients > MAX_DELTA_TIMES_N:
        warnings.warn(
            f"privacy.delta={plan.delta:.3g} with dataset.num_clients="
            f"{config.dataset.num_clients}: N·delta = {plan.delta * config.dataset.num_clients:.3g}"
            f" > {MAX_DELTA_TIMES_N}; the guarantee may fail for that many clients in "
            "expectation (the default delta keeps N·delta <= 0.01)",
            stacklevel=2,
        )
    if plan.private and plan.sampling.mode == "fixed":
        warnings.warn(
            "sampling.mode=fixed is accounted under replace-one adjacency with sensitivity 2C; "
            f"its epsilon ({plan.planned_epsilon:.3g}) is far looser than Poisson sampling's",
            stacklevel=2,
        )
    static = {
        "algorithm": config.algorithm,
        "dataset": config.dataset.name,
        "model": config.model.name,
        "eval_source": prep.dataset.meta.get("eval_source", "public"),
        "seed": config.seed,
        "randomness": plan.randomness,
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "clip_norm": plan.clip_norm,
        "sampling": plan.sampling.name,
        "sampling_rate": plan.sampling.effective_rate,
        "adjacency": plan.summary()["adjacency"],
        "accountant": plan.summary()["accountant"],
        "epsilon_budget": plan.target_epsilon if plan.target_epsilon is not None else math.nan,
        **(
            {"rounds_per_epoch": plan.sampling.rounds_per_epoch}
            if plan.sampling.mode == "epochs"
            else {}
        ),
        "local_steps": prep.steps if prep.steps is not None else math.nan,
        **resolved_hyperparameters(prep.pipeline),
    }
    if prep.adaptive is not None:  # each row carries the C_t its round used
        static.pop("clip_norm")
    privacy_extra = privacy_options(prep)
    static.update(privacy_extra)
    rows: list[dict[str, Any]] = []
    done = int(resume["server"]["rounds_done"]) if resume is not None else 0
    if resume is not None and writer is not None and writer.path.exists():
        # The checkpoint is written before its round's row, so every row on disk is at
        # or before the checkpoint: no released round is ever computed again.
        previous = pd.read_parquet(writer.path)
        rows = previous[previous["round"] <= done].to_dict("records")
        writer.rows = [dict(r) for r in rows]
    # A crash between a checkpoint and its row leaves that row unreleased: release the
    # copy the checkpoint holds (the same values; the round is not recomputed).
    pending = (resume or {}).get("row")
    if pending is not None and int(pending["round"]) != done:
        pending = None
    state_dir = None
    if config.algo.client_state == "disk":
        state_dir = str((out_dir if write else Path(tempfile.mkdtemp())) / "client_state")
    if run_name == "dpfl" and write:  # dpfl run: actors and metrics name the folder
        run_name = run_label(out_dir)
    executor = make_executor(prep, run_name=run_name, state_dir=state_dir)
    bar = None
    if progress:  # after the executor: Ray's start-up lines do not land on the bar's line
        from tqdm.auto import tqdm

        bar = tqdm(total=config.rounds, desc=config.algorithm, unit="round")
    metrics = RunMetrics(run_name, trial, config.algorithm)
    t0 = time.perf_counter()
    timeline.mark("rounds start")
    last_acc = math.nan
    start = 0
    if resume is not None:
        executor.restore(resume)
        start = done
        if bar is not None:
            bar.update(start)
    try:
        if pending is not None:
            if not any(int(r["round"]) == done for r in rows):
                rows.append(dict(pending))
                if writer is not None:
                    writer.append(pending)
            if on_round is not None:
                on_round(dict(pending), executor)
        for rnd in range(start, config.rounds):
            t_round = time.perf_counter()
            row = executor.run_round(rnd)
            timeline.mark(f"round {rnd + 1}")
            row.update(static)
            row["wall_time_s_nonprivate"] = time.perf_counter() - t0
            if not math.isnan(row["test_accuracy"]):
                last_acc = row["test_accuracy"]
            # Checkpoint, then release: a crash after the release resumes from this
            # round's state, so a released round is never recomputed (with noise that
            # GPU kernels need not reproduce bit for bit: two releases of one round).
            if writer is not None or on_checkpoint is not None:
                state = {**executor.checkpoint(), "row": dict(row)}
                if writer is not None:
                    save_checkpoint(out_dir, state)
                if on_checkpoint is not None:
                    on_checkpoint(state, row)
            metrics.record({**row, "test_accuracy": last_acc}, time.perf_counter() - t_round)
            rows.append(row)
            if writer is not None:
                writer.append(row)
            if on_round is not None:
                on_round(row, executor)
            if bar is not None:
                bar.set_postfix(acc=f"{last_acc:.3f}", eps=f"{row['epsilon']:.3g}")
                bar.update(1)
        weights = executor.weights()
    finally:
        timeline.mark("closing")
        executor.close()
        timeline.mark("executor closed")
        if bar is not None:
            bar.close()
    frame = pd.DataFrame(rows)
    summary = {**plan.summary(), **privacy_extra}
    summary["final_epsilon"] = (
        float(frame["epsilon"].iloc[-1]) if len(frame) else plan.planned_epsilon
    )
    if write:
        write_json(out_dir / "config.json", {"config": config.to_dict(), "privacy": summary})
    timeline.mark("results written")
    return SimulationResult(config, summary, frame, weights, out_dir if write else None)
