"""The settings of a leaderboard: the YAML's ``leaderboard:`` section, flags over it.

Everything is checked here, before any folder, budget or run: every name and number
is refused in one line naming its key (``leaderboard.<key>`` or the flag).
``docs/leaderboard.md`` states what each setting means for the protocol.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import ConfigError
from tuning import selection
from tuning.spaces import COMMON

#: The rounds grid searched for every method (under a fixed ε the number of rounds
#: trades against the noise per round, so it is searched like a learning rate).
DEFAULT_ROUNDS = (50, 100, 200, 400)
#: The keys every method shares: drawn identically for trial k of every method.
SHARED_KEYS = ("local.lr", "privacy.clip_norm", "local.epochs", "rounds")
#: What a trial is selected on: the public validation set (``dataset.validation_size``).
SELECTION_METRIC = "val_accuracy"
#: What a personalised method is selected and scored on (its clients' own held-out data:
#: neither covered by ε; labelled so wherever it appears).
PERSONAL_METRIC = "personal_accuracy_nonprivate"
KNOWN = {
    "methods",
    "baseline",
    "total_epsilons",
    "trials",
    "seeds",
    "tuning_privacy",
    "tnb_shape",
    "rounds",
    "shared_space",
    "space",
    "references",
    "personal",
}


@dataclass(frozen=True)
class LeaderboardSettings:
    """One leaderboard (``docs/leaderboard.md``, "Protocol"): ``methods`` (private
    recipes that train one global model) × ``total_epsilons``, each cell a private
    search of ``trials`` trials (their mean under Papernot-Steinke) over the shared
    ``shared_space`` (the ``rounds`` grid included) and each method's own range
    (``space`` overrides it per recipe), selected on the public validation set and
    re-run on ``seeds`` fresh seeds; ``baseline`` is the method every other is paired
    against; ``references`` (non-private) and ``personal`` (personalised) recipes are
    reported beside, not ranked with the rest."""

    methods: tuple[str, ...]
    baseline: str = "dp_fedavg"
    total_epsilons: tuple[float, ...] = (4.0,)
    trials: int = 8
    seeds: int = 5
    tuning_privacy: str = selection.COMPOSE
    tnb_shape: float = 1.0
    rounds: tuple[int, ...] = DEFAULT_ROUNDS
    shared_space: dict[str, dict[str, Any]] = field(default_factory=dict)
    space: dict[str, dict[str, Any]] = field(default_factory=dict)
    references: tuple[str, ...] = ()
    personal: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """JSON-ready (``leaderboard.json``)."""
        return json_ready(asdict(self))

    def shared(self) -> dict[str, dict[str, Any]]:
        """The shared search space: the ranges of ``shared_space`` (default: dpfl tune's
        common ranges) and the rounds grid as a choice."""
        space = copy.deepcopy(COMMON)
        space.update(copy.deepcopy(self.shared_space))
        space["rounds"] = {"type": "choice", "values": list(self.rounds)}
        return space


def json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _names(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}={value!r}: expected a list of recipe names")
    return tuple(value)


def _numbers(value: Any, key: str, kind: type) -> tuple:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    try:
        out = tuple(kind(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected a list of numbers") from None
    if not out:
        raise ConfigError(f"{key}={value!r}: expected at least one value")
    return out


def settings_from(section: dict[str, Any], flags: dict[str, Any]) -> LeaderboardSettings:
    """The settings of the YAML's ``leaderboard:`` ``section`` with ``flags`` (the
    command line's, None where not given) over it, checked."""
    unknown = sorted(set(section) - KNOWN)
    if unknown:
        raise ConfigError(
            f"leaderboard.{unknown[0]}: unknown key (known: {', '.join(sorted(KNOWN))})"
        )
    merged = {**section, **{k: v for k, v in flags.items() if v is not None}}
    if "methods" not in merged:
        raise ConfigError("leaderboard.methods: give the recipes to rank (or --methods a,b,c)")
    s = LeaderboardSettings(
        methods=_names(merged["methods"], "leaderboard.methods"),
        baseline=str(merged.get("baseline", "dp_fedavg")),
        total_epsilons=_numbers(
            merged.get("total_epsilons", (4.0,)), "leaderboard.total_epsilons", float
        ),
        trials=int(merged.get("trials", 8)),
        seeds=int(merged.get("seeds", 5)),
        tuning_privacy=str(merged.get("tuning_privacy", selection.COMPOSE)),
        tnb_shape=float(merged.get("tnb_shape", 1.0)),
        rounds=_numbers(merged.get("rounds", DEFAULT_ROUNDS), "leaderboard.rounds", int),
        shared_space=dict(merged.get("shared_space") or {}),
        space=dict(merged.get("space") or {}),
        references=_names(merged.get("references", ()), "leaderboard.references"),
        personal=_names(merged.get("personal", ()), "leaderboard.personal"),
    )
    check(s)
    return s


