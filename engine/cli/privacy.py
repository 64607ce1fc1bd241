"""``dpfl privacy``: the noise multiplier for a budget, or the epsilon of a noise
multiplier, from the accountant alone (no config, no data, no Ray)."""

from __future__ import annotations

import argparse
import json
import sys

from engine.config import ConfigError


def privacy_command(args: argparse.Namespace) -> int:
    """``dpfl privacy``: calibrate sigma for ``--epsilon`` or account ``--noise-multiplier``."""
    from engine.config import DatasetConfig
    from engine.privacy.accounting import SamplingSpec, default_delta
    from engine.privacy.resolve import resolve_privacy

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
