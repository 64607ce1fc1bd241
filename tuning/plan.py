"""The plan of a ``dpfl tune`` experiment, before any trial runs.

Its settings (the YAML's ``tune`` section, the smoke-test sizes, which runner and which
executor a trial uses, the searcher and scheduler), where its trials run (each trial's
placement group, GPU packing, the check that one trial fits the cluster) and how many
trials each (algorithm, ε) cell runs (:func:`trial_counts`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.base.atomic import atomic_write
from engine.config import ConfigError, RunConfig, read_yaml_mapping, replace
from tuning import selection

SMOKE = {
    "rounds": 2,
    "eval.every": 1,
    "dataset.num_clients": 60,
    "dataset.synthetic_mean_samples": 20,
    "ray.num_workers": 1,
    "ray.num_cpus_per_worker": 0.5,
}
HEAD_CPUS = 0.5
#: Trials sharing one GPU when the cluster has GPUs and ``ray.num_gpus_per_worker`` is
#: unset (``tune.trials_per_gpu``; see :func:`pack_trials_per_gpu`). 8: on an H200,
#: 8 concurrent ``cnn`` trials gave 1.46-2.31x one trial's client updates/s in three
#: runs, 4 gave 0.78-1.37x and 2 gave 0.51-0.84x (``benchmarks/sweep_gpu.py``; README,
#: GPU packing); each trial's vectorised groups are sized for its 1/8 of the card.
TRIALS_PER_GPU = 8
#: Where a trial's simulation runs (``tune.trial_executor``): ``auto`` is ``local``
#: (inside the trial's own process) when ``ray.num_workers == 1`` — one worker actor
#: would add a process to start and no parallelism — else ``ray.executor``.
TRIAL_EXECUTORS = ("auto", "ray", "local")


#: How the trials of a cell are run (``tune.runner`` / ``dpfl tune --runner``): ``tune``
#: (Ray Tune: trials in parallel processes, any searcher and scheduler, a cluster),
#: ``processes`` (:mod:`tuning.trial_pool`: in parallel in a pool of local processes
#: started once, no Tune, no Ray; random search and FIFO only) or ``driver`` (one after
#: another in this process, no Tune; random search and FIFO only). ``auto``, the
#: default, is :func:`choose_runner`.
RUNNERS = ("tune", "driver", "processes")
#: The runner an experiment was started with (``OUT/tune/<this>``); a resume must match.
RUNNER_FILE = "runner.txt"


def trial_executor(choice: str, ray_cfg) -> str:
    """The executor a trial uses (see :data:`TRIAL_EXECUTORS`); ConfigError naming
    ``tune.trial_executor`` for another value. Both executors give bit-identical
    results (``engine.runtime.executors``), so the choice is only about speed:
    ``benchmarks/tune_overhead.py`` measured a sweep of 32 smoke trials (1 worker) in
    4.8-5.3 s under ``auto`` (330 s with actor trials, at load 4-8, before trial processes
    were reused)."""
    if choice not in TRIAL_EXECUTORS:
        raise ConfigError(f"tune.trial_executor={choice!r}: must be {', '.join(TRIAL_EXECUTORS)}")
    if choice == "auto":
        return "local" if ray_cfg.num_workers == 1 else ray_cfg.executor
    return choice


def choose_runner(
    requested: str, search: str, scheduler: str, executor_choice: str, ray_cfg, gpus: bool
) -> str:
    """``tune.runner: auto``: ``processes`` for a random-search FIFO sweep on this
    machine (no Ray cluster address, no CUDA GPU, trials free to use the in-process
    executor), else ``tune``. ``benchmarks/sweep_speed.py`` measured 8 trials of 30
    rounds of ``dpfl run``'s default workload on 2 cores at 0.3x the time of 8 separate
    runs in the process runner against 0.6-0.7x under Tune (README, Performance).
    Any other value is returned as it is."""
    if requested != "auto":
        return requested
    attached = bool(ray_cfg.address or os.environ.get("RAY_ADDRESS"))
    if search != "random" or scheduler != "fifo" or attached or gpus:
        return "tune"
    return "tune" if executor_choice == "ray" else "processes"


def read_tune_file(path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a YAML file into (config tree, ``tune`` section)."""
    if path is None:
        return {}, {}
    tree = read_yaml_mapping(path)
    tune_section = tree.pop("tune", {}) or {}
    known = {
        "space",
        "checkpoint_every",
        "head_cpus",
        "trial_executor",
        "runner",
        "trials_per_gpu",
        "total_epsilon",
        "trial_processes",
    }
    unknown = set(tune_section) - known
    if unknown:
        raise ConfigError(
            f"tune.{sorted(unknown)[0]}: unknown key (known: {', '.join(sorted(known))})"
        )
    procs = tune_section.get("trial_processes")
    if procs is not None and (isinstance(procs, bool) or not isinstance(procs, int) or procs < 1):
        raise ConfigError(f"tune.trial_processes={procs!r}: must be an integer >= 1")
    every = tune_section.get("checkpoint_every", 1)
    if every != 1:
        raise ConfigError(
            f"tune.checkpoint_every={every!r}: must be 1 (every round is checkpointed before "
            "it is released, so a resumed trial never recomputes a released round)"
        )
    return tree, tune_section


