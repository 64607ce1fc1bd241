"""``dpfl tune``: search hyperparameters per recipe at fixed budgets ε with Ray Tune.

One Tune experiment per (algorithm, ε) under ``DIR/tune/<algorithm>-eps<ε>``, so
each has its own search space and searcher; ε is fixed per trial and σ calibrated
from it. Results land in ``DIR/rounds/`` (one Parquet dataset partitioned by
algorithm and ε, one row per trial-round) and ``DIR/trials.parquet`` (one row per
trial). ``--resume`` restores unfinished experiments with Tune's restore; trials
continue from their last checkpoint and re-write the same (trial, round) files.

``tuning_privacy`` picks how many trials run and what is released
(:mod:`tuning.selection`): ``compose`` runs ``num_samples`` trials per (algorithm, ε)
and accounts all of them; ``poisson`` / ``truncated_negative_binomial`` draw the
number of trials K per (algorithm, ε) here (from the experiment seed's
``TUNING_COUNT`` stream, or from OS entropy with ``privacy.secure_noise``), keep it in
``unreleased/tuning_draws.json`` (for ``--resume``; K must not be published), run
exactly K random-search trials and mark only the best one ``released`` in
``trials.parquet``.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pandas as pd

from engine.config import (
    ConfigError,
    RunConfig,
    load_config,
    read_yaml_mapping,
    replace,
    with_algorithm,
)
from engine.results import write_json
from engine.runtime.executors import ensure_ray
from tuning import selection
from tuning.spaces import space_for, to_tune
from tuning.sweep_folder import (
    EXPERIMENT_FILE,
    check_sweep_folder,
    experiment_record,
    read_runner,
)
from tuning.trial import column_names, compact_cell, make_trainable, rounds_dir, trial_body

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
#: unset (``tune.trials_per_gpu``; see :func:`pack_trials_per_gpu`).
TRIALS_PER_GPU = 4
#: Where a trial's simulation runs (``tune.trial_executor``): ``auto`` is ``local``
#: (inside the trial's own process) when ``ray.num_workers == 1`` — one worker actor
#: would add a process to start and no parallelism — else ``ray.executor``.
TRIAL_EXECUTORS = ("auto", "ray", "local")


#: How the trials of a cell are run (``tune.runner`` / ``dpfl tune --runner``): ``tune``
#: (Ray Tune: trials in parallel processes, any searcher and scheduler) or ``driver``
#: (one after another in this process, no Tune; random search and FIFO only).
RUNNERS = ("tune", "driver")
#: File-system errors that stop a driver-runner sweep instead of failing one trial:
#: the next trial would meet them too (a full disk, a read-only or forbidden folder).
STOPPING_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM")
    if hasattr(errno, name)
)
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


def read_tune_file(path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a YAML file into (config tree, ``tune`` section)."""
    if path is None:
        return {}, {}
    tree = read_yaml_mapping(path)
    tune_section = tree.pop("tune", {}) or {}
    known = {"space", "checkpoint_every", "head_cpus", "trial_executor", "runner", "trials_per_gpu"}
    unknown = set(tune_section) - known
    if unknown:
        raise ConfigError(
            f"tune.{sorted(unknown)[0]}: unknown key (known: {', '.join(sorted(known))})"
        )
    every = tune_section.get("checkpoint_every", 1)
    if every != 1:
        raise ConfigError(
            f"tune.checkpoint_every={every!r}: must be 1 (every round is checkpointed before "
            "it is released, so a resumed trial never recomputes a released round)"
        )
    return tree, tune_section


def experiment_name(algorithm: str, epsilon: float) -> str:
    return f"{algorithm}-eps{epsilon:g}"


def _searcher(search: str):
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


def _scheduler(name: str, rounds: int):
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


