"""``dpfl tune`` (a Ray Tune sweep, :mod:`tuning.experiment`) and ``dpfl report``
(the report of a finished sweep, or ``--watch`` to redraw its figures while it runs)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.cli.common import check_out, claim_out, default_out, quiet_ray, shutdown_ray
from engine.cli.parser import RAY_LOG, parse_floats
from engine.config import ConfigError


@dataclass(frozen=True)
class TunePlan:
    """What ``dpfl tune`` will do, checked before anything is written."""

    algorithms: list[str]
    epsilons: list[float]
    out: Path


def plan_tune(args: argparse.Namespace) -> TunePlan:
    """Check the flags of ``dpfl tune`` and the results folder; writes nothing.
    (The config and search spaces are checked by ``tuning.experiment.run_tune``
    before it starts Ray.)"""
    from engine.simulation.compare import parse_algorithms

    algorithms = parse_algorithms(args.algorithms)
    epsilons = parse_floats(args.epsilons, "--epsilons")
    if args.metric.endswith("_nonprivate") and not args.allow_nonprivate_metric:
        raise ConfigError(
            f"--metric={args.metric}: computed from clients' own data, so selecting (or ASHA "
            "stopping) trials on it is not covered by epsilon; pass "
            "--allow-nonprivate-metric to tune on it anyway, or use --metric test_accuracy"
        )
    if args.search in ("optuna", "hyperopt") and importlib.util.find_spec(args.search) is None:
        raise ConfigError(
            f"--search={args.search}: the {args.search} package is not installed "
            f"(pip install {args.search}), or use --search random"
        )
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the experiment, --overwrite replaces it: give one")
    if args.resume and not args.out:
        raise ConfigError("--resume: give the experiment to continue with --out DIR")
    out = Path(args.out) if args.out else default_out("tune")
    if args.resume:
        if not (out / "tune").is_dir():
            raise ConfigError(f"--out={str(out)!r}: no dpfl tune experiment there to --resume")
    elif args.out:
        check_out(out, "--out", args.overwrite, "--resume")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    return TunePlan(algorithms, epsilons, out)


def tune_command(args: argparse.Namespace) -> int:
    """``dpfl tune``: plan, claim the folder, run the sweep, print its trials."""
    plan = plan_tune(args)
    algorithms, epsilons, out = plan.algorithms, plan.epsilons, plan.out
    # --overwrite: the old folder is set aside, and restored if the new experiment
    # fails its checks before creating anything.
    aside = None
    if args.overwrite and out.exists():
        aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(aside)
    # A default name is claimed exclusively (as run and compare do); if the experiment
    # then fails before writing anything but Ray's log, the claimed folder is removed.
    claimed, parent_existed = None, out.parent.exists()
    if not args.out:
        out = claimed = claim_out(out, overwrite=False, default=True)
    import ray

    from tuning.experiment import run_tune

    owns_ray = not ray.is_initialized()  # a caller's Ray (a notebook, a test) stays up
    try:
        with quiet_ray(out, args.verbose, defer=args.resume):
            try:
                trials = run_tune(
                    args.config,
                    algorithms,
                    epsilons,
                    num_samples=args.num_samples,
                    search=args.search,
                    scheduler=args.scheduler,
                    metric=args.metric,
                    out=out,
                    resume=args.resume,
                    smoke_test=args.smoke_test,
                    overrides=args.set,
                    tuning_privacy=args.tuning_privacy,
                    tnb_shape=args.tnb_shape,
                    runner=args.runner,
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
