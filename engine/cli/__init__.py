"""The ``dpfl`` command line: ``dpfl run``, ``dpfl compare``, ``dpfl tune``, ``dpfl
report``, ``dpfl privacy``, ``dpfl algorithms``, ``dpfl config`` and ``dpfl submit``
(any of them as a Ray job on a cluster).

Contract with users:

* Invalid input (a bad value, an unknown key, a YAML syntax error, a missing file, a
  bad flag) exits with status 2 and one line on stderr, ``dpfl: error: ...``, naming
  the value; checks run before any folder is created or Ray is started.
* Results are never overwritten: an existing results folder is an error naming
  ``--resume`` (where a command can continue) and ``--overwrite`` (which removes the
  old folder first, stale reports and figures included). Default folder names carry
  the time to the microsecond and are created exclusively, so two commands started
  together never share one.
* Ray's console chatter (its log lines, the C++ core worker's warnings, workers'
  output) goes to ``ray.log`` in the results folder; ``--verbose`` shows it instead.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import importlib.util
import json
import math
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cli.parser import COMMANDS, RAY_LOG, TUNE_METRICS, build_parser
from engine.cli.parser import parse_floats as _floats
from engine.cli.parser import parse_seeds as _seeds
from engine.config import ConfigError, RunConfig, load_config

__all__ = ["HANDLERS", "RAY_LOG", "TUNE_METRICS", "build_parser", "main"]

#: Read by :func:`engine.runtime.executors.ensure_ray`: "0" keeps workers' output off the console.
LOG_TO_DRIVER_ENV = "DPFL_RAY_LOG_TO_DRIVER"
#: Read by :func:`engine.runtime.executors.ensure_ray` (its ``QUIET_ENV``): "1" (``dpfl -q``) keeps
#: the dashboard's address off the console. Spelled here so that commands that start no
#: Ray (``dpfl algorithms``, ``dpfl privacy``) do not import the executors and torch.
QUIET_ENV = "DPFL_QUIET"
#: The keys that promise privacy; a non-private recipe given one is an error.
PRIVACY_PROMISES = ("privacy.epsilon", "privacy.noise_multiplier", "privacy.delta")


# --------------------------------------------------------------------------- helpers


def _given(path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The keys the user set (YAML file and ``--set``), dotted, with their values: the
    tree ``load_config`` builds before filling in defaults."""
    from engine.config import dotted_leaves, read_yaml_mapping, user_tree

    # The file is read as a mapping (a paper preset too: compare checks its keys).
    written = read_yaml_mapping(path) if path is not None else None
    return dotted_leaves(user_tree(None, overrides, base=written))


def _load(args: argparse.Namespace) -> RunConfig:
    config = load_config(args.config, args.set)
    if getattr(args, "executor", None):
        from engine.config import replace

        config = replace(config, **{"ray.executor": args.executor})
    return config


def _non_private(recipe_private: bool = True) -> set[str]:
    """Algorithm names that add no noise (``custom`` when its recipe says private: false)."""
    from engine.config import CUSTOM, NON_PRIVATE

    return set(NON_PRIVATE) | (set() if recipe_private else {CUSTOM})


def _check_private(
    algorithms: list[str], args: argparse.Namespace, recipe_private: bool = True
) -> None:
    """Privacy keys given where no algorithm is private: an error, not a silent no-op.

    ``dpfl compare`` may mix private recipes with non-private baselines at one budget;
    only when every algorithm would ignore ``privacy.epsilon`` & co. is it refused.
    ``recipe_private``: the ``recipe.private`` of the config (for ``custom``)."""
    if any(a not in _non_private(recipe_private) for a in algorithms):
        return
    given = _given(args.config, args.set)
    for key in PRIVACY_PROMISES:
        if given.get(key) is not None:
            which = (
                f"algorithm={algorithms[0]} is"
                if len(algorithms) == 1
                else f"algorithms {','.join(algorithms)} are"
            )
            raise ConfigError(
                f"{key}={given[key]!r}: {which} not private and would ignore it; "
                "drop the key or choose a private algorithm (dpfl algorithms)"
            )


