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

import os
import shutil
import time
from pathlib import Path

import pandas as pd

from engine.config import ConfigError, RunConfig, load_config, replace, with_algorithm
from engine.results import write_json
from engine.runtime.executors import ensure_ray
from tuning import selection
from tuning.budget import GRID_KEYS
from tuning.budget_plan import noise_of, plan_budgets, write_budgets
from tuning.driver import run_cell_in_driver
from tuning.plan import (
    HEAD_CPUS,
    RUNNER_FILE,
    RUNNERS,
    SMOKE,
    TRIALS_PER_GPU,
    check_trial_fits,
    choose_runner,
    experiment_name,
    make_scheduler,
    make_searcher,
    pack_trials_per_gpu,
    read_tune_file,
    trial_bundles,
    trial_counts,
    trial_executor,
)
from tuning.rounds import column_names, compact_cell, rounds_dir
from tuning.spaces import space_for, to_tune
from tuning.sweep_folder import (
    EXPERIMENT_FILE,
    check_experiment_record,
    check_sweep_folder,
    experiment_record,
    read_runner,
)
from tuning.trial import make_trainable, trial_body
from tuning.trial_pool import Cell, default_processes, run_cells_in_processes
from tuning.trials_table import mark_released, trials_table, write_trials


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
    total: bool = False,
    base_tree: dict | None = None,
) -> pd.DataFrame:
    """Run (or resume) the experiment; return the trials table (also written).

    ``tuning_privacy`` (:mod:`tuning.selection`): ``compose`` (default), or a
    Papernot-Steinke rule (``poisson``, ``truncated_negative_binomial`` with shape
    ``tnb_shape``) under which K is drawn here with mean ``num_samples`` and only the
    best trial of each (algorithm, ε) is released.

    ``runner`` (default: ``tune.runner`` of the YAML, else ``auto``,
    :func:`tuning.plan.choose_runner`; a resume keeps the runner it started with):
    ``processes`` runs the trials in parallel in a pool of local processes started
    once (:mod:`tuning.trial_pool`), ``driver`` one after another in this process
    (:func:`run_cell_in_driver`), ``tune`` through Ray Tune: the same trials, rows,
    checkpoints and table under all three; the first two skip Tune's start and finish
    (1.2-2.2 s) and every trial's process start, imports and data set.

    ``total`` (``--total-epsilon``): each of ``epsilons`` is a total budget E, the ε of
    publishing the selected trial *including* the search; the trials' noise is solved
    from it before any trial runs (:mod:`tuning.budget_plan`). ``base_tree``: a
    resolved config tree and its ``tune`` section (``--resume DIR``: the folder's own)
    in place of ``config_path``."""

    out = Path(out).resolve()
    if base_tree is not None:
        import copy

        tree = copy.deepcopy(base_tree)
        tune_section = tree.pop("tune", {}) or {}
    else:
        tree, tune_section = read_tune_file(config_path)
    if smoke_test:  # shrink first; explicit --set overrides still win
        from engine.config import set_path

        for key, value in SMOKE.items():
            set_path(tree, key, value)
    config: RunConfig = load_config(base=tree, overrides=overrides)
    choice = trial_executor_choice or tune_section.get("trial_executor", "auto")
    runner = runner or tune_section.get("runner", "auto")
    if runner not in (*RUNNERS, "auto"):
        raise ConfigError(f"tune.runner={runner!r}: must be auto, {', '.join(RUNNERS)}")
    marker = out / "tune" / RUNNER_FILE
    if runner == "auto" and resume:  # a resume continues with the runner it started with
        runner = read_runner(out, RUNNERS, marker) or runner
    if runner == "auto":
        gpus = False
        if choice != "ray" and not config.ray.address and search == "random":
            import torch

            gpus = torch.cuda.is_available()
        runner = choose_runner(runner, search, scheduler, choice, config.ray, gpus)
    if runner == "processes":
        if choice not in ("auto", "local"):
            raise ConfigError(
                f"tune.trial_executor={choice}: tune.runner=processes runs each trial in "
                "one process of its pool (ray.executor=local); use --runner tune or driver"
            )
        choice = "local"
    config = replace(config, **{"ray.executor": trial_executor(choice, config.ray)})
    if runner in ("driver", "processes") and (search != "random" or scheduler != "fifo"):
        raise ConfigError(
            f"tune.runner={runner} runs trials without Ray Tune: it takes "
            f"--search random and --scheduler fifo (given --search {search}, --scheduler "
            f"{scheduler}); use --runner tune"
        )
    if resume:  # one runner per experiment: they name their trials differently
        before = read_runner(out, RUNNERS, marker) or runner
        if before != runner:
            raise ConfigError(
                f"--runner {runner}: the experiment in {str(out)!r} ran with --runner "
                f"{before}; resume it with --runner {before}"
            )
    if num_samples < 1:
        raise ConfigError(f"--num-samples={num_samples}: must be >= 1")
    if not epsilons or any(e <= 0 for e in epsilons):
        raise ConfigError(f"--epsilons={epsilons}: each must be > 0")
    spaces = {a: space_for(a, tune_section.get("space"), config.recipe) for a in algorithms}
    for a in algorithms:  # nothing to search: every trial would be the same run
        if not spaces[a] and (num_samples > 1 or tuning_privacy != "compose"):
            raise ConfigError(
                f"tune.space: the search space of {a} is empty (every key null), so its "
                f"trials would repeat one run, each accounted as a cost of tuning; search "
                "at least one key, or run the one configuration (--num-samples 1)"
            )
    try:
        for a in algorithms:
            selection.check_mode(
                tuning_privacy,
                search=search,
                scheduler=scheduler,
                max_cohort=config.sampling.max_cohort,
                space_keys=list(spaces[a]),
                shape=tnb_shape,
                covered=GRID_KEYS if total else (),
            )
    except selection.TuningPrivacyError as e:
        raise ConfigError(str(e)) from None
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
            "metric": metric,
            "budget": "total" if total else "per_trial",
            "tune": {k: v for k, v in tune_section.items() if k != "space"},
        },
    )
    if resume:  # the settings first: a flag that differs is named before any solve
        check_experiment_record(out, record)
    from engine.simulation import plan_privacy

    budget_records: dict = {}
    if total:  # solved (or, resumed, read back) before any work starts
        if search != "random":
            raise ConfigError(
                f"--total-epsilon needs --search random (the trials' draws must be known "
                f"before they run; {search} is adaptive)"
            )
        budget_records = plan_budgets(
            out,
            config,
            algorithms,
            epsilons,
            spaces,
            tuning_privacy,
            num_samples,
            tnb_shape,
            resume,
        )
    else:
        for a in algorithms:  # every budget must be reachable before any work starts
            for e in epsilons:
                plan_privacy(
                    with_algorithm(
                        config, a, **{"privacy.epsilon": e, "privacy.noise_multiplier": None}
                    )
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
    if runner == "tune":  # once every check has passed (a refusal need not wait for it)
        from ray import tune
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
        check_trial_fits(config.ray, head)  # a cluster may autoscale
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

    def noise_for(name: str) -> list | None:
        return noise_of(budget_records[name]) if total else None

    every = int(tune_section.get("checkpoint_every", 1))
    statuses: dict[str, str] = {}
    errors: dict[str, str] = {}  # a failed trial's error, for the failure line
    columns: dict[str, str] = {}
    for a in algorithms:
        names = column_names(list(spaces[a]))
        for key, spec in spaces[a].items():
            is_text = spec["type"] == "choice" and any(isinstance(v, str) for v in spec["values"])
            columns[names[key]] = "string" if is_text else "float"

    marker.parent.mkdir(exist_ok=True)  # out/tune marks the experiment (dpfl tune --resume)
    marker.write_text(runner + "\n")
    write_json(out / "tune" / EXPERIMENT_FILE, record)  # what a --resume must match
    if total:
        write_budgets(out, budget_records)

    def new_tuner(trainable, space: dict, name: str):
        own = search == "random"
        return tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                num_samples=1 if own else num_samples,
                search_alg=make_searcher(search),
                scheduler=make_scheduler(scheduler, config.rounds),
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

    if runner == "processes":
        cells = [
            Cell(
                a,
                e,
                counts[experiment_name(a, e)],
                config.to_dict(),
                columns,
                spaces[a],
                noise_for(experiment_name(a, e)),
            )
            for a in algorithms
            for e in epsilons
        ]
        for cell in cells:
            if cell.n_trials == 0:  # Poisson K = 0: nothing runs, nothing is released
                shutil.rmtree(rounds_dir(out, cell.algorithm, cell.epsilon), ignore_errors=True)
                name = experiment_name(cell.algorithm, cell.epsilon)
                print(f"{name}: no trial (the random number of trials was 0)", flush=True)
        cells = [c for c in cells if c.n_trials > 0]
        procs = tune_section.get("trial_processes") or default_processes(
            config.ray.num_cpus_per_worker, sum(c.n_trials for c in cells)
        )
        statuses.update(
            run_cells_in_processes(out, cells, config.rounds, resume, procs, errors=errors)
        )
    for a in algorithms if runner != "processes" else []:
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
                body = trial_body(
                    config.to_dict(), a, e, str(out), columns, spaces[a], noise_for(name)
                )
                statuses.update(
                    run_cell_in_driver(out, a, e, n_trials, config.rounds, body, resume, errors)
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
                    noise_for(name),
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
                if result.error:
                    errors[tid] = _trial_error(result.error)
            compact_cell(out, a, e)  # stopped or failed trials: one file each too
            print(f"{name}: {len(grid)} trials in {time.perf_counter() - t0:.1f} s", flush=True)
    trials = trials_table(out, statuses, metric)
    trials["epsilon_excludes_tuning"] = True
    if total and not trials.empty:  # the cell's budget is a total: its per-trial ε beside it
        per_trial = {
            (a, float(e)): budget_records[experiment_name(a, e)]["per_trial_epsilon"]
            for a in algorithms
            for e in epsilons
        }
        trials["epsilon_total_budget"] = trials["epsilon_budget"]
        trials["epsilon_per_trial"] = [
            per_trial.get((a, float(e)), float("nan"))
            for a, e in zip(trials["algorithm"], trials["epsilon_budget"], strict=True)
        ]
    trials = mark_released(trials, metric, tuning_privacy, num_samples, tnb_shape)
    write_trials(out, trials)
    # Every trial that failed, with its error (one may have no row in the table):
    # dpfl tune exits non-zero on them (failed_trials_line).
    trials.attrs["failed"] = {
        t: errors.get(t, "no error reported") for t, s in statuses.items() if s == "ERROR"
    }
    return trials


def _trial_error(err: BaseException) -> str:
    """``Type: message`` of a trial's error, the original one inside Ray's wrapper
    (``RayTaskError.cause``), without terminal colours."""
    import re

    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


def failed_trials_line(trials: pd.DataFrame, out: str | Path) -> str | None:
    """One line naming the failed trials of a sweep (``run_tune``'s table) and why, and
    how to continue it; None when every trial finished."""
    failed: dict[str, str] = trials.attrs.get("failed", {})
    if not failed:
        return None
    shown = "; ".join(
        f"{t}: {' '.join(why.split())[:200]}" for t, why in sorted(failed.items())[:3]
    )
    more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
    return (
        f"{len(failed)} trial(s) failed ({shown}{more}); the other trials are in "
        f"{out}/trials.parquet; continue the sweep with dpfl tune --resume --out {out} "
        "and the same flags"
    )
