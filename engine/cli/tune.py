"""``dpfl tune`` (a Ray Tune sweep, :mod:`tuning.experiment`), ``dpfl report`` (the
report of a finished sweep, or ``--watch`` to redraw its figures while it runs) and
``dpfl leaderboard`` (methods × total ε, :mod:`tuning.leaderboard`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.base.errors import RunFailed
from engine.cli.common import check_out, claim_out, default_out, quiet_ray, shutdown_ray
from engine.cli.parser import RAY_LOG, parse_floats
from engine.config import ConfigError

#: What a flag means when it is not given and no resumed folder recorded it.
DEFAULTS: dict[str, Any] = {
    "algorithms": "dp_fedavg",
    "epsilons": "4",
    "num_samples": 4,
    "search": "random",
    "scheduler": "fifo",
    "tuning_privacy": "compose",
    "tnb_shape": 1.0,
    "metric": "test_accuracy",
}


@dataclass(frozen=True)
class TunePlan:
    """What ``dpfl tune`` will do, checked before anything is written: each setting from
    its flag, else (``--resume``) from the folder's ``tune/experiment.json``, else its
    default. ``base_tree``: the folder's resolved config (a ``--resume`` without
    ``--config``/``--set``), or None."""

    algorithms: list[str]
    epsilons: list[float]
    out: Path
    total: bool = False
    num_samples: int = 4
    search: str = "random"
    scheduler: str = "fifo"
    tuning_privacy: str = "compose"
    tnb_shape: float = 1.0
    metric: str = "test_accuracy"
    runner: str | None = None
    base_tree: dict | None = None


def _budgets(args: argparse.Namespace, settings: dict) -> tuple[list[float], bool]:
    """(budgets, whether they are totals): ``--epsilons`` (per trial) or
    ``--total-epsilon`` (total), else the resumed sweep's, else the YAML's
    ``tune.total_epsilon``, else per-trial 4."""
    if args.epsilons is not None and args.total_epsilon is not None:
        raise ConfigError(
            "--epsilons (each trial's budget) and --total-epsilon (the budget of the released "
            "trial including the search): give one"
        )
    if args.total_epsilon is not None:
        return parse_floats(args.total_epsilon, "--total-epsilon"), True
    if args.epsilons is not None:
        if settings.get("budget") == "total":
            raise ConfigError(
                "--epsilons: the sweep was started with --total-epsilon "
                f"{','.join(f'{e:g}' for e in settings['epsilons'])}; resume it with those"
            )
        return parse_floats(args.epsilons, "--epsilons"), False
    if settings:
        return [float(e) for e in settings["epsilons"]], settings.get("budget") == "total"
    from tuning.plan import read_tune_file

    total = read_tune_file(args.config)[1].get("total_epsilon")
    if total is not None:
        values = total if isinstance(total, list) else [total]
        try:
            return [float(v) for v in values], True
        except (TypeError, ValueError):
            raise ConfigError(f"tune.total_epsilon={total!r}: expected numbers") from None
    return parse_floats(str(DEFAULTS["epsilons"]), "--epsilons"), False


def plan_tune(args: argparse.Namespace) -> TunePlan:
    """Check the flags of ``dpfl tune`` and the results folder; writes nothing.
    (The config and search spaces are checked by ``tuning.experiment.run_tune``
    before it starts Ray.) ``--resume DIR`` (or ``--resume --out DIR``) takes every
    setting it is not given from the folder; one given again must agree (checked, naming
    it, by :func:`tuning.sweep_folder.check_experiment_record`)."""
    from engine.simulation.compare import parse_algorithms
    from tuning.sweep_folder import read_experiment_record

    resume = args.resume is not False
    if resume and args.overwrite:
        raise ConfigError("--resume continues the experiment, --overwrite replaces it: give one")
    folder = args.resume if isinstance(args.resume, str) else args.out
    if isinstance(args.resume, str) and args.out and Path(args.out) != Path(args.resume):
        raise ConfigError(
            f"--resume {args.resume} and --out {args.out} name different folders: give one"
        )
    if resume and not folder:
        raise ConfigError(
            "--resume: give the experiment to continue, --resume DIR (or --resume --out DIR)"
        )
    out = Path(folder) if folder else default_out("tune")
    record = None
    if resume:
        if not (out / "tune").is_dir():
            raise ConfigError(f"--resume {str(out)!r}: no dpfl tune experiment there")
        record = read_experiment_record(out)
    elif args.out:
        check_out(out, "--out", args.overwrite, "--resume")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    settings = dict(record["settings"]) if record else {}

    def pick(attr: str, key: str | None = None):
        value = getattr(args, attr)
        if value is not None:
            return value
        saved = settings.get(key or attr)
        return saved if saved is not None else DEFAULTS.get(attr)

    if args.algorithms is None and settings:
        algorithms = parse_algorithms(",".join(settings["algorithms"]))
    else:
        algorithms = parse_algorithms(args.algorithms or str(DEFAULTS["algorithms"]))
    epsilons, total = _budgets(args, settings)
    metric = pick("metric")
    if metric.endswith("_nonprivate") and not args.allow_nonprivate_metric:
        raise ConfigError(
            f"--metric={metric}: computed from clients' own data, so selecting (or ASHA "
            "stopping) trials on it is not covered by epsilon; pass "
            "--allow-nonprivate-metric to tune on it anyway, or use --metric test_accuracy"
        )
    search = pick("search")
    if search in ("optuna", "hyperopt") and importlib.util.find_spec(search) is None:
        raise ConfigError(
            f"--search={search}: the {search} package is not installed "
            f"(pip install {search}), or use --search random"
        )
    base_tree = None
    if record and args.config is None and not args.set:  # the folder's own config
        base_tree = dict(record["config"])
        section = dict(settings.get("tune") or {})
        if settings.get("space") is not None:
            section["space"] = settings["space"]
        base_tree["tune"] = section
    return TunePlan(
        algorithms,
        epsilons,
        out,
        total,
        int(pick("num_samples")),
        search,
        pick("scheduler"),
        pick("tuning_privacy"),
        float(pick("tnb_shape")),
        metric,
        pick("runner"),
        base_tree,
    )


def tune_command(args: argparse.Namespace) -> int:
    """``dpfl tune``: plan, claim the folder, run the sweep, print its trials."""
    plan = plan_tune(args)
    out = plan.out
    # --overwrite: the old folder is set aside, and restored if the new experiment
    # fails its checks before creating anything.
    aside = None
    if args.overwrite and out.exists():
        aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(aside)
    # A default name is claimed exclusively (as run and compare do); if the experiment
    # then fails before writing anything but Ray's log, the claimed folder is removed.
    claimed, parent_existed = None, out.parent.exists()
    if not args.out and args.resume is False:
        out = claimed = claim_out(out, overwrite=False, default=True)
    import ray

    from tuning.experiment import run_tune

    owns_ray = not ray.is_initialized()  # a caller's Ray (a notebook, a test) stays up
    try:
        with quiet_ray(out, args.verbose, defer=args.resume is not False):
            try:
                trials = run_tune(
                    args.config,
                    plan.algorithms,
                    plan.epsilons,
                    num_samples=plan.num_samples,
                    search=plan.search,
                    scheduler=plan.scheduler,
                    metric=plan.metric,
                    out=out,
                    resume=args.resume is not False,
                    smoke_test=args.smoke_test,
                    overrides=args.set,
                    tuning_privacy=plan.tuning_privacy,
                    tnb_shape=plan.tnb_shape,
                    runner=plan.runner,
                    total=plan.total,
                    base_tree=plan.base_tree,
                )
            finally:
                if owns_ray:
                    shutdown_ray()
    except BaseException:
        if claimed is not None and {p.name for p in claimed.iterdir()} <= {RAY_LOG}:
            shutil.rmtree(claimed, ignore_errors=True)
            if not parent_existed and not any(claimed.parent.iterdir()):
                claimed.parent.rmdir()
        if aside is not None and not out.exists():
            aside.rename(out)
            aside = None
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    cols = [c for c in trials.columns if c.startswith(("final_", "best_"))]
    print(trials[["algorithm", "epsilon_budget", "trial_id", "status", *cols]].to_string())
    print(
        f"results: {out} (each trial's epsilon excludes hyperparameter selection; "
        f"dpfl report {out} gives the cost of releasing the best trial)"
    )
    from tuning.experiment import failed_trials_line

    failed = failed_trials_line(trials, out)
    if failed is not None:  # a sweep with failed trials exits non-zero (status 1)
        raise RunFailed(failed)
    return 0


def report_command(args: argparse.Namespace) -> int:
    """``dpfl report DIR``: the report of a finished sweep (``--watch``: live figures)."""
    import pandas as pd

    directory = Path(args.dir)
    if not directory.is_dir():
        raise ConfigError(f"DIR={args.dir!r}: no such folder")
    if args.watch:
        return _watch(directory, args)
    if not (directory / "trials.parquet").is_file() or not (directory / "rounds").is_dir():
        what = (
            " (a dpfl compare folder: its table is compare.parquet)"
            if (directory / "compare.parquet").is_file()
            else ""
        )
        raise ConfigError(
            f"DIR={args.dir!r}: no trials.parquet and rounds/ there{what}; "
            "dpfl report reads the folder of a finished dpfl tune"
        )
    import pyarrow as pa

    try:
        columns = pd.read_parquet(directory / "trials.parquet").columns
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(
            f"DIR={args.dir!r}: {directory / 'trials.parquet'} is damaged "
            f"({type(e).__name__}); dpfl tune --resume --out {args.dir} with the sweep's "
            "flags rebuilds it from the trials' rows"
        ) from None
    have = sorted(c[len("final_") :] for c in columns if c.startswith("final_"))
    if f"final_{args.metric}" not in columns:
        raise ConfigError(
            f"--metric={args.metric!r}: the trials in {args.dir} were tuned for "
            f"{', '.join(have) or 'no metric'}"
        )
    from tuning.report import write_report

    print(write_report(directory, metric=args.metric))
    return 0


def _watch(directory: Path, args: argparse.Namespace) -> int:
    """``dpfl report --watch DIR`` (:mod:`tuning.watch`)."""
    if not (directory / "tune").is_dir() and not (directory / "rounds").is_dir():
        raise ConfigError(f"DIR={str(directory)!r}: not a dpfl tune folder (no tune/ or rounds/)")
    if not args.interval > 0:
        raise ConfigError(f"--interval={args.interval}: must be > 0")
    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations={args.iterations}: must be >= 1")
    from tuning.watch import LIVE_EPSILON_PNG, LIVE_ROUND_PNG, watch

    print(f"watching {directory}: {LIVE_EPSILON_PNG}, {LIVE_ROUND_PNG} redrawn there", flush=True)
    watch(directory, args.interval, args.iterations, echo=lambda s: print(s, flush=True))
    return 0


def leaderboard_command(args: argparse.Namespace) -> int:
    """``dpfl leaderboard``: settings from the YAML's ``leaderboard:`` section and the
    flags (``--resume DIR`` alone: the folder's), then :func:`run_leaderboard`."""
    from engine.config import config_from_dict, load_config, read_yaml_mapping
    from tuning.leaderboard.command import read_started, run_leaderboard
    from tuning.leaderboard.settings import settings_from

    resume = args.resume is not False
    folder = args.resume if isinstance(args.resume, str) else args.out
    if isinstance(args.resume, str) and args.out and Path(args.out) != Path(args.resume):
        raise ConfigError(
            f"--resume {args.resume} and --out {args.out} name different folders: give one"
        )
    if resume and not folder:
        raise ConfigError("--resume: give the leaderboard to continue, --resume DIR")
    out = Path(folder) if folder else default_out("leaderboard")
    flags = {
        "methods": args.methods,
        "baseline": args.baseline,
        "total_epsilons": args.total_epsilon,
        "trials": args.trials,
        "seeds": args.seeds,
        "tuning_privacy": args.tuning_privacy,
    }
    if resume and args.config is None and not args.set:  # the folder's own settings
        tree, section = read_started(out)
        config = config_from_dict(tree)
    else:
        tree = read_yaml_mapping(args.config) if args.config else {}
        section = tree.pop("leaderboard", {}) or {}
        config = load_config(base=tree, overrides=args.set)
    settings = settings_from(section, flags)
    echo = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    with quiet_ray(out, args.verbose, config.ray.executor == "ray", defer=True):
        run_leaderboard(settings, config, out.resolve(), resume, echo, args.processes)
    print(f"results: {out / 'leaderboard.md'} (dpfl leaderboard --resume {out} continues it)")
    return 0
