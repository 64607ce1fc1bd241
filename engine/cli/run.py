"""``dpfl run``: plan (every input checked, the run prepared; nothing written and no Ray
started), then run that plan, one simulation per seed, or continue (``--resume``) a run
from its folder."""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cli.common import (
    check_out,
    check_private,
    check_resources,
    check_writable,
    claim_out,
    config_from_args,
    default_out,
    privacy_line,
    quiet_ray,
    shutdown_ray,
)
from engine.cli.parser import RAY_LOG, parse_seeds
from engine.config import ConfigError, RunConfig


@dataclass(frozen=True)
class RunPlan:
    """What ``dpfl run`` will do, decided and checked before anything is written or
    started: the config, the seeds (empty: the config's own seed), the results folder
    and whether its name is a default one, or the saved state of a run to continue;
    and the prepared run (:func:`engine.simulation.prepare`), which is what executes."""

    config: RunConfig
    out: Path
    seeds: list[int]
    default_out: bool = False
    overwrite: bool = False
    resume: dict | None = None  # engine.simulation.load_run's state (--resume)
    #: The first seed's run, prepared (validated, its data and pipeline built); the
    #: run executes it. Other seeds are prepared when they start (only the data's
    #: draw differs).
    prepared: Any = None
    #: --resume: engine.results.run_folder.check_run_folder's verdict ("continue", "complete",
    #: "start"); its rows are those of a finished run for "complete".
    resume_status: str | None = None
    released: Any = None


def plan_run(args: argparse.Namespace) -> RunPlan:
    """Check every input of ``dpfl run`` (flags, config, privacy keys, folder) and
    prepare the run (:func:`engine.simulation.prepare`: everything checked that needs
    no training, the data and the pipeline built). Creates no folder, writes nothing
    and starts no Ray: a refusal leaves nothing behind."""
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
        if folder.fallback is not None:  # the last checkpoint damaged, the previous intact
            print(f"dpfl: warning: --resume {args.resume}: {folder.fallback}", file=sys.stderr)
        config = folder.config
        if args.executor:
            config = replace(config, **{"ray.executor": args.executor})
        prepared = None
        if folder.status != "complete":
            check_writable(Path(args.resume), "--resume")
            if config.ray.executor == "ray":
                check_resources(config)
            from engine.simulation import prepare

            prepared = prepare(config)  # its data, model and Ray settings, checked again
        return RunPlan(
            config,
            Path(args.resume),
            [],
            resume=folder.state,
            prepared=prepared,
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
    else:
        check_writable(out, "--out (default)")
    first = replace(config, seed=seeds[0]) if seeds else config
    if config.ray.executor == "ray":
        check_resources(config)  # before the data is built or Ray started
    from engine.simulation import prepare  # torch, dp-accounting, pandas

    prepared = prepare(first)  # every check that needs no training; the run's plan
    return RunPlan(
        config,
        out,
        seeds,
        default_out=not requested,
        overwrite=args.overwrite,
        prepared=prepared,
    )


def execute_run(plan: RunPlan, args: argparse.Namespace) -> int:
    """Run a checked plan: claim the folder, then one simulation per seed (the first
    executes ``plan.prepared``). A run refused after the folder was claimed (a
    ConfigError: e.g. a cluster that went away) leaves no folder it created."""
    from engine.config import replace
    from engine.simulation import simulate

    config = plan.config
    uses_ray = config.ray.executor == "ray"
    if plan.resume_status == "complete":  # nothing to do, nothing rewritten
        _print_complete(plan)
        return 0
    if plan.resume_status is not None:  # "continue" from the checkpoint, or "start"
        with quiet_ray(plan.out, args.verbose, uses_ray, defer=True):
            result = simulate(
                config, progress=not args.quiet, resume=plan.resume, prepared=plan.prepared
            )
        _print_run(config, result)
        return 0
    existed, parent_existed = plan.out.exists(), plan.out.parent.exists()
    out = claim_out(plan.out, plan.overwrite, default=plan.default_out)
    try:
        with quiet_ray(out, args.verbose, uses_ray):
            _run_seeds(plan, args, out, simulate, replace)
    except ConfigError:
        if not existed or plan.default_out:
            _remove_if_only_started(out, parent_existed)
        raise
    return 0


def _run_seeds(plan: RunPlan, args: argparse.Namespace, out: Path, simulate, replace) -> None:
    """The run (or one run per seed) into the claimed folder ``out``; prints results."""
    config, seeds = plan.config, plan.seeds
    if not seeds:
        result = simulate(
            replace(config, out=str(out)), progress=not args.quiet, prepared=plan.prepared
        )
        _print_run(config, result)
        return
    owns_ray = False
    if config.ray.executor == "ray":  # one Ray for every seed
        from engine.runtime.executors import ensure_ray

        owns_ray = ensure_ray(config.ray)
    try:
        results = []
        for s in seeds:
            c = replace(config, seed=s, out=str(out / f"seed{s}"))
            first = s == seeds[0]
            results.append(
                simulate(c, progress=not args.quiet, prepared=plan.prepared if first else None)
            )
            print(f"seed {s}: final test_accuracy={results[-1].final_accuracy:.4f}")
    finally:
        if owns_ray:
            shutdown_ray()
    _print_seeds(config, seeds, results, out)


#: What a run writes before its first round ends (removed again if it is refused).
_STARTED_ONLY = {"config.json", RAY_LOG}


def _remove_if_only_started(out: Path, parent_existed: bool) -> None:
    """Remove the folder ``out`` this command created (and its parent, if it created
    that too and it is left empty), if it holds nothing but what a run writes before
    its first round (no checkpoint, no row): a refused run leaves nothing. A folder with
    any result is kept."""
    files = [p for p in out.rglob("*") if p.is_file()]
    if all(p.name in _STARTED_ONLY for p in files):
        shutil.rmtree(out, ignore_errors=True)
        if not parent_existed and out.parent.is_dir() and not any(out.parent.iterdir()):
            out.parent.rmdir()


def run_command(args: argparse.Namespace) -> int:
    """``dpfl run``: plan (validate and prepare, before Ray starts and before any file
    is written), then execute that plan."""
    return execute_run(plan_run(args), args)


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