def _default_out(name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path("results") / f"{stamp}-{name}"


def _holds_results(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _check_out(path: Path, flag: str, overwrite: bool, resume: str | None = None) -> None:
    """An existing results folder is kept unless --overwrite; checked before any work."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}={str(path)!r}: is a file, not a folder")
    if _holds_results(path) and not overwrite:
        how = f"{resume} to continue it, or --overwrite" if resume else "--overwrite"
        raise ConfigError(
            f"{flag}={str(path)!r}: already holds results; pass {how} to replace it "
            "(nothing was changed)"
        )


def _claim_out(path: Path, overwrite: bool, default: bool) -> Path:
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


@contextlib.contextmanager
def _quiet_ray(
    out: Path, verbose: bool, uses_ray: bool = True, defer: bool = False
) -> Iterator[None]:
    """Send Ray's console output to ``out/ray.log`` (unless ``verbose``).

    Ray writes to the console three ways: Python log records (the ``ray`` logger, e.g.
    its token-authentication notice), C++ log lines written straight to file
    descriptor 2 by the driver's core worker (e.g. ``core_worker.cc ...
    max_restarts``), and workers' output forwarded to the driver. The first is given a
    file handler, the second is caught by pointing fd 2 at the log while Python's
    ``sys.stderr`` (progress bars, warnings, errors) keeps the console, and the third
    is turned off (:data:`LOG_TO_DRIVER_ENV`; workers' output stays in Ray's session
    logs). When ``out`` does not exist yet, the log is kept in a temporary file and
    appended to ``out/ray.log`` when the command ends, if ``out`` then exists; so it is
    with ``defer`` (a resume whose checks run inside), and a command refused with a
    ConfigError then leaves ``out`` untouched.
    """
    if verbose or not uses_ray:
        yield
        return
    import logging
    import tempfile

    import ray  # noqa: F401 - its logger exists before it is redirected

    tmp = None
    refused = False
    if out.is_dir() and not defer:
        log = open(out / RAY_LOG, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    else:
        fd, tmp = tempfile.mkstemp(prefix="dpfl-ray-", suffix=".log")
        log = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
    log.write(
        f"# dpfl {' '.join(sys.argv[1:])}: Ray's console output "
        f"(workers' output: Ray's session logs, e.g. /tmp/ray/session_latest/logs)\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    console_fd = os.dup(2)
    old_stderr = sys.stderr
    try:
        real = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        real = False  # already redirected (e.g. captured by a test): leave it alone
    os.dup2(log.fileno(), 2)
    if real:
        sys.stderr = open(  # noqa: SIM115
            console_fd,
            "w",
            buffering=1,
            closefd=False,
            encoding=getattr(old_stderr, "encoding", None) or "utf-8",
            errors="backslashreplace",
        )
    # ray.init(configure_logging=False) removes the "ray" logger's handlers, after which
    # Ray's records reach logging.lastResort (the console): both go to the log.
    ray_logger = logging.getLogger("ray")
    handlers, propagate = ray_logger.handlers[:], ray_logger.propagate
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_logger.handlers = [handler]
    ray_logger.propagate = False
    last_resort = logging.lastResort
    logging.lastResort = handler
    # The raylet's warnings (e.g. "worker processes were started ...") reach the driver
    # through a thread that prints them, coloured, to sys.stdout whatever log_to_driver
    # says (ray._private.worker.listen_error_messages): they go to the log too.
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)

    def to_log(data: dict, *_: Any, **__: Any) -> None:
        with contextlib.suppress(ValueError, OSError):  # the log closed under the thread
            for line in data.get("lines", []):
                log.write(f"({data.get('pid', 'ray')}) {line}\n")

    if printer is not None:
        ray_worker.print_to_stdstream = to_log
    # Tune's new output engine prints an experiment box and TensorBoard hints to stdout
    # even at verbose=0; the legacy engine at verbose=0 prints nothing.
    quiet_env = {LOG_TO_DRIVER_ENV: "0", "RAY_AIR_NEW_OUTPUT": "0"}
    env_before = {k: os.environ.get(k) for k in quiet_env}
    os.environ.update(quiet_env)
    try:
        yield
    except ConfigError:
        refused = True
        raise
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        ray_logger.handlers = handlers
        ray_logger.propagate = propagate
        logging.lastResort = last_resort
        if printer is not None:
            ray_worker.print_to_stdstream = printer
        sys.stderr.flush()
        os.dup2(console_fd, 2)
        if real:
            sys.stderr = old_stderr
        os.close(console_fd)
        log.close()
        if tmp is not None:
            if out.is_dir() and not (refused and defer):
                with (
                    open(tmp, encoding="utf-8") as src,
                    open(out / RAY_LOG, "a", encoding="utf-8") as dst,
                ):
                    shutil.copyfileobj(src, dst)
            os.unlink(tmp)


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _privacy_line(p: dict) -> str:
    if not p["private"]:
        return "not private (epsilon=inf)"
    budget = f" (budget {p['target_epsilon']:g})" if p["target_epsilon"] else ""
    return (
        f"epsilon={p['final_epsilon']:.4g}{budget} at delta={p['delta']:.3g}, "
        f"noise_multiplier={p['noise_multiplier']:.4g}, clip_norm={p['clip_norm']:g}, "
        f"{p['sampling']} sampling q={p['sampling_rate']:.4g}, {p['accountant']} accountant"
    )


# --------------------------------------------------------------------------- commands


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


def _plan_run(args: argparse.Namespace) -> RunPlan:
    """Check every input of ``dpfl run`` (flags, config, privacy keys, folder, and
    everything ``simulate.prepare`` checks without training) and say what will run.
    Creates no folder and starts nothing."""
    from engine.config import replace
    from engine.simulation import prepare

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
            _check_resources(config)
        return RunPlan(
            config,
            Path(args.resume),
            [],
            resume=folder.state,
            resume_status=folder.status,
            released=folder.rows,
        )

    config = _load(args)
    _check_private([config.algorithm], args, config.recipe.private)
    seeds = _seeds(args.seeds) or []
    requested = args.out or config.out
    out = Path(requested) if requested else _default_out(config.algorithm)
    if requested:
        _check_out(out, "--out" if args.out else "out", args.overwrite, f"--resume {out}")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    first = replace(config, seed=seeds[0]) if seeds else config
    if config.ray.executor == "ray":
        _check_resources(config)  # before the data is built or Ray started
    prep = prepare(first)  # every check that needs no training, before any folder exists
    return RunPlan(
        config,
        out,
        seeds,
        default_out=not requested,
        overwrite=args.overwrite,
        dataset=prep.dataset,
    )


def _execute_run(plan: RunPlan, args: argparse.Namespace) -> int:
    """Run a checked plan: claim the folder, then one simulation per seed."""
    from engine.config import replace
    from engine.simulation import simulate

    config = plan.config
    uses_ray = config.ray.executor == "ray"
    if plan.resume_status == "complete":  # nothing to do, nothing rewritten
        _print_complete(plan)
        return 0
    if plan.resume_status is not None:  # "continue" from the checkpoint, or "start"
        with _quiet_ray(plan.out, args.verbose, uses_ray):
            result = simulate(config, progress=not args.quiet, resume=plan.resume)
        _print_run(config, result)
        return 0
    out = _claim_out(plan.out, plan.overwrite, default=plan.default_out)
    seeds = plan.seeds
    with _quiet_ray(out, args.verbose, uses_ray):
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
                _shutdown_ray()
    _print_seeds(config, seeds, results, out)
    return 0


def _run(args: argparse.Namespace) -> int:
    return _execute_run(_plan_run(args), args)


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


def _check_resources(config: RunConfig, extra_cpus: float = 0.0) -> None:
    """Workers x CPUs (and GPUs) per worker against what a local Ray would have, before
    the data is built or Ray started (engine.runtime.resources.check_local_fit); skipped when
    dpfl attaches to a cluster (ray.address or $RAY_ADDRESS), which is checked there."""
    if config.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    from engine.runtime.resources import check_local_fit

    check_local_fit(config.ray, extra_cpus)


def _print_run(config: RunConfig, result) -> None:
    print(
        f"{config.algorithm} on {config.dataset.name}/{config.model.name}: "
        f"{config.rounds} rounds, final test_accuracy={result.final_accuracy:.4f}; "
        f"{_privacy_line(result.privacy)}"
    )
    print(f"results: {result.out_dir}")


def _print_seeds(config: RunConfig, seeds: list[int], results: list, out: Path) -> None:
    import numpy as np

    acc = np.array([r.final_accuracy for r in results], dtype=float)
    std = float(acc.std(ddof=1)) if len(acc) > 1 else float("nan")
    print(
        f"{config.algorithm} on {config.dataset.name}/{config.model.name}: "
        f"{config.rounds} rounds, final test_accuracy={acc.mean():.4f} ± {std:.2g} "
        f"(mean ± sample std over {len(seeds)} seeds); {_privacy_line(results[0].privacy)}"
    )
    print(f"results: {out} (one folder per seed: {', '.join(f'seed{s}' for s in seeds)})")


def _privacy(args: argparse.Namespace) -> int:
    from engine.config import DatasetConfig
    from engine.privacy.accounting import (
        CalibrationError,
        SamplingSpec,
        calibrate_noise_multiplier,
        compute_epsilon,
        default_delta,
    )

    if args.cohort_size is None and args.sampling_rate is None:
        raise ConfigError("--sampling-rate is required (or --cohort-size with --num-clients)")
    if (args.epsilon is None) == (args.noise_multiplier is None):
        raise ConfigError("give exactly one of --epsilon and --noise-multiplier")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds}: must be >= 1")
    num_clients = args.num_clients
    if num_clients is not None and num_clients < 1:
        raise ConfigError(f"--num-clients={num_clients}: must be >= 1")
    if num_clients is None and (args.cohort_size is not None or args.max_cohort is not None):
        raise ConfigError("--num-clients is required with --cohort-size or --max-cohort")
    # delta defaults as in runs (default_delta), N = --num-clients (default dataset.num_clients)
    population = num_clients if num_clients is not None else DatasetConfig().num_clients
    delta = args.delta if args.delta is not None else default_delta(population)
    if not 0 < delta < 1:
        raise ConfigError(f"--delta={args.delta}: must be in (0, 1)")
    if num_clients is None:
        num_clients = 10**9  # plain Poisson accounting does not depend on N
    try:
        if args.cohort_size is not None:
            spec = SamplingSpec("fixed", num_clients, cohort_size=args.cohort_size)
        else:
            spec = SamplingSpec(
                "poisson", num_clients, rate=args.sampling_rate, max_cohort=args.max_cohort
            )
        accountant = args.accountant or spec.default_accountant()
        spec.check_accountant(accountant)
        if args.epsilon is not None:
            z = calibrate_noise_multiplier(args.epsilon, delta, spec, args.rounds, accountant)
        else:
            z = args.noise_multiplier
        eps = compute_epsilon(z, spec, args.rounds, delta, accountant)
    except (CalibrationError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if spec.mode == "fixed":  # the warning runs give (engine.simulation), as one line
        print(
            "dpfl: warning: sampling.mode=fixed is accounted under replace-one adjacency with "
            f"sensitivity 2C; its epsilon ({eps:.3g}) is far looser than Poisson sampling's",
            file=sys.stderr,
        )
    out = {
        "noise_multiplier": z,
        "epsilon": eps,
        "delta": delta,
        "sampling_rate": spec.effective_rate,
        "rounds": args.rounds,
        "sampling": spec.name,
        "adjacency": spec.adjacency,
        "accountant": accountant,
    }
    if args.json:
        print(json.dumps(out))
    elif args.epsilon is not None:
        bound = f"epsilon={eps:.6g} <= {args.epsilon:g}"
        print(f"noise_multiplier={z:.6g} ({bound} at delta={delta:.3g})")
    else:
        print(f"epsilon={eps:.6g} at delta={delta:.3g}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from engine.config.presets import read_preset
    from engine.simulation import compare as cmp

    preset = read_preset(args.config) if args.config else None
    epsilons = _floats(args.epsilons, "--epsilons") if args.epsilons else None
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
        config = _load(args)
        variants = {}
        names = cmp.parse_algorithms(args.algorithms or "all")
    recipes = list(dict.fromkeys(cmp.recipe_of(n, variants) for n in names))
    _check_private(recipes, args, config.recipe.private)
    if epsilons and all(a in _non_private(config.recipe.private) for a in recipes):
        raise ConfigError(f"--epsilons: {','.join(names)} are not private; nothing to budget")
    seeds = _seeds(args.seeds)
    out = Path(args.out) if args.out else _default_out("compare")
    if args.resume:
        if args.overwrite:
            raise ConfigError("--resume continues the comparison, --overwrite replaces it")
        if not args.out:
            raise ConfigError("--resume: give the comparison to continue with --out DIR")
        if not out.is_dir():
            raise ConfigError(f"--out={str(out)!r}: no such folder to --resume")
    elif args.out:
        _check_out(out, "--out", args.overwrite, "--resume")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    if config.ray.executor == "ray":
        _check_resources(config)  # before any folder, data or Ray
    planned = cmp.plan(config, names, out, seeds, epsilons, variants)
    cmp.validate(planned)  # before any folder
    done = cmp.check_resume(planned, out) if args.resume else None  # every run's folder
    if not args.resume:
        out = _claim_out(out, args.overwrite, default=not args.out)
    runs = cmp.plan(config, names, out, seeds, epsilons, variants)  # (a default name: suffix)
    with _quiet_ray(out, args.verbose, config.ray.executor == "ray"):
        rows = cmp.run(runs, out, progress=not args.quiet, done=done)
    summary = cmp.summarize(rows)
    if preset is not None:
        print(f"{preset.paper}: {preset.table} ({args.scale} scale)\nclaim: {preset.claim}")
    print(cmp.format_paper_table(summary) if epsilons else cmp.format_table(summary))
    print(f"results: {out}")
    return 0


@dataclass(frozen=True)
class TunePlan:
    """What ``dpfl tune`` will do, checked before anything is written."""

    algorithms: list[str]
    epsilons: list[float]
    out: Path


def _plan_tune(args: argparse.Namespace) -> TunePlan:
    """Check the flags of ``dpfl tune`` and the results folder; writes nothing.
    (The config and search spaces are checked by ``tuning.experiment.run_tune``
    before it starts Ray.)"""
    from engine.simulation.compare import parse_algorithms

    algorithms = parse_algorithms(args.algorithms)
    epsilons = _floats(args.epsilons, "--epsilons")
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
    out = Path(args.out) if args.out else _default_out("tune")
    if args.resume:
        if not (out / "tune").is_dir():
            raise ConfigError(f"--out={str(out)!r}: no dpfl tune experiment there to --resume")
    elif args.out:
        _check_out(out, "--out", args.overwrite, "--resume")
    elif args.overwrite:
        raise ConfigError("--overwrite: give the folder to replace with --out DIR")
    return TunePlan(algorithms, epsilons, out)


def _tune(args: argparse.Namespace) -> int:
    plan = _plan_tune(args)
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
        out = claimed = _claim_out(out, overwrite=False, default=True)
    import ray

    from tuning.experiment import run_tune

    owns_ray = not ray.is_initialized()  # a caller's Ray (a notebook, a test) stays up
    try:
        with _quiet_ray(out, args.verbose, defer=args.resume):
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
                    _shutdown_ray()
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


def _report(args: argparse.Namespace) -> int:
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


def _submit(args: argparse.Namespace) -> int:
    from engine.cli.submit import submit

    return submit(
        args.entrypoint,
        address=args.address,
        working_dir=args.working_dir,
        wait=not args.no_wait,
        install_deps=args.install_deps,
    )


def _algorithms(args: argparse.Namespace) -> int:
    # the catalog is plain data: listing the algorithms imports neither torch nor Ray
    from algorithms.catalog import CATALOG, references

    if args.markdown:  # the registry's own table (the README holds exactly this)
        from algorithms.recipes import markdown_table

        print(markdown_table())
        return 0
    width = max(len(n) for n in CATALOG)
    for name, e in CATALOG.items():
        print(f"{name:<{width}}  {e.summary}  [{e.citation()}]")
    if args.references:
        print("\nReferences (what each method computes: docs/algorithms.md):")
        for line in references():
            print(f"  {line}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from engine.config.doc import commented_yaml

    config = load_config(args.config, args.set) if (args.config or args.set) else None
    sys.stdout.write(commented_yaml(config))
    return 0


# --------------------------------------------------------------------------- parser


#: ``dpfl <command>`` -> the function that runs it (the parser lives in engine.cli.parser).
HANDLERS = {
    "run": _run,
    "privacy": _privacy,
    "compare": _compare,
    "tune": _tune,
    "report": _report,
    "submit": _submit,
    "algorithms": _algorithms,
    "config": _config,
}
if tuple(HANDLERS) != COMMANDS:  # every command the parser accepts has a handler
    raise RuntimeError(f"handlers {tuple(HANDLERS)} != commands {COMMANDS}")


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """dpfl's own warnings as one line; others in Python's usual form."""
    root = str(Path(__file__).resolve().parents[1])
    if str(filename).startswith(root):
        return f"dpfl: warning: {message}\n"
    return warnings._formatwarning_orig(message, category, filename, lineno, line)  # type: ignore[attr-defined]


def _yaml_error(e: Exception, args: argparse.Namespace) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    source = getattr(args, "config", None)
    return f"--config={source!r}: invalid YAML at{where}: {problem}"


#: OSErrors of the file system that are the user's to fix (not dpfl's bugs).
_FS_ERRORS = frozenset(
    getattr(errno, name)
    for name in ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EFBIG", "ENOTDIR", "EISDIR")
    if hasattr(errno, name)
)


def _os_error(e: OSError, args: argparse.Namespace) -> str | None:
    """One line for a file-system error naming the path (read-only, permission, full
    disk); None for any other OSError (raised as it is). A run stopped by a full disk
    keeps its last checkpoint and rows (writes go through a temporary file), so the
    line says how to continue it."""
    if e.errno is None or e.errno not in _FS_ERRORS or not e.filename:
        return None
    path = Path(str(e.filename))
    line = f"{path}: {e.strerror or os.strerror(e.errno)}"
    folder = next(
        (
            p
            for p in (path, *path.parents)
            if (p / "checkpoint.pkl").is_file() or (p / "config.json").is_file()
        ),
        None,
    )
    if e.errno in (getattr(errno, "ENOSPC", -1), getattr(errno, "EDQUOT", -1)):
        if folder is not None and args.command == "run":
            line += (
                f"; the run stopped at its last complete round: free space, then continue "
                f"with dpfl run --resume {folder}"
            )
        elif args.command == "tune":
            line += "; free space, then continue with dpfl tune --resume --out DIR"
        else:
            line += "; free space and run the command again"
    else:
        line += "; choose another --out folder or fix its permissions"
    return line


def main(argv: list[str] | None = None) -> int:
    import yaml

    from engine.telemetry import timeline

    timeline.mark("main")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(warnings, "_formatwarning_orig"):
        warnings._formatwarning_orig = warnings.formatwarning  # type: ignore[attr-defined]
    quiet_before = os.environ.get(QUIET_ENV)
    if getattr(args, "quiet", False):
        os.environ[QUIET_ENV] = "1"  # read by ensure_ray: no dashboard line
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.formatwarning = _format_warning
            try:
                return int(HANDLERS[args.command](args))
            finally:
                warnings.formatwarning = warnings._formatwarning_orig  # type: ignore[attr-defined]
    except ConfigError as e:
        print(f"dpfl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        line = _os_error(e, args)
        if line is None:
            raise
        print(f"dpfl: error: {line}", file=sys.stderr)
        return 2
    except yaml.YAMLError as e:
        print(f"dpfl: error: {_yaml_error(e, args)}", file=sys.stderr)
        return 2
    finally:
        if quiet_before is None:
            os.environ.pop(QUIET_ENV, None)
        else:
            os.environ[QUIET_ENV] = quiet_before
        timeline.mark("command done")
        timeline.dump()
        _no_colour_reset_at_exit()


def _no_colour_reset_at_exit() -> None:
    """Ray's CLI logger calls ``colorama.init(strip=False)`` when imported, which
    registers an exit hook that writes ``ESC[0m`` to a terminal after dpfl's last line;
    dpfl prints no colour, so the hook is removed."""
    import atexit

    initialise = sys.modules.get("colorama.initialise")
    reset = getattr(initialise, "reset_all", None)
    if reset is not None:
        atexit.unregister(reset)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
