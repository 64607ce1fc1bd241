"""``dpfl run``: plan (every input checked, nothing written), then run one simulation
per seed, or continue (``--resume``) a run from its folder."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cli.common import (
    check_out,
    check_private,
    check_resources,
    claim_out,
    config_from_args,
    default_out,
    privacy_line,
    quiet_ray,
    shutdown_ray,
)
from engine.cli.parser import parse_seeds
from engine.config import ConfigError, RunConfig


@dataclass(frozen=True)
class RunPlan:
    """What ``dpfl run`` will do, decided and checked before anything is written:
    the config, the seeds (empty: the config's own seed), the results folder and
    whether its name is a default one, or the saved state of a run to continue."""

    config: RunConfig
    out: Path
    seeds: list[int]
    default_out: bool = False
    overwrite: bool = False
    resume: dict | None = None  # engine.simulation.load_run's state (--resume)
    dataset: Any = None  # the first seed's data, built while checking (reused)
    #: --resume: engine.results.run_folder.check_run_folder's verdict ("continue", "complete",
    #: "start"); its rows are those of a finished run for "complete".
    resume_status: str | None = None
    released: Any = None


def plan_run(
    args: argparse.Namespace, before_prepare: Callable[[RunConfig, Path], None] | None = None
) -> RunPlan:
    """Check every input of ``dpfl run`` (flags, config, privacy keys, folder, and
    everything ``simulate.prepare`` checks without training) and say what will run.
    Creates no folder and starts nothing itself; ``before_prepare(config, out)`` is
    called once the cheap checks have passed and before the engine is imported and the
    data built (:func:`run_command` begins Ray's start there)."""
    from engine.config import replace

    if args.resume:
        from engine.results.run_folder import check_run_folder

        for flag, value in (
            ("--config/--set", args.config or args.set),
            ("--out", args.out),
            ("--seeds", args.seeds),
            ("--overwrite", args.overwrite),
        ):
            if value:
                raise ConfigError(
                    f"--resume {args.resume}: continues a run with its saved config and "
                    f"folder; drop {flag}"
                )
        # config.json, the checkpoint and every released row, before a byte is written
        folder = check_run_folder(args.resume)
        config = folder.config
        if args.executor:
            config = replace(config, **{"ray.executor": args.executor})
        if folder.status != "complete" and config.ray.executor == "ray":
            check_resources(config)
        if folder.status != "complete" and before_prepare is not None:
            before_prepare(config, Path(args.resume))
        return RunPlan(
            config,
            Path(args.resume),
            [],
            resume=folder.state,
            resume_status=folder.status,
            released=folder.rows,
        )

    config = config_from_args(args)
    check_private([config.algorithm], args, config.recipe.private)
    seeds = parse_seeds(args.seeds) or []
    requested = args.out or config.out
    out = Path(requested) if requested else default_out(config.algorithm)
    if requested:
        check_out(out, "--out" if args.out else "out", args.overwrite, f"--resume {out}")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    first = replace(config, seed=seeds[0]) if seeds else config
    if config.ray.executor == "ray":
        check_resources(config)  # before the data is built or Ray started
    if before_prepare is not None:
        before_prepare(config, out)
    from engine.simulation import prepare  # torch, dp-accounting, pandas: after Ray's start began

    prep = prepare(first)  # every check that needs no training, before any folder exists
    return RunPlan(
        config,
        out,
        seeds,
        default_out=not requested,
        overwrite=args.overwrite,
        dataset=prep.dataset,
    )


def execute_run(plan: RunPlan, args: argparse.Namespace, quiet_ray_entered: bool = False) -> int:
    """Run a checked plan: claim the folder, then one simulation per seed.
    ``quiet_ray_entered``: the caller already sends Ray's console output to the log."""
    from engine.config import replace
    from engine.simulation import simulate

    config = plan.config
    uses_ray = config.ray.executor == "ray"
    redirect = uses_ray and not quiet_ray_entered  # Ray's console output to ray.log here
    if plan.resume_status == "complete":  # nothing to do, nothing rewritten
        _print_complete(plan)
        return 0
    if plan.resume_status is not None:  # "continue" from the checkpoint, or "start"
        with quiet_ray(plan.out, args.verbose, redirect):
            result = simulate(config, progress=not args.quiet, resume=plan.resume)
        _print_run(config, result)
        return 0
    out = claim_out(plan.out, plan.overwrite, default=plan.default_out)
    seeds = plan.seeds
    with quiet_ray(out, args.verbose, redirect):
        if not seeds:
            result = simulate(
                replace(config, out=str(out)), progress=not args.quiet, dataset=plan.dataset
            )
            _print_run(config, result)
            return 0
        owns_ray = False
        if uses_ray:  # one Ray for every seed
            from engine.runtime.executors import ensure_ray

            owns_ray = ensure_ray(config.ray)
        try:
            results = []
            for s in seeds:
                c = replace(config, seed=s, out=str(out / f"seed{s}"))
                results.append(
                    simulate(
                        c, progress=not args.quiet, dataset=plan.dataset if s == seeds[0] else None
                    )
                )
                print(f"seed {s}: final test_accuracy={results[-1].final_accuracy:.4f}")
        finally:
            if owns_ray:
                shutdown_ray()
    _print_seeds(config, seeds, results, out)
    return 0


def run_command(args: argparse.Namespace) -> int:
    """``dpfl run``: plan, then execute.

    With the Ray executor, Ray's start begins in a background thread as soon as the
    cheap checks pass (:func:`engine.runtime.ray_start.start_ray_early`), so that it
    overlaps importing the engine, calibrating σ and building the data; the run's
    first :func:`~engine.runtime.ray_start.ensure_ray` then waits for it. Ray's console
    output goes to the run's ``ray.log`` from that moment on (as :func:`quiet_ray`
    does for the run), and a plan refused after the start shuts that Ray down."""
    with contextlib.ExitStack() as stack:
        entered = False

        def begin_ray(config: RunConfig, out: Path) -> None:
            nonlocal entered
            if config.ray.executor != "ray":
                return
            from engine.runtime.ray_start import abandon_early_ray, start_ray_early

            stack.enter_context(quiet_ray(out, args.verbose, True, defer=True))
            entered = True
            stack.callback(abandon_early_ray)  # runs first: before the log is closed
            start_ray_early(config.ray)

        plan = plan_run(args, before_prepare=begin_ray)
        return execute_run(plan, args, quiet_ray_entered=entered)


def _print_complete(plan: RunPlan) -> None:
    """A finished run given to --resume: its result as on disk; nothing is written."""
    rows = plan.released
    acc = rows["test_accuracy"].dropna() if "test_accuracy" in rows else rows.iloc[:0]
    final = f"{float(acc.iloc[-1]):.4f}" if len(acc) else "nan"
    eps = float(rows["epsilon"].iloc[-1]) if "epsilon" in rows and len(rows) else math.nan
    print(
        f"{plan.out}: already complete ({plan.config.rounds} of {plan.config.rounds} rounds, "
        f"final test_accuracy={final}, epsilon={eps:.4g}); nothing was changed"
    )


def _print_run(config: RunConfig, result: Any) -> None:
    """One run's result (an ``engine.simulation`` result) and its folder."""
    print(
        f"{config.algorithm} on {config.dataset.name}/{config.model.name}: "
        f"{config.rounds} rounds, final test_accuracy={result.final_accuracy:.4f}; "
        f"{privacy_line(result.privacy)}"
    )
    print(f"results: {result.out_dir}")


def _print_seeds(config: RunConfig, seeds: list[int], results: list, out: Path) -> None:
    """Several seeds' results: mean ± sample std, and their folders."""
    import numpy as np

    acc = np.array([r.final_accuracy for r in results], dtype=float)
    std = float(acc.std(ddof=1)) if len(acc) > 1 else float("nan")
    print(
        f"{config.algorithm} on {config.dataset.name}/{config.model.name}: "
        f"{config.rounds} rounds, final test_accuracy={acc.mean():.4f} ± {std:.2g} "
        f"(mean ± sample std over {len(seeds)} seeds); {privacy_line(results[0].privacy)}"
    )
    print(f"results: {out} (one folder per seed: {', '.join(f'seed{s}' for s in seeds)})")
