"""``dpfl compare``: several algorithms (or a paper preset's table) on one config,
at one or more privacy budgets, over seeds (:mod:`engine.simulation.compare`).

A comparison records what it started with in ``DIR/compare.json`` (the rows, seeds,
budgets, the resolved config and a preset's variants and claim); ``dpfl compare
--resume DIR`` takes every setting it is not given from there, and refuses, naming it,
one given again that differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
from engine.config import ConfigError, config_from_dict, load_config, replace
from engine.results import write_json

#: What a comparison started with (``dpfl compare --resume DIR`` reads it).
RECORD_FILE = "compare.json"


def _folder(args: argparse.Namespace) -> tuple[Path, bool]:
    """The results folder and whether the comparison is resumed (``--resume DIR``, or
    ``--resume --out DIR``)."""
    resume = args.resume is not False
    folder = args.resume if isinstance(args.resume, str) else args.out
    if isinstance(args.resume, str) and args.out and Path(args.out) != Path(args.resume):
        raise ConfigError(
            f"--resume {args.resume} and --out {args.out} name different folders: give one"
        )
    if resume:
        if args.overwrite:
            raise ConfigError("--resume continues the comparison, --overwrite replaces it")
        if not folder:
            raise ConfigError("--resume: give the comparison to continue with --out DIR")
        if not Path(folder).is_dir():
            raise ConfigError(f"--out={str(folder)!r}: no such folder to --resume")
        return Path(folder), True
    out = Path(args.out) if args.out else default_out("compare")
    if args.out:
        check_out(out, "--out", args.overwrite, "--resume")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    return out, False


def read_record(out: Path) -> dict[str, Any] | None:
    """``DIR/compare.json``, or None for a comparison started before it was written."""
    path = out / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        record["config"], record["algorithms"]  # noqa: B018 - both must be there
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"--resume: {path} is damaged ({type(e).__name__}); resume with the flags the "
            "comparison started with after removing it"
        ) from None
    return record


def _agree(flag: str, given: Any, saved: Any, out: Path) -> None:
    if given != saved:
        raise ConfigError(
            f"--resume: {flag}={given!r} but the comparison in {out} started with {saved!r} "
            f"({out / RECORD_FILE}); resume with the same flags or none (nothing was changed)"
        )


def compare_command(args: argparse.Namespace) -> int:
    """``dpfl compare``: check every input and every run's folder, then run the table."""
    from engine.config.presets import read_preset
    from engine.simulation import compare as cmp

    out, resume = _folder(args)
    record = read_record(out) if resume else None
    epsilons = parse_floats(args.epsilons, "--epsilons") if args.epsilons else None
    seeds = parse_seeds(args.seeds)
    meta: dict[str, Any] = {}
    if record is not None and args.config is None and not args.set:  # the folder's own
        config = config_from_dict(record["config"])
        if args.executor:
            config = replace(config, **{"ray.executor": args.executor})
        variants = record.get("variants") or {}
        meta = record.get("preset") or {}
        names = cmp.parse_algorithms(args.algorithms or ",".join(record["algorithms"]), variants)
        recipes = list(dict.fromkeys(cmp.recipe_of(n, variants) for n in names))
    else:
        preset = read_preset(args.config) if args.config else None
        scale = args.scale or (record or {}).get("scale") or "paper"
        if preset is not None:  # a paper table (experiments/*.yaml): its rows, columns, scale
            config = load_config(None, args.set, base=preset.tree(scale))
            if args.executor:
                config = replace(config, **{"ray.executor": args.executor})
            variants = preset.variants
            names = cmp.parse_algorithms(args.algorithms or ",".join(preset.algorithms), variants)
            epsilons = epsilons or list(preset.scale_epsilons(scale))
            meta = {"paper": preset.paper, "table": preset.table, "claim": preset.claim}
            meta["scale"] = scale
        else:
            if scale != "paper":
                raise ConfigError(f"--scale={scale}: needs a preset --config (experiments/)")
            config = config_from_args(args)
            variants = {}
            names = cmp.parse_algorithms(args.algorithms or "all")
        recipes = list(dict.fromkeys(cmp.recipe_of(n, variants) for n in names))
        check_private(recipes, args, config.recipe.private)
    if record is not None:  # flags given again must agree with the folder's
        saved_names = list(record["algorithms"])
        if args.algorithms is not None:
            _agree("--algorithms", ",".join(names), ",".join(saved_names), out)
        names = saved_names
        if args.seeds is not None:
            _agree("--seeds", seeds, record.get("seeds"), out)
        seeds = record.get("seeds")
        if args.epsilons is not None or epsilons is not None:
            _agree("--epsilons", epsilons or None, record.get("epsilons"), out)
        epsilons = record.get("epsilons")
        if args.scale is not None:
            _agree("--scale", args.scale, record.get("scale"), out)
    if epsilons and all(a in non_private(config.recipe.private) for a in recipes):
        raise ConfigError(f"--epsilons: {','.join(names)} are not private; nothing to budget")
    if config.ray.executor == "ray":
        check_resources(config)  # before any folder, data or Ray
    planned = cmp.plan(config, names, out, seeds, epsilons, variants)
    cmp.validate(planned)  # before any folder
    done = cmp.check_resume(planned, out) if resume else None  # every run's folder
    if not resume:
        out = claim_out(out, args.overwrite, default=not args.out)
        write_json(
            out / RECORD_FILE,
            {
                "algorithms": names,
                "seeds": seeds,
                "epsilons": epsilons,
                "scale": meta.get("scale"),
                "variants": dict(variants),
                "preset": meta,
                "config": config.to_dict(),
            },
        )
    runs = cmp.plan(config, names, out, seeds, epsilons, variants)  # (a default name: suffix)
    with quiet_ray(out, args.verbose, config.ray.executor == "ray"):
        rows = cmp.run(runs, out, progress=not args.quiet, done=done)
    summary = cmp.summarize(rows)
    if meta.get("paper"):
        print(f"{meta['paper']}: {meta['table']} ({meta['scale']} scale)\nclaim: {meta['claim']}")
    print(cmp.format_paper_table(summary) if epsilons else cmp.format_table(summary))
    print(f"results: {out}")
    return 0