def trials_table(out: Path, statuses: dict[str, str], metric: str) -> pd.DataFrame:
    """One row per trial, from the rounds each trial wrote (and Tune's status)."""
    from tuning.report import load_rounds
    from tuning.trial import hyperparameter_columns

    if not (out / "rounds").is_dir():  # every cell drew K = 0
        return pd.DataFrame(columns=["trial_id", "algorithm", "epsilon_budget", "status"])
    import pyarrow.parquet as pq

    # Only the columns the table shows (half the reading time of a sweep's small
    # files), as far as the files have them: they share one schema (tuning.trial).
    first = next((out / "rounds").rglob("*.parquet"), None)
    present = set(pq.read_schema(first).names) if first is not None else set()
    hyper = hyperparameter_columns()
    fixed = ["noise_multiplier", "epsilon", "wall_time_s_nonprivate", "trial_seed", metric]
    wanted = [c for c in dict.fromkeys([*fixed, *hyper]) if c in present]
    rounds = load_rounds(out, columns=wanted)
    hp_cols = [
        c
        for c in hyper
        if c in rounds and c not in ("personal_accuracy_nonprivate", "mia_auc_nonprivate")
    ]
    # One pass over all trials (a Python loop over per-trial frames took 0.7 ms each).
    rounds = rounds.sort_values(["trial_id", "round"], kind="stable")
    lasts = rounds.groupby("trial_id", sort=True).tail(1)
    if metric in rounds:
        evaluated = rounds.dropna(subset=[metric]).groupby("trial_id")[metric]
        final, best = evaluated.last().to_dict(), evaluated.max().to_dict()
    else:
        final, best = {}, {}
    has_seed = "trial_seed" in rounds
    # Values as the frame holds them (pd.NA stays pd.NA; to_dict would make it None).
    hp_values = {c: list(lasts[c]) for c in hp_cols}
    rows = []
    for i, last in enumerate(lasts.to_dict("records")):
        trial_id = last["trial_id"]
        row = {
            "trial_id": trial_id,
            "algorithm": last["algorithm"],
            "epsilon_budget": float(last["epsilon_budget"]),
            "status": statuses.get(trial_id, "UNKNOWN"),
            "rounds_done": int(last["round"]),
            "noise_multiplier": float(last["noise_multiplier"]),
            "epsilon": float(last["epsilon"]),
            f"final_{metric}": float(final.get(trial_id, math.nan)),
            f"best_{metric}": float(best.get(trial_id, math.nan)),
            "wall_time_s_nonprivate": float(last["wall_time_s_nonprivate"]),
            "trial_seed": int(last["trial_seed"]) if has_seed else -1,
        }
        for c in hp_cols:
            row[c] = hp_values[c][i]
        rows.append(row)
    return pd.DataFrame(rows)


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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(
        json.dumps({"mode": mode, "mean": num_samples, "shape": shape, "num_trials": counts})
    )
    os.replace(tmp, path)
    return counts


def mark_released(
    trials: pd.DataFrame, metric: str, mode: str, num_samples: int, shape: float
) -> pd.DataFrame:
    """Record the tuning rule and which trials are released: all under composition
    (all are accounted), only the best finished trial per (algorithm, ε) by final
    ``metric`` under Papernot-Steinke (the only one that may be published)."""
    trials = trials.copy()
    trials["tuning_privacy"] = mode
    trials["tuning_mean_trials"] = float(num_samples)
    trials["tuning_shape"] = float(shape) if mode == selection.TNB else math.inf
    if not selection.is_papernot_steinke(mode) or trials.empty:
        trials["released"] = True
        return trials
    trials["released"] = False
    col = f"final_{metric}"
    ok = trials[trials["status"] == "TERMINATED"].dropna(subset=[col])
    if not ok.empty:
        best = ok.groupby(["algorithm", "epsilon_budget"])[col].idxmax()
        trials.loc[best.to_numpy(), "released"] = True
    return trials


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


def _check_trial_fits(ray_cfg, head: float) -> None:
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