def check(s: LeaderboardSettings) -> None:
    """Refuse, in one line naming the key, what the protocol cannot run."""
    from algorithms import RECIPES
    from algorithms.catalog import CATALOG

    for key, names in (
        ("methods", s.methods),
        ("references", s.references),
        ("personal", s.personal),
    ):
        unknown = [n for n in names if n not in RECIPES]
        if unknown:
            raise ConfigError(f"leaderboard.{key}: unknown recipe {unknown[0]!r} (dpfl algorithms)")
    for n in s.methods:
        if not RECIPES[n].private or CATALOG[n].personal:
            raise ConfigError(
                f"leaderboard.methods: {n} is "
                + (
                    "personalised (list it under leaderboard.personal)"
                    if CATALOG[n].personal
                    else "not private (list it under leaderboard.references)"
                )
            )
    for n in s.references:
        if RECIPES[n].private:
            raise ConfigError(
                f"leaderboard.references: {n} is private (rank it under leaderboard.methods)"
            )
    for n in s.personal:
        if not (RECIPES[n].private and CATALOG[n].personal):
            raise ConfigError(f"leaderboard.personal: {n} is not a private personalised recipe")
    every = [*s.methods, *s.references, *s.personal]
    if len(set(every)) != len(every):
        raise ConfigError("leaderboard: a recipe is listed twice")
    if s.baseline not in s.methods:
        raise ConfigError(
            f"leaderboard.baseline={s.baseline!r}: must be one of leaderboard.methods"
        )
    if any(not (e > 0 and math.isfinite(e)) for e in s.total_epsilons):
        raise ConfigError(
            f"leaderboard.total_epsilons={list(s.total_epsilons)}: each must be finite and > 0"
        )
    if s.trials < 1:
        raise ConfigError(f"leaderboard.trials={s.trials}: must be >= 1")
    if s.seeds < 2:
        raise ConfigError(f"leaderboard.seeds={s.seeds}: must be >= 2 (an interval needs two)")
    if s.tuning_privacy not in selection.MODES:
        raise ConfigError(
            f"leaderboard.tuning_privacy={s.tuning_privacy!r}: must be one of "
            + ", ".join(selection.MODES)
        )
    if any(r < 1 for r in s.rounds) or len(set(s.rounds)) != len(s.rounds):
        raise ConfigError(f"leaderboard.rounds={list(s.rounds)}: distinct round counts >= 1")
    shared_keys = set(s.shared())
    if shared_keys - set(SHARED_KEYS):
        extra = sorted(shared_keys - set(SHARED_KEYS))[0]
        raise ConfigError(
            f"leaderboard.shared_space.{extra}: the shared keys are {', '.join(SHARED_KEYS)}"
        )
    for recipe, own in s.space.items():
        if recipe not in every:
            raise ConfigError(f"leaderboard.space.{recipe}: not a recipe of this leaderboard")
        clash = sorted(set(own or {}) & set(SHARED_KEYS))
        if clash:
            raise ConfigError(
                f"leaderboard.space.{recipe}.{clash[0]}: a shared key (leaderboard.shared_space)"
            )
