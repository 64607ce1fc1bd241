"""``dpfl compare``: several algorithms (or a paper preset's table) on one config,
at one or more privacy budgets, over seeds (:mod:`engine.simulation.compare`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.common import (
    check_out,
    check_private,
    check_resources,
    claim_out,
    config_from_args,
    default_out,
    non_private,
    quiet_ray,
)
from engine.cli.parser import parse_floats, parse_seeds
from engine.config import ConfigError, load_config


def compare_command(args: argparse.Namespace) -> int:
    """``dpfl compare``: check every input and every run's folder, then run the table."""
    from engine.config.presets import read_preset
    from engine.simulation import compare as cmp

    preset = read_preset(args.config) if args.config else None
    epsilons = parse_floats(args.epsilons, "--epsilons") if args.epsilons else None
    if preset is not None:  # a paper table (experiments/*.yaml): its rows, columns, scale
        config = load_config(None, args.set, base=preset.tree(args.scale))
        if args.executor:
            from engine.config import replace

            config = replace(config, **{"ray.executor": args.executor})
        variants = preset.variants
        names = cmp.parse_algorithms(args.algorithms or ",".join(preset.algorithms), variants)
        epsilons = epsilons or list(preset.scale_epsilons(args.scale))
    else:
        if args.scale != "paper":
            raise ConfigError(f"--scale={args.scale}: needs a preset --config (experiments/)")
        config = config_from_args(args)
        variants = {}
        names = cmp.parse_algorithms(args.algorithms or "all")
    recipes = list(dict.fromkeys(cmp.recipe_of(n, variants) for n in names))
    check_private(recipes, args, config.recipe.private)
    if epsilons and all(a in non_private(config.recipe.private) for a in recipes):
        raise ConfigError(f"--epsilons: {','.join(names)} are not private; nothing to budget")
    seeds = parse_seeds(args.seeds)
    out = Path(args.out) if args.out else default_out("compare")
    if args.resume:
        if args.overwrite:
            raise ConfigError("--resume continues the comparison, --overwrite replaces it")
        if not args.out:
            raise ConfigError("--resume: give the comparison to continue with --out DIR")
        if not out.is_dir():
            raise ConfigError(f"--out={str(out)!r}: no such folder to --resume")
    elif args.out:
        check_out(out, "--out", args.overwrite, "--resume")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    if config.ray.executor == "ray":
        check_resources(config)  # before any folder, data or Ray
    planned = cmp.plan(config, names, out, seeds, epsilons, variants)
    cmp.validate(planned)  # before any folder
    done = cmp.check_resume(planned, out) if args.resume else None  # every run's folder
    if not args.resume:
        out = claim_out(out, args.overwrite, default=not args.out)
    runs = cmp.plan(config, names, out, seeds, epsilons, variants)  # (a default name: suffix)
    with quiet_ray(out, args.verbose, config.ray.executor == "ray"):
        rows = cmp.run(runs, out, progress=not args.quiet, done=done)
    summary = cmp.summarize(rows)
    if preset is not None:
        print(f"{preset.paper}: {preset.table} ({args.scale} scale)\nclaim: {preset.claim}")
    print(cmp.format_paper_table(summary) if epsilons else cmp.format_table(summary))
    print(f"results: {out}")
    return 0