def run_cell_in_driver(
    out: Path,
    algorithm: str,
    epsilon: float,
    n_trials: int,
    rounds: int,
    body,
    resume: bool,
) -> dict[str, str]:
    """Trials 0..n-1 of (algorithm, ε), one after another in this process; their
    statuses by trial id (``TERMINATED``, or ``ERROR`` after a retry, as Tune's
    ``FailureConfig(max_failures=1)``).

    Each trial is :func:`tuning.trial.trial_body`, the function a Tune trial runs, so
    its hyperparameters, seed, rows, checkpoints and compacted file are those of the
    same trial under Tune. Trial ids are ``<crc of the cell>_<k:05d>``, fixed, so a
    resumed experiment finds its trials: one whose file holds the last round's row is
    done; any other continues from its own checkpoint (none: from the start), and a
    checkpointed row that was never written is released from the checkpoint. A fresh
    start removes the cell's rows and its trials' checkpoints first."""
    import pyarrow.parquet as pq

    from tuning.trial import trial_checkpoint_path

    name = experiment_name(algorithm, epsilon)
    prefix = f"{zlib.crc32(name.encode()):08x}"[:5]
    ids = [f"{prefix}_{k:05d}" for k in range(n_trials)]
    if not resume:
        shutil.rmtree(rounds_dir(out, algorithm, epsilon), ignore_errors=True)
        for trial_id in ids:
            trial_checkpoint_path(out, trial_id).unlink(missing_ok=True)
    statuses: dict[str, str] = {}
    folder = rounds_dir(out, algorithm, epsilon)
    for k, trial_id in enumerate(ids):
        done = folder / f"{trial_id}.parquet"
        if (
            done.exists()
            and not any(folder.glob(f"{trial_id}-round*.parquet"))
            and max(pq.read_table(done, columns=["round"]).column("round").to_pylist()) >= rounds
        ):  # every round's row is in the trial's file
            statuses[trial_id] = "TERMINATED"
            continue
        for attempt in range(2):
            try:
                body({"sample": k}, trial_id, f"{name}-{trial_id}", lambda metrics: None)
                statuses[trial_id] = "TERMINATED"
                break
            except Exception as err:  # noqa: BLE001 - reported like a Tune trial error
                if isinstance(err, OSError) and err.errno in STOPPING_ERRNOS:
                    # a full disk or a read-only/forbidden folder stops the sweep (the
                    # CLI prints one line naming the file); --resume continues it
                    raise
                statuses[trial_id] = "ERROR"
                print(
                    f"{name}: trial {trial_id} failed (attempt {attempt + 1} of 2): "
                    f"{type(err).__name__}: {err}",
                    file=sys.stderr,
                    flush=True,
                )
    return statuses


