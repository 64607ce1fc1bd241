"""The ``dpfl`` command line: ``dpfl run``, ``dpfl privacy``, ``dpfl algorithms``, ...,
and ``dpfl submit`` (any of them as a Ray job on a cluster).

Invalid input exits with status 2 and one line on stderr naming the key and value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from engine.config import ConfigError, load_config


def _run(args: argparse.Namespace) -> int:
    from engine.simulate import simulate

    resume = None
    if args.resume:
        from engine.simulate import load_run

        if args.config or args.set:
            raise ConfigError("--resume continues a run with its saved config: drop --config/--set")
        config, resume = load_run(args.resume)
    else:
        config = load_config(args.config, args.set)
    if args.executor:
        from engine.config import replace

        config = replace(config, **{"ray.executor": args.executor})
    result = simulate(config, progress=not args.quiet, resume=resume)
    p = result.privacy
    acc = result.final_accuracy
    if p["private"]:
        budget = f" (budget {p['target_epsilon']:g})" if p["target_epsilon"] else ""
        priv = (
            f"epsilon={p['final_epsilon']:.4g}{budget} at delta={p['delta']:.3g}, "
            f"noise_multiplier={p['noise_multiplier']:.4g}, clip_norm={p['clip_norm']:g}, "
            f"{p['sampling']} sampling q={p['sampling_rate']:.4g}, {p['accountant']} accountant"
        )
    else:
        priv = "not private (epsilon=inf)"
    print(
        f"{config.algorithm} on {config.dataset.name}/{config.model.name}: "
        f"{config.rounds} rounds, final test_accuracy={acc:.4f}; {priv}"
    )
    print(f"results: {result.out_dir}")
    return 0


def _privacy(args: argparse.Namespace) -> int:
    from engine.privacy.accounting import (
        CalibrationError,
        SamplingSpec,
        calibrate_noise_multiplier,
        compute_epsilon,
    )

    if (args.epsilon is None) == (args.noise_multiplier is None):
        raise ConfigError("give exactly one of --epsilon and --noise-multiplier")
    num_clients = args.num_clients
    if num_clients is None:
        if args.cohort_size is not None or args.max_cohort is not None:
            raise ConfigError("--num-clients is required with --cohort-size or --max-cohort")
        num_clients = 10**9  # plain Poisson accounting does not depend on N
    if not 0 < args.delta < 1:
        raise ConfigError(f"--delta={args.delta}: must be in (0, 1)")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds}: must be >= 1")
    try:
        if args.cohort_size is not None:
            spec = SamplingSpec("fixed", num_clients, cohort_size=args.cohort_size)
        else:
            spec = SamplingSpec(
                "poisson", num_clients, rate=args.sampling_rate, max_cohort=args.max_cohort
            )
        accountant = args.accountant or spec.default_accountant()
        if args.epsilon is not None:
            z = calibrate_noise_multiplier(args.epsilon, args.delta, spec, args.rounds, accountant)
        else:
            z = args.noise_multiplier
        eps = compute_epsilon(z, spec, args.rounds, args.delta, accountant)
    except (CalibrationError, ValueError) as e:
        raise ConfigError(str(e)) from None
    out = {
        "noise_multiplier": z,
        "epsilon": eps,
        "delta": args.delta,
        "sampling_rate": spec.effective_rate,
        "rounds": args.rounds,
        "sampling": spec.name,
        "adjacency": spec.adjacency,
        "accountant": accountant,
    }
    if args.json:
        print(json.dumps(out))
    elif args.epsilon is not None:
        print(f"noise_multiplier={z:.6g} (epsilon={eps:.6g} <= {args.epsilon:g})")
    else:
        print(f"epsilon={eps:.6g}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import datetime as _dt
    from pathlib import Path

    from engine.compare import compare, format_table, parse_algorithms

    config = load_config(args.config, args.set)
    if args.executor:
        from engine.config import replace

        config = replace(config, **{"ray.executor": args.executor})
    names = parse_algorithms(args.algorithms)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/compare-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    summary = compare(config, names, out, progress=not args.quiet)
    print(format_table(summary))
    print(f"results: {out}")
    return 0


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: expected comma-separated numbers") from None


def _tune(args: argparse.Namespace) -> int:
    from engine.compare import parse_algorithms
    from tuning.experiment import run_tune

    trials = run_tune(
        args.config,
        parse_algorithms(args.algorithms),
        _floats(args.epsilons, "--epsilons"),
        num_samples=args.num_samples,
        search=args.search,
        scheduler=args.scheduler,
        metric=args.metric,
        out=args.out,
        resume=args.resume,
        smoke_test=args.smoke_test,
        overrides=args.set,
    )
    cols = [c for c in trials.columns if c.startswith(("final_", "best_"))]
    print(trials[["algorithm", "epsilon_budget", "trial_id", "status", *cols]].to_string())
    print(
        f"results: {args.out} (each trial's epsilon excludes hyperparameter selection; "
        f"dpfl report {args.out} gives the cost of releasing the best trial)"
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from tuning.report import write_report

    print(write_report(args.dir, metric=args.metric))
    return 0


def _submit(args: argparse.Namespace) -> int:
    from engine.submit import submit

    return submit(
        args.entrypoint,
        address=args.address,
        working_dir=args.working_dir,
        wait=not args.no_wait,
        install_deps=args.install_deps,
    )


def _algorithms(_: argparse.Namespace) -> int:
    from algorithms import RECIPES

    width = max(len(n) for n in RECIPES)
    for name, r in RECIPES.items():
        print(f"{name:<{width}}  {r.summary}  [{r.paper}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpfl", description="Federated learning with client-level differential privacy"
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one simulation")
    run.add_argument("--config", "-c", help="YAML file (a diff over the defaults)")
    run.add_argument(
        "--set", "-s", action="append", default=[], metavar="KEY=VALUE", help="override a key"
    )
    run.add_argument("--executor", choices=["ray", "local"], help="shortcut for ray.executor")
    run.add_argument(
        "--resume", metavar="DIR", help="continue an interrupted run from its results folder"
    )
    run.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    run.set_defaults(func=_run)

    pr = sub.add_parser("privacy", help="noise multiplier for a budget, or epsilon for a noise")
    pr.add_argument("--epsilon", type=float)
    pr.add_argument("--noise-multiplier", type=float)
    pr.add_argument("--delta", type=float, required=True)
    pr.add_argument("--sampling-rate", type=float, default=None)
    pr.add_argument("--rounds", type=int, required=True)
    pr.add_argument("--accountant", choices=["rdp", "pld"])
    pr.add_argument("--num-clients", type=int, help="population N (needed for fixed/capped)")
    pr.add_argument("--cohort-size", type=int, help="fixed-size sampling of this many clients")
    pr.add_argument("--max-cohort", type=int, help="cap on the Poisson cohort (PLD)")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=_privacy)

    cmp_ = sub.add_parser("compare", help="run several algorithms at one budget; one table")
    cmp_.add_argument("--algorithms", "-a", default="all", help="all, or a,b,c")
    cmp_.add_argument("--config", "-c", help="YAML file (a diff over the defaults)")
    cmp_.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE")
    cmp_.add_argument("--out", help="folder (default results/compare-<timestamp>)")
    cmp_.add_argument("--executor", choices=["ray", "local"])
    cmp_.add_argument("--quiet", "-q", action="store_true")
    cmp_.set_defaults(func=_compare)

    tu = sub.add_parser("tune", help="hyperparameter search at fixed budgets (Ray Tune)")
    tu.add_argument("--config", "-c", help="YAML: config diff plus an optional tune: section")
    tu.add_argument("--algorithms", "-a", default="dp_fedavg", help="all, or a,b,c")
    tu.add_argument("--epsilons", default="4", help="comma-separated budgets, e.g. 1,4,8")
    tu.add_argument("--num-samples", type=int, default=4, help="trials per (algorithm, eps)")
    tu.add_argument("--search", choices=["random", "optuna", "hyperopt"], default="random")
    tu.add_argument("--scheduler", choices=["fifo", "asha"], default="fifo")
    tu.add_argument("--metric", default="test_accuracy")
    tu.add_argument("--out", default="results/tune", help="experiment folder")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted run")
    tu.add_argument("--smoke-test", action="store_true", help="2 rounds, small data")
    tu.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE")
    tu.set_defaults(func=_tune)

    rp = sub.add_parser("report", help="best configuration per (algorithm, eps), plots")
    rp.add_argument("dir", help="a dpfl tune output folder")
    rp.add_argument("--metric", default="test_accuracy")
    rp.set_defaults(func=_report)

    sb = sub.add_parser(
        "submit",
        help="run a dpfl command as a Ray job on a cluster",
        usage="dpfl submit [--address URL] [--working-dir DIR] [--no-wait] [--install-deps] "
        "-- dpfl COMMAND ...",
    )
    sb.add_argument(
        "--address",
        help="Ray dashboard URL (default: $RAY_ADDRESS, else http://127.0.0.1:8265)",
    )
    sb.add_argument(
        "--working-dir", default=".", help="folder uploaded as the job's working dir (default .)"
    )
    sb.add_argument("--no-wait", action="store_true", help="print the job id and return")
    sb.add_argument(
        "--install-deps",
        action="store_true",
        help="pip-install dpfl's dependencies for the job (clusters whose image lacks them)",
    )
    sb.add_argument(
        "entrypoint",
        nargs=argparse.REMAINDER,
        help="after --: the command to run, e.g. dpfl tune ... --out /shared/exp",
    )
    sb.set_defaults(func=_submit)

    al = sub.add_parser("algorithms", help="list the algorithms")
    al.set_defaults(func=_algorithms)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "privacy" and args.cohort_size is None and args.sampling_rate is None:
        parser.error("--sampling-rate is required (or --cohort-size with --num-clients)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return int(args.func(args))
    except ConfigError as e:
        print(f"dpfl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
