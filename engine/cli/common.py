"""What the ``dpfl`` commands share: reading the config a command was given, refusing
privacy keys no algorithm would honour, the results folder (never overwritten unless
``--overwrite``; default names claimed exclusively), the resource check before Ray
starts, sending Ray's console output to ``ray.log``, and the one-line privacy summary."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
from pathlib import Path
from typing import Any

from engine.config import ConfigError, RunConfig, load_config
from engine.runtime.ray_console import quiet_ray  # noqa: F401 - the commands import it here


def _set(value: Any) -> bool:
    return value is not None


def _on(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


#: The keys (and the values) that promise privacy or a privacy measurement; a
#: non-private recipe, which would ignore them, given one is an error.
PRIVACY_PROMISES: dict[str, Any] = {
    "privacy.epsilon": _set,
    "privacy.noise_multiplier": _set,
    "privacy.delta": _set,
    "privacy.secure_noise": _on,  # release mode
    "privacy.clip_mode": lambda v: str(v).strip() == "adaptive",
    "eval.audit_canaries": lambda v: v is not None and str(v).strip() not in ("0", ""),
}


def given_keys(path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The keys the user set (YAML file and ``--set``), dotted, with their values: the
    tree ``load_config`` builds before filling in defaults."""
    from engine.config import dotted_leaves, read_yaml_mapping, user_tree

    # The file is read as a mapping (a paper preset too: compare checks its keys).
    written = read_yaml_mapping(path) if path is not None else None
    return dotted_leaves(user_tree(None, overrides, base=written))


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The config of ``--config``/``--set``, with ``--executor`` applied."""
    config = load_config(args.config, args.set)
    if getattr(args, "executor", None):
        from engine.config import replace

        config = replace(config, **{"ray.executor": args.executor})
    return config


def non_private(recipe_private: bool = True) -> set[str]:
    """Algorithm names that add no noise (``custom`` when its recipe says private: false)."""
    from engine.config import CUSTOM, NON_PRIVATE

    return set(NON_PRIVATE) | (set() if recipe_private else {CUSTOM})


def check_private(
    algorithms: list[str], args: argparse.Namespace, recipe_private: bool = True
) -> None:
    """Privacy keys given where no algorithm is private: an error, not a silent no-op.

    ``dpfl compare`` may mix private recipes with non-private baselines at one budget;
    only when every algorithm would ignore ``privacy.epsilon`` & co. is it refused.
    ``recipe_private``: the ``recipe.private`` of the config (for ``custom``)."""
    if any(a not in non_private(recipe_private) for a in algorithms):
        return
    given = given_keys(args.config, args.set)
    for key, promises in PRIVACY_PROMISES.items():
        if key in given and promises(given[key]):
            which = (
                f"algorithm={algorithms[0]} is"
                if len(algorithms) == 1
                else f"algorithms {','.join(algorithms)} are"
            )
            raise ConfigError(
                f"{key}={given[key]!r}: {which} not private and would ignore it; "
                "drop the key or choose a private algorithm (dpfl algorithms)"
            )


def check_flag_conflicts(args: argparse.Namespace) -> None:
    """Two sources of one setting on the command line, or a config key the command
    never reads: a one-line error naming both, never a silent choice.

    A flag beside ``--set``/``--config`` giving the same setting another value
    (``--out A --set out=B``, ``--executor`` and ``ray.executor``, ``--seeds`` and
    ``seed``); for ``compare`` and ``tune``, which write under ``--out`` and run the
    recipes of ``--algorithms``, an ``out`` key, or an ``algorithm`` they do not run;
    for ``tune`` (and ``compare --epsilons``), which set each run's budget themselves,
    ``privacy.epsilon`` or ``privacy.noise_multiplier``."""
    command = getattr(args, "command", None)
    if command not in ("run", "compare", "tune") or (command == "run" and args.resume):
        return  # run --resume refuses --config/--set itself
    given = given_keys(args.config, args.set)
    if not given:
        return
    out = given.get("out")
    if "out" in given and command != "run":
        raise ConfigError(
            f"out={out!r}: dpfl {command} writes under --out DIR; drop the key and give "
            "--out instead"
        )
    if out is not None and getattr(args, "out", None) and str(out) != str(args.out):
        raise ConfigError(
            f"--out={args.out!r} and out={out!r} (--config/--set) name two folders; give one"
        )
    executor = given.get("ray.executor")
    if getattr(args, "executor", None) and executor is not None and executor != args.executor:
        raise ConfigError(
            f"--executor={args.executor} and ray.executor={executor!r} (--config/--set) "
            "disagree; give one"
        )
    if getattr(args, "seeds", None) and "seed" in given:
        raise ConfigError(
            f"--seeds={args.seeds!r} runs each of its seeds, and seed={given['seed']!r} "
            "(--config/--set) would be ignored; give one"
        )
    preset = any(k.startswith("preset.") for k in given)  # its rows are its variants
    resumed = bool(getattr(args, "resume", False)) and args.algorithms is None  # the record's
    if command in ("compare", "tune") and "algorithm" in given and not (preset or resumed):
        spec = args.algorithms or ("all" if command == "compare" else "dp_fedavg")
        listed = [a.strip() for a in spec.split(",")]
        every = spec.strip() == "all" and given["algorithm"] != "custom"  # the built-in ones
        if not every and given["algorithm"] not in listed:
            raise ConfigError(
                f"algorithm={given['algorithm']!r} (--config/--set): dpfl {command} runs the "
                f"recipes of --algorithms ({spec}); add it there or drop the key"
            )
    if command == "tune" or (command == "compare" and args.epsilons):
        for key in ("privacy.epsilon", "privacy.noise_multiplier"):
            if given.get(key) is not None:
                raise ConfigError(
                    f"{key}={given[key]!r} (--config/--set): dpfl {command} sets each run's "
                    "budget from --epsilons (sigma is calibrated from it); drop the key"
                )


def default_out(name: str) -> Path:
    """``results/<time to the microsecond>-<name>``: a command's default folder."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path("results") / f"{stamp}-{name}"


