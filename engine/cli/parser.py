"""The ``dpfl`` argument parser (its value checks: :mod:`engine.cli.values`), with no
command behind them.

:mod:`engine.cli.dispatch` runs the commands (it maps ``args.command`` to a handler);
:mod:`engine.cli.submit` parses a job's ``dpfl ...`` entrypoint with the same parser to
check it before submitting. Both import this module; neither imports the other at
module level, and this module imports neither.
"""

from __future__ import annotations

import argparse

from engine.cli.values import (  # noqa: F401 - parse_args, parse_* are imported from here
    checked,
    closest_flag,
    name_list,
    nonempty,
    number_list,
    parse_args,
    parse_floats,
    parse_seeds,
    seed_list,
)
from engine.config.sections import EXECUTORS
from engine.runtime.ray_console import RAY_LOG  # noqa: F401 - the commands import it here

#: Metrics a Tune trial reports and ``dpfl tune`` can maximise. Only public ones (measured
#: on the public evaluation set) unless ``--allow-nonprivate-metric``: selecting or
#: stopping trials on clients' data leaks it beyond ε (README, "Privacy model").
TUNE_METRICS = ("test_accuracy", "personal_accuracy_nonprivate")
#: The commands; :data:`engine.cli.dispatch.HANDLERS` has one handler for each.
COMMANDS = (
    "run",
    "privacy",
    "compare",
    "tune",
    "report",
    "leaderboard",
    "submit",
    "algorithms",
    "config",
)


class _Parser(argparse.ArgumentParser):
    """argparse with dpfl's error contract: one line, exit 2 (an unknown flag names the
    closest known one)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " ".join(message.split())  # argparse's messages may span lines
        flag, _, text = message.removeprefix("argument ").partition(": ")
        if message.startswith("argument ") and text.startswith(tuple(flag.split("/"))):
            message = text  # a value refused by its type names the flag itself
        if message.startswith("unrecognized arguments:"):
            message += closest_flag(self, message.split(":", 1)[1].split())
        self.exit(2, f"dpfl: error: {message} (see {self.prog} --help)\n")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        type=checked(nonempty, "--config"),
        help="YAML file (a diff over the defaults)",
    )
    p.add_argument(
        "--set",
        "-s",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (repeatable), e.g. --set rounds=100; keys: dpfl config",
    )


def _add_console_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help=f"show Ray's console output (default: kept in {RAY_LOG} in the results folder)",
    )


def _add_out_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--out", metavar="DIR", type=checked(nonempty, "--out"), help=help)


def _add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out folder (deletes it)"
    )


def _add_executor_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", choices=list(EXECUTORS), help="shortcut for ray.executor")


def _add_resume_folder_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``--resume [DIR]``: the folder given, or ``--out``'s when none is."""
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="DIR",
        type=checked(nonempty, "--resume"),
        help=help,
    )


