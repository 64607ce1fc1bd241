"""``dpfl privacy``: the noise multiplier for a budget, or the epsilon of a noise
multiplier, from the accountant alone (no config, no data, no Ray)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from engine.config import ConfigError


def check_flags(args: argparse.Namespace) -> None:
    """Every flag's value and their combination, as ``dpfl run`` checks the same keys
    (``privacy.epsilon``, ``privacy.noise_multiplier``, ``sampling.*``): one line naming
    the flag; never a value silently ignored."""
    if args.cohort_size is None and args.sampling_rate is None:
        raise ConfigError("--sampling-rate is required (or --cohort-size with --num-clients)")
    if args.cohort_size is not None and args.sampling_rate is not None:
        raise ConfigError(
            f"--cohort-size={args.cohort_size} (fixed-size cohorts) and --sampling-rate="
            f"{args.sampling_rate:g} (Poisson sampling) are two samplings; give one"
        )
    if args.cohort_size is not None and args.max_cohort is not None:
        raise ConfigError(
            f"--max-cohort={args.max_cohort} caps a Poisson cohort; --cohort-size draws a "
            "fixed one: give one"
        )
    if (args.epsilon is None) == (args.noise_multiplier is None):
        raise ConfigError("give exactly one of --epsilon and --noise-multiplier")
    if args.epsilon is not None and not (math.isfinite(args.epsilon) and args.epsilon > 0):
        raise ConfigError(f"--epsilon={args.epsilon}: must be a finite number > 0")
    z = args.noise_multiplier
    if z is not None and not (math.isfinite(z) and z >= 0):
        raise ConfigError(f"--noise-multiplier={z}: must be a finite number >= 0")
    q = args.sampling_rate
    if q is not None and not 0 < q <= 1:
        raise ConfigError(f"--sampling-rate={q}: must be in (0, 1]")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds}: must be >= 1")
    n = args.num_clients
    if n is not None and n < 1:
        raise ConfigError(f"--num-clients={n}: must be >= 1")
    if n is None and (args.cohort_size is not None or args.max_cohort is not None):
        raise ConfigError("--num-clients is required with --cohort-size or --max-cohort")
    for flag, value in (("--cohort-size", args.cohort_size), ("--max-cohort", args.max_cohort)):
        if value is not None and not 1 <= value <= (n or value):
            raise ConfigError(f"{flag}={value}: must be in [1, --num-clients={n}]")
    if args.cohort_size is not None and args.accountant == "pld":
        raise ConfigError(
            "--accountant=pld: fixed-size sampling (--cohort-size) is accounted by RDP only"
        )
    if args.max_cohort is not None and args.accountant == "rdp":
        raise ConfigError(
            "--accountant=rdp: a capped Poisson cohort (--max-cohort) is accounted by PLD only"
        )


def privacy_command(args: argparse.Namespace) -> int:
    """``dpfl privacy``: calibrate sigma for ``--epsilon`` or account ``--noise-multiplier``."""
    check_flags(args)  # before the accountant's import (dp-accounting, SciPy)
    from engine.config import DatasetConfig
    from engine.privacy.accounting import SamplingSpec, default_delta
    from engine.privacy.resolve import resolve_privacy

    num_clients = args.num_clients
    # delta defaults as in runs (default_delta), N = --num-clients (default dataset.num_clients)
    population = num_clients if num_clients is not None else DatasetConfig().num_clients
    delta = args.delta if args.delta is not None else default_delta(population)
    if not 0 < delta < 1:  # NaN included
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
        z_given = args.noise_multiplier if args.epsilon is None else None
        r = resolve_privacy(  # the one resolver of (epsilon, delta, z): engine.privacy.resolve
            spec,
            args.rounds,
            epsilon=args.epsilon,
            delta=delta,
            noise_multiplier=z_given,
            accountant=args.accountant,
        )
    except ValueError as e:  # CalibrationError included
        raise ConfigError(str(e)) from None
    z, eps, accountant = r.noise_multiplier, r.epsilon, r.accountant
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