def experiment_name(algorithm: str, epsilon: float) -> str:
    return f"{algorithm}-eps{epsilon:g}"


def make_searcher(search: str):
    if search == "random":
        return None
    if search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError as e:  # pragma: no cover - depends on optional package
            raise ConfigError(f"--search=optuna needs optuna: pip install optuna ({e})") from None
        return OptunaSearch()  # metric and mode: from the TuneConfig, as the scheduler
    if search == "hyperopt":
        try:
            from ray.tune.search.hyperopt import HyperOptSearch
        except ImportError as e:  # pragma: no cover
            raise ConfigError(
                f"--search=hyperopt needs hyperopt: pip install hyperopt ({e})"
            ) from None
        return HyperOptSearch()  # metric and mode: from the TuneConfig
    raise ConfigError(f"--search={search!r}: must be random, optuna or hyperopt")


def make_scheduler(name: str, rounds: int):
    if name == "fifo":
        return None
    if name == "asha":
        from ray.tune.schedulers import ASHAScheduler

        # metric and mode come from the TuneConfig: Tune refuses a scheduler that
        # names them too.
        return ASHAScheduler(
            time_attr="training_iteration", max_t=rounds, grace_period=max(1, rounds // 4)
        )
    raise ConfigError(f"--scheduler={name!r}: must be fifo or asha")


def trial_counts(
    out: Path,
    algorithms: list[str],
    epsilons: list[float],
    config: RunConfig,
    num_samples: int,
    mode: str,
    shape: float,
    resume: bool,
) -> dict[str, int]:
    """Trials per (algorithm, ε): ``num_samples`` under composition, else K drawn per
    cell with mean ``num_samples`` (kept in ``unreleased/tuning_draws.json`` so that a
    resumed experiment runs the same K; that file is never to be published)."""
    import json
    import zlib

    from engine.privacy import rng as rngs

    names = [experiment_name(a, e) for a in algorithms for e in epsilons]
    if not selection.is_papernot_steinke(mode):
        return dict.fromkeys(names, num_samples)
    path = out / "unreleased" / "tuning_draws.json"
    saved: dict[str, int] = {}
    if resume and path.is_file():
        record = json.loads(path.read_text())
        if record.get("mode") == mode and record.get("mean") == num_samples:
            saved = {k: int(v) for k, v in record["num_trials"].items()}
    counts: dict[str, int] = {}
    for a in algorithms:
        for e in epsilons:
            name = experiment_name(a, e)
            if name in saved:
                counts[name] = saved[name]
                continue
            rng = None  # release mode: K from OS entropy, never derivable from the seed
            if not config.privacy.secure_noise:
                key = zlib.crc32(f"{a}|{e:g}".encode())
                rng = rngs.numpy_rng(config.seed, rngs.TUNING_COUNT, key)
            counts[name] = selection.draw_num_trials(mode, num_samples, shape, rng)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text(
            json.dumps({"mode": mode, "mean": num_samples, "shape": shape, "num_trials": counts})
        )
    return counts


def trial_bundles(ray_cfg, head: float) -> list[dict[str, float]]:
    """One trial's placement group.

    ``ray.executor=ray`` (default): the trial's own process (``tune.head_cpus``) plus
    one bundle per client-worker actor, which the trial starts. ``ray.executor=local``:
    the trial runs the whole simulation in its own process (the in-process executor,
    identical results), so it reserves one bundle of ``head + num_cpus_per_worker``
    CPUs (and the workers' GPU share, if any) and starts no actors — no per-trial actor
    start-up or dataset copy, at the price of training the shards one after another.
    That is what an actor trial of one worker reserves: the process does the head's
    work and one worker's at a time. (``max(head, num_cpus_per_worker)`` let four
    smoke-test trials share 2 cores and measured slower: 32 trials took 9.65 s against
    6.18 s with this rule, and 41.7 s against 34.3 s at 50 rounds;
    ``benchmarks/tune_overhead.py``.)
    """
    if ray_cfg.executor == "local":
        bundle = {"CPU": head + ray_cfg.num_cpus_per_worker}
        if ray_cfg.num_gpus_per_worker:
            bundle["GPU"] = ray_cfg.num_gpus_per_worker
        return [bundle]
    return [{"CPU": head}] + [
        {"CPU": ray_cfg.num_cpus_per_worker, "GPU": ray_cfg.num_gpus_per_worker}
    ] * ray_cfg.num_workers


def pack_trials_per_gpu(config: RunConfig, trials_per_gpu: Any, cluster_gpus: float) -> RunConfig:
    """Give each trial 1/``trials_per_gpu`` of a GPU (``tune.trials_per_gpu``).

    Applies when the Ray cluster has GPUs, ``ray.num_gpus_per_worker`` is 0 (unset: an
    explicit share wins), ``ray.gpu_packing=fixed`` and ``ray.worker_device`` is not
    ``cpu``: a trial's share is split over its client workers (one share for
    ``ray.executor=local``, whose trial trains in its own process), so its placement
    group asks for 1/``trials_per_gpu`` GPU in all and that many trials run side by
    side on each GPU. Ray's fractional GPUs are scheduling labels, not memory limits:
    vectorised groups are sized from the worker's share of the card
    (:mod:`engine.runtime.resources`), and ``tune.trials_per_gpu: 1`` gives every trial a whole
    GPU. Only where trials run changes (float rounding on a GPU), never what they compute.
    """
    if isinstance(trials_per_gpu, bool) or not isinstance(trials_per_gpu, int):
        raise ConfigError(f"tune.trials_per_gpu={trials_per_gpu!r}: must be an integer >= 1")
    if trials_per_gpu < 1:
        raise ConfigError(f"tune.trials_per_gpu={trials_per_gpu}: must be an integer >= 1")
    r = config.ray
    if cluster_gpus <= 0 or r.num_gpus_per_worker > 0 or r.gpu_packing != "fixed":
        return config
    if r.worker_device == "cpu":
        return config
    workers = 1 if r.executor == "local" else r.num_workers
    return replace(config, **{"ray.num_gpus_per_worker": 1.0 / (trials_per_gpu * workers)})


def check_trial_fits(ray_cfg, head: float) -> None:
    """One trial's placement group must fit the cluster's CPUs, or Tune waits forever
    with every trial PENDING: a one-line error naming the keys instead."""
    import ray

    need = sum(b["CPU"] for b in trial_bundles(ray_cfg, head))
    have = float(ray.cluster_resources().get("CPU", 0.0))
    if need > have + 1e-9:
        what = (
            f"tune.head_cpus={head:g} + ray.num_cpus_per_worker="
            f"{ray_cfg.num_cpus_per_worker:g} with ray.executor=local"
            if ray_cfg.executor == "local"
            else f"tune.head_cpus={head:g} + ray.num_workers={ray_cfg.num_workers} x "
            f"ray.num_cpus_per_worker={ray_cfg.num_cpus_per_worker:g}"
        )
        raise ConfigError(
            f"one trial needs {need:g} CPUs ({what}) but the Ray cluster has {have:g}: "
            "lower ray.num_cpus_per_worker or ray.num_workers"
        )