def _holds_results(path: Path) -> bool:
    """A file, or a folder with anything in it."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def check_writable(path: Path, flag: str) -> None:
    """The folder ``path`` can be created (or written, if it exists): no file on its
    way, and its nearest existing folder writable (not a read-only file system, not
    forbidden); checked before any work, so that a run is not refused after it."""
    for folder in (path, *path.parents):
        if not folder.exists():
            continue
        if not folder.is_dir():
            where = "is a file" if folder == path else f"{folder} is a file"
            raise ConfigError(f"{flag}={str(path)!r}: {where}, not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
            why = "is on a read-only file system" if read_only else "is not writable"
            raise ConfigError(
                f"{flag}={str(path)!r}: {folder} {why}; choose another folder"
                + ("" if read_only else " or fix its permissions")
            )
        return


def check_out(path: Path, flag: str, overwrite: bool, resume: str | None = None) -> None:
    """An existing results folder is kept unless --overwrite; checked before any work."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}={str(path)!r}: is a file, not a folder")
    check_writable(path, flag)
    if _holds_results(path) and not overwrite:
        how = f"{resume} to continue it, or --overwrite" if resume else "--overwrite"
        raise ConfigError(
            f"{flag}={str(path)!r}: already holds results; pass {how} to replace it "
            "(nothing was changed)"
        )


def claim_out(path: Path, overwrite: bool, default: bool) -> Path:
    """Create the results folder. A default name is created exclusively (a suffix is
    added rather than share a folder); ``overwrite`` removes the old folder first."""
    if default:
        candidate, n = path, 1
        while True:
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileExistsError:
                n += 1
                candidate = path.with_name(f"{path.name}-{n}")
    if overwrite and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def shutdown_ray() -> None:
    """Stop the Ray this command started (no-op when none is up): now, or at the
    ``dpfl`` executable's exit (:func:`engine.runtime.ray_start.release_ray`)."""
    from engine.runtime.ray_start import release_ray

    release_ray()


def privacy_line(p: dict) -> str:
    """A run's privacy summary (its ``privacy`` dict) as one line."""
    if not p["private"]:
        return "not private (epsilon=inf)"
    budget = f" (budget {p['target_epsilon']:g})" if p["target_epsilon"] else ""
    return (
        f"epsilon={p['final_epsilon']:.4g}{budget} at delta={p['delta']:.3g}, "
        f"noise_multiplier={p['noise_multiplier']:.4g}, clip_norm={p['clip_norm']:g}, "
        f"{p['sampling']} sampling q={p['sampling_rate']:.4g}, {p['accountant']} accountant"
    )


def check_resources(config: RunConfig, extra_cpus: float = 0.0) -> None:
    """Workers x CPUs (and GPUs) per worker against what a local Ray would have, before
    the data is built or Ray started (engine.runtime.resources.check_local_fit); skipped when
    dpfl attaches to a cluster (ray.address or $RAY_ADDRESS), which is checked there."""
    if config.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    from engine.runtime.resources import check_local_fit

    check_local_fit(config.ray, extra_cpus)