def run_tune(
    config_path: str | None,
    algorithms: list[str],
    epsilons: list[float],
    *,
    num_samples: int = 4,
    search: str = "random",
    scheduler: str = "fifo",
    metric: str = "test_accuracy",
    out: str | Path,
    resume: bool = False,
    smoke_test: bool = False,
    overrides: list[str] | None = None,
    tuning_privacy: str = "compose",
    tnb_shape: float = 1.0,
    trial_executor_choice: str | None = None,
    runner: str | None = None,
) -> pd.DataFrame:
    """Run (or resume) the experiment; return the trials table (also written).

    ``tuning_privacy`` (:mod:`tuning.selection`): ``compose`` (default), or a
    Papernot-Steinke rule (``poisson``, ``truncated_negative_binomial`` with shape
    ``tnb_shape``) under which K is drawn here with mean ``num_samples`` and only the
    best trial of each (algorithm, ε) is released.

    ``runner`` (default: ``tune.runner`` of the YAML, else ``tune``): ``driver`` runs
    each cell's trials one after another in this process instead of through Ray Tune
    (:func:`run_cell_in_driver`): the same trials, rows, checkpoints and table, without
    Tune's start and finish (1.2-2.2 s) and the trial processes' imports (about 2 s on
    2 cores), for sweeps of trials so small that those dominate."""

    out = Path(out).resolve()
    tree, tune_section = read_tune_file(config_path)
    if smoke_test:  # shrink first; explicit --set overrides still win
        from engine.config import _set_path

        for key, value in SMOKE.items():
            _set_path(tree, key, value)
    config: RunConfig = load_config(base=tree, overrides=overrides)
    choice = trial_executor_choice or tune_section.get("trial_executor", "auto")
    config = replace(config, **{"ray.executor": trial_executor(choice, config.ray)})
    runner = runner or tune_section.get("runner", "tune")
    if runner not in RUNNERS:
        raise ConfigError(f"tune.runner={runner!r}: must be {', '.join(RUNNERS)}")
    if runner == "driver" and (search != "random" or scheduler != "fifo"):
        raise ConfigError(
            f"tune.runner=driver runs trials one after another without Ray Tune: it takes "
            f"--search random and --scheduler fifo (given --search {search}, --scheduler "
            f"{scheduler}); use --runner tune"
        )
    marker = out / "tune" / RUNNER_FILE
    if resume:  # one runner per experiment: the two name their trials differently
        before = read_runner(out, RUNNERS, marker) or runner
        if before != runner:
            raise ConfigError(
                f"--runner {runner}: the experiment in {str(out)!r} ran with --runner "
                f"{before}; resume it with --runner {before}"
            )
    if runner == "tune":
        from ray import tune
    if num_samples < 1:
        raise ConfigError(f"--num-samples={num_samples}: must be >= 1")
    if not epsilons or any(e <= 0 for e in epsilons):
        raise ConfigError(f"--epsilons={epsilons}: each must be > 0")
    spaces = {a: space_for(a, tune_section.get("space"), config.recipe) for a in algorithms}
    try:
        for a in algorithms:
            selection.check_mode(
                tuning_privacy,
                search=search,
                scheduler=scheduler,
                max_cohort=config.sampling.max_cohort,
                space_keys=list(spaces[a]),
                shape=tnb_shape,
            )
    except selection.TuningPrivacyError as e:
        raise ConfigError(str(e)) from None
    from engine.simulation import plan_privacy

    for a in algorithms:  # every budget must be reachable before any work starts
        for e in epsilons:
            plan_privacy(
                with_algorithm(
                    config, a, **{"privacy.epsilon": e, "privacy.noise_multiplier": None}
                )
            )
    record = experiment_record(
        config.to_dict(),
        {
            "algorithms": list(algorithms),
            "epsilons": [float(e) for e in epsilons],
            "num_samples": num_samples,
            "search": search,
            "scheduler": scheduler,
            "tuning_privacy": tuning_privacy,
            "tnb_shape": float(tnb_shape),
            "runner": runner,
            "space": tune_section.get("space"),
        },
    )
    if resume:  # every file the sweep continues from, before anything is written
        check_sweep_folder(
            out,
            rounds=config.rounds,
            record=record,
            papernot_steinke=selection.is_papernot_steinke(tuning_privacy),
            secure=bool(config.privacy.secure_noise),
        )
    head = float(tune_section.get("head_cpus", HEAD_CPUS))
    if runner == "tune" or config.ray.executor == "ray":
        ensure_ray(config.ray, extra_cpus=head)
    if runner == "tune":
        import ray

        gpus = float(ray.cluster_resources().get("GPU", 0.0))
        attached = bool(config.ray.address or os.environ.get("RAY_ADDRESS"))
        if gpus and not attached:
            import torch

            # A one-node Ray whose GPUs torch cannot use (declared ones, as in the tests'
            # fake GPU) would make every packed trial refuse its share at start: keep
            # trials on the CPU there. An attached cluster's workers may have CUDA where
            # the driver has none, so its GPUs are packed.
            gpus = gpus if torch.cuda.is_available() else 0.0
        config = pack_trials_per_gpu(
            config, tune_section.get("trials_per_gpu", TRIALS_PER_GPU), gpus
        )
    if runner == "tune" and not (config.ray.address or os.environ.get("RAY_ADDRESS")):
        _check_trial_fits(config.ray, head)  # a cluster may autoscale
    out.mkdir(parents=True, exist_ok=True)
    counts = trial_counts(
        out, algorithms, epsilons, config, num_samples, tuning_privacy, tnb_shape, resume
    )
    from tuning.watch import write_plan  # for dpfl report --watch (no drawn K in it)

    write_plan(
        out,
        [experiment_name(a, e) for a in algorithms for e in epsilons],
        num_samples,
        config.rounds,
        tuning_privacy,
    )
    bundles = trial_bundles(config.ray, head)
    every = int(tune_section.get("checkpoint_every", 1))
    statuses: dict[str, str] = {}
    columns: dict[str, str] = {}
    for a in algorithms:
        names = column_names(list(spaces[a]))
        for key, spec in spaces[a].items():
            is_text = spec["type"] == "choice" and any(isinstance(v, str) for v in spec["values"])
            columns[names[key]] = "string" if is_text else "float"

    marker.parent.mkdir(exist_ok=True)  # out/tune marks the experiment (dpfl tune --resume)
    marker.write_text(runner + "\n")
    write_json(out / "tune" / EXPERIMENT_FILE, record)  # what a --resume must match

    def new_tuner(trainable, space: dict, name: str):
        own = search == "random"
        return tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                num_samples=1 if own else num_samples,
                search_alg=_searcher(search),
                scheduler=_scheduler(scheduler, config.rounds),
                metric=metric,
                mode="max",
                # A trial's process (torch and dpfl imported, warm) serves the next
                # trial with the same resources: every trial builds its own state
                # (config, data, executor) inside the trainable, so nothing leaks.
                reuse_actors=True,
                trial_name_creator=lambda t, n=name: f"{n}-{t.trial_id}",
                trial_dirname_creator=lambda t, n=name: f"{n}-{t.trial_id}",
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=str(out / "tune"),
                failure_config=tune.FailureConfig(max_failures=1),
                verbose=0,
            ),
        )

    for a in algorithms:
        for e in epsilons:
            name = experiment_name(a, e)
            own_sampling = search == "random"
            n_trials = counts[name]
            if n_trials == 0:  # Poisson K = 0: nothing runs, nothing is released
                shutil.rmtree(rounds_dir(out, a, e), ignore_errors=True)
                print(f"{name}: no trial (the random number of trials was 0)", flush=True)
                continue
            if runner == "driver":
                t0 = time.perf_counter()
                body = trial_body(config.to_dict(), a, e, str(out), columns, spaces[a])
                statuses.update(
                    run_cell_in_driver(out, a, e, n_trials, config.rounds, body, resume)
                )
                compact_cell(out, a, e)
                dt = time.perf_counter() - t0
                print(f"{name}: {n_trials} trials in {dt:.1f} s (in this process)", flush=True)
                continue
            trainable = tune.with_resources(
                make_trainable(
                    config.to_dict(),
                    a,
                    e,
                    str(out),
                    every,
                    columns,
                    spaces[a] if own_sampling else None,
                ),
                tune.PlacementGroupFactory(bundles),
            )
            path = out / "tune" / name
            t0 = time.perf_counter()
            if resume and path.exists() and tune.Tuner.can_restore(str(path)):
                tuner = tune.Tuner.restore(
                    str(path), trainable, resume_unfinished=True, resume_errored=True
                )
            else:
                # A fresh start: rows left by an attempt that cannot be restored belong
                # to trials that will not continue; remove them (and those trials'
                # checkpoints) so none is half-done.
                from tuning.trial import trial_checkpoint_path

                for left in rounds_dir(out, a, e).glob("*.parquet"):
                    stale = trial_checkpoint_path(out, left.stem.rsplit("-round", 1)[0])
                    stale.unlink(missing_ok=True)
                shutil.rmtree(rounds_dir(out, a, e), ignore_errors=True)
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(out / "tune" / f"{name}-rest", ignore_errors=True)
                space = (
                    {"sample": tune.grid_search(list(range(n_trials)))}
                    if own_sampling
                    else to_tune(spaces[a])
                )
                tuner = new_tuner(trainable, space, name)
            grid = tuner.fit()
            results = list(grid)
            if own_sampling:
                # Tune can lose grid trials that were not yet in its experiment snapshot
                # when the driver was killed: run exactly the missing sample indices.
                seen = {int((r.config or {}).get("sample", -1)) for r in results}
                missing = [k for k in range(n_trials) if k not in seen]
                rest_path = out / "tune" / f"{name}-rest"
                if missing and resume and tune.Tuner.can_restore(str(rest_path)):
                    rest = tune.Tuner.restore(
                        str(rest_path), trainable, resume_unfinished=True, resume_errored=True
                    )
                    results += list(rest.fit())
                elif missing:
                    rest = new_tuner(
                        trainable, {"sample": tune.grid_search(missing)}, f"{name}-rest"
                    )
                    results += list(rest.fit())
            for result in results:
                tid = (result.metrics or {}).get("trial_id") or Path(result.path).name.rsplit(
                    "-", 1
                )[-1]
                statuses[tid] = "ERROR" if result.error else "TERMINATED"
            compact_cell(out, a, e)  # stopped or failed trials: one file each too
            print(f"{name}: {len(grid)} trials in {time.perf_counter() - t0:.1f} s", flush=True)
    trials = trials_table(out, statuses, metric)
    trials["epsilon_excludes_tuning"] = True
    trials = mark_released(trials, metric, tuning_privacy, num_samples, tnb_shape)
    tmp = out / ".trials.parquet.tmp"
    trials.to_parquet(tmp, index=False)
    os.replace(tmp, out / "trials.parquet")
    return trials