def build_parser() -> argparse.ArgumentParser:
    from engine.config.doc import keys_epilog

    p = _Parser(
        prog="dpfl", description="Federated learning with client-level differential privacy"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run one simulation (or one per seed)",
        epilog=keys_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(run)
    _add_out_arg(
        run, "results folder (same as --set out=DIR; default results/<timestamp>-<algorithm>)"
    )
    run.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        type=checked(seed_list, "--seeds"),
        help="one run per seed, each in DIR/seed<S>; prints mean ± std of final accuracy",
    )
    _add_executor_arg(run)
    run.add_argument(
        "--resume",
        metavar="DIR",
        type=checked(nonempty, "--resume"),
        help="continue an interrupted run from its results folder",
    )
    _add_overwrite_arg(run)
    _add_console_args(run)

    pr = sub.add_parser(
        "privacy",
        help="noise multiplier for a budget, or epsilon for a noise",
        description="Client-level DP accounting without running anything: give --epsilon "
        "to calibrate the noise multiplier, or --noise-multiplier to get epsilon.",
    )
    pr.add_argument("--epsilon", type=float, help="target epsilon: print the noise multiplier")
    pr.add_argument(
        "--noise-multiplier", type=float, help="noise multiplier sigma: print its epsilon"
    )
    pr.add_argument(
        "--delta",
        type=float,
        help="delta in (0, 1) (default, as in runs: min(N^-1.1, 0.01/N), "
        "N = --num-clients or 1000)",
    )
    pr.add_argument(
        "--sampling-rate", type=float, default=None, help="Poisson sampling probability q"
    )
    pr.add_argument("--rounds", type=int, required=True, help="number of rounds T")
    pr.add_argument(
        "--accountant",
        choices=["rdp", "pld"],
        help="default rdp; pld with --max-cohort (truncated Poisson)",
    )
    pr.add_argument(
        "--num-clients", type=int, help="population N (needed for --cohort-size, --max-cohort)"
    )
    pr.add_argument(
        "--cohort-size",
        type=int,
        help="fixed-size sampling of this many clients (replace-one; looser epsilon)",
    )
    pr.add_argument("--max-cohort", type=int, help="cap on the Poisson cohort (PLD)")
    pr.add_argument("--json", action="store_true", help="print one JSON object")

    cmp_ = sub.add_parser("compare", help="run several algorithms at one budget; one table")
    cmp_.add_argument(
        "--algorithms",
        "-a",
        default=None,
        type=checked(name_list, "--algorithms"),
        help="all, or a,b,c (default: all, or the preset's)",
    )
    _add_config_args(cmp_)
    cmp_.add_argument(
        "--epsilons",
        metavar="E1,E2,...",
        type=checked(number_list, "--epsilons"),
        help="run every algorithm at each target epsilon (DIR/eps<E>/...); table algorithm x eps",
    )
    cmp_.add_argument(
        "--scale",
        choices=["paper", "cpu", "real"],
        default=None,
        help="with a preset --config (experiments/*.yaml): the paper's setting (default), "
        "the CPU scale on the offline digits data, or the real scale (Fashion-MNIST)",
    )
    _add_out_arg(cmp_, "folder (default results/<timestamp>-compare)")
    cmp_.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        type=checked(seed_list, "--seeds"),
        help="run every algorithm with each seed (DIR/seed<S>/<algorithm>); "
        "the table shows mean ± std over seeds",
    )
    _add_executor_arg(cmp_)
    _add_overwrite_arg(cmp_)
    _add_resume_folder_arg(
        cmp_,
        "continue the comparison in DIR (or --out) with the settings it started with "
        "(compare.json; a flag given again must agree): finished runs are kept, interrupted "
        "ones continue from their checkpoints",
    )
    _add_console_args(cmp_)

    tu = sub.add_parser("tune", help="hyperparameter search at fixed budgets (Ray Tune)")
    tu.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        type=checked(nonempty, "--config"),
        help="YAML: config diff plus an optional tune: section",
    )
    # Flags default to None: a --resume takes what the folder recorded (tuning.cli_settings)
    tu.add_argument(
        "--algorithms",
        "-a",
        default=None,
        type=checked(name_list, "--algorithms"),
        help="all, or a,b,c (default dp_fedavg)",
    )
    tu.add_argument(
        "--epsilons",
        default=None,
        type=checked(number_list, "--epsilons"),
        help="comma-separated per-trial budgets, e.g. 1,4,8 (default 4)",
    )
    tu.add_argument(
        "--total-epsilon",
        default=None,
        metavar="E1,E2,...",
        type=checked(number_list, "--total-epsilon"),
        help="comma-separated total budgets instead: the epsilon of publishing the selected "
        "trial including the search; each trial's noise is solved from it (tune.total_epsilon)",
    )
    tu.add_argument(
        "--num-samples", type=int, default=None, help="trials per (algorithm, eps) (default 4)"
    )
    tu.add_argument("--search", choices=["random", "optuna", "hyperopt"], default=None)
    tu.add_argument("--scheduler", choices=["fifo", "asha"], default=None)
    tu.add_argument(
        "--runner",
        choices=["auto", "processes", "tune", "driver"],
        default=None,
        help="auto (default, or tune.runner in the YAML): processes for a random-search "
        "fifo sweep on this machine without a GPU, else tune; processes: trials in "
        "parallel in local processes started once; tune: through Ray Tune (any search, "
        "scheduler, a cluster); driver: one after another in this process",
    )
    tu.add_argument(
        "--tuning-privacy",
        choices=["compose", "poisson", "truncated_negative_binomial"],
        default=None,
        help="how the cost of tuning is accounted (default compose): compose = all trials run "
        "and are accounted (any search); poisson / truncated_negative_binomial = "
        "Papernot-Steinke: dpfl draws the number of trials (mean --num-samples), random "
        "search only, only the best trial is released (README: the privacy cost of tuning)",
    )
    tu.add_argument(
        "--tnb-shape",
        type=float,
        default=None,
        help="shape eta of the truncated negative binomial (0 = logarithmic, 1 = geometric; "
        "default 1)",
    )
    tu.add_argument("--metric", choices=TUNE_METRICS, default=None)
    tu.add_argument(
        "--allow-nonprivate-metric",
        action="store_true",
        help="let --metric be a *_nonprivate metric (selection then leaks clients' data)",
    )
    _add_out_arg(tu, "experiment folder (default results/<timestamp>-tune)")
    _add_resume_folder_arg(
        tu,
        "continue the experiment in DIR (or --out) with the settings it started with; "
        "a flag given again must agree",
    )
    _add_overwrite_arg(tu)
    tu.add_argument("--smoke-test", action="store_true", help="2 rounds, small data")
    tu.add_argument(
        "--set", "-s", action="append", default=[], metavar="KEY=VALUE", help="override a key"
    )
    tu.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help=f"show Ray's console output (default: kept in {RAY_LOG} in the results folder)",
    )

    rp = sub.add_parser("report", help="best configuration per (algorithm, eps), plots")
    rp.add_argument(
        "dir", metavar="DIR", type=checked(nonempty, "DIR"), help="a dpfl tune output folder"
    )
    rp.add_argument("--metric", default="test_accuracy", help="a metric the trials were tuned for")
    rp.add_argument(
        "--watch",
        action="store_true",
        help="live view of a running sweep: redraw live_accuracy_vs_{epsilon,round}.png "
        "in DIR every --interval s and print trials done/running/pending, until it ends",
    )
    rp.add_argument("--interval", type=float, default=5.0, help="seconds between redraws (--watch)")
    rp.add_argument(
        "--iterations", type=int, help="stop --watch after this many redraws (default: at the end)"
    )

    lb = sub.add_parser(
        "leaderboard",
        help="methods x total epsilon: each tuned under a budget that pays for the tuning, "
        "selected on a public validation set, compared over paired seeds",
        description="docs/leaderboard.md: the protocol, the decision rule, the threat model.",
    )
    _add_config_args(lb)  # the YAML: a config diff plus a leaderboard: section
    lb.add_argument(
        "--methods",
        "-a",
        type=checked(name_list, "--methods"),
        help="private recipes to rank, a,b,c (leaderboard.methods)",
    )
    lb.add_argument(
        "--baseline",
        type=checked(nonempty, "--baseline"),
        help="the method others are paired against (dp_fedavg)",
    )
    lb.add_argument(
        "--total-epsilon",
        metavar="E1,E2,...",
        type=checked(number_list, "--total-epsilon"),
        help="total budgets (leaderboard.total_epsilons)",
    )
    lb.add_argument(
        "--trials", type=int, help="trials per cell (their mean under Papernot-Steinke)"
    )
    lb.add_argument("--seeds", type=int, help="fresh seeds for the selected configuration (5)")
    lb.add_argument(
        "--processes",
        type=int,
        help="runs at once, each in its own process (default: one per CPU with "
        "ray.executor=local, else 1); results do not depend on it",
    )
    lb.add_argument(
        "--tuning-privacy",
        choices=["compose", "poisson", "truncated_negative_binomial"],
        help="how the search is paid for (compose: every trial accounted)",
    )
    _add_out_arg(lb, "a new folder (default results/<time>-leaderboard)")
    _add_resume_folder_arg(
        lb,
        "continue the leaderboard in DIR (or --out) with its settings: finished runs "
        "are kept, interrupted ones continue from their checkpoints",
    )
    _add_console_args(lb)

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

    al = sub.add_parser("algorithms", help="list the algorithms and their papers")
    al.add_argument(
        "--references", action="store_true", help="also print each paper's full reference"
    )
    al.add_argument(
        "--markdown",
        action="store_true",
        help="print the README's algorithms table from the recipe registry (imports torch)",
    )

    cf = sub.add_parser(
        "config",
        help="print the configuration as YAML, one comment per key",
        description="Print the default configuration (or the one --config/--set give) as "
        "YAML with one comment per key; save it, edit it, pass it back with --config.",
    )
    _add_config_args(cf)
    return p
