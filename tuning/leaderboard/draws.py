"""Paired draws: trial k of every method gets the same values of the shared keys.

The shared keys (learning rate, clip norm, local epochs, rounds) of trial k come from
one seeded stream keyed by (experiment seed, k) only, so trial k of every method, at
every total ε, starts from the same shared values; a method's own keys (SAM's ρ,
BLUR's λ, ...) come from that method's stream, keyed by (seed, method, k). Methods then
differ by their own keys alone, and a comparison of two methods is paired, not a contest
of search luck. The run seeds are shared the same way: trial k of every method runs
with seed ``trial_seed(seed, k)`` (the same initial model, cohorts and minibatch order
wherever the methods use them), seed run j with ``eval_seed(seed, j)``, so the seed runs
of two methods are paired too. None of these draws reads a result, so the whole search
is fixed before any trial runs (the accounting of composition and Papernot-Steinke
assumes a non-adaptive search).
"""

from __future__ import annotations

import zlib
from typing import Any

from engine.config import CUSTOM
from engine.privacy import rng as rngs
from tuning.spaces import sample, space_for

#: Sub-streams of ``engine.privacy.rng.LEADERBOARD``.
SHARED, OWN, TRIAL_SEEDS, EVAL_SEEDS, TRIAL_COUNT = 1, 2, 3, 4, 5


def _method_key(method: str) -> int:
    return zlib.crc32(method.encode())


def shared_values(seed: int, k: int, shared_space: dict[str, Any]) -> dict[str, Any]:
    """Trial k's shared values: a function of (seed, k) alone."""
    return sample(shared_space, rngs.numpy_rng(seed, rngs.LEADERBOARD, SHARED, k))


def own_space(method: str, overrides: dict[str, Any], shared_keys: tuple[str, ...]) -> dict:
    """A method's own search space: its recipe's ranges (``tuning.spaces``) without the
    shared keys, with ``overrides`` (``leaderboard.space.<method>``; null removes)."""
    space = space_for(method, {method: overrides} if overrides else None)
    return {k: v for k, v in space.items() if k not in shared_keys}


def own_values(seed: int, method: str, k: int, space: dict[str, Any]) -> dict[str, Any]:
    """Trial k's values of ``method``'s own keys, from ``method``'s stream."""
    if method == CUSTOM:  # pragma: no cover - the leaderboard ranks built-in recipes
        raise ValueError("custom recipes are not ranked")
    return sample(space, rngs.numpy_rng(seed, rngs.LEADERBOARD, OWN, _method_key(method), k))


def trial_params(
    seed: int,
    method: str,
    k: int,
    shared_space: dict[str, Any],
    space: dict[str, Any],
    private: bool,
) -> dict[str, Any]:
    """Every hyperparameter of trial k of ``method`` (config key → value): the shared
    values (without the clip norm for a non-private method, which clips nothing) and the
    method's own."""
    shared = shared_values(seed, k, shared_space)
    if not private:
        shared.pop("privacy.clip_norm", None)
    return {**shared, **own_values(seed, method, k, space)}


def trial_seed(seed: int, k: int) -> int:
    """The run seed of trial k, the same for every method."""
    return rngs.derive_seed(seed, rngs.LEADERBOARD, TRIAL_SEEDS, k)


def eval_seed(seed: int, j: int) -> int:
    """The run seed of seed run j of a selected configuration, the same for every
    method (fresh: never a trial's)."""
    return rngs.derive_seed(seed, rngs.LEADERBOARD, EVAL_SEEDS, j)


def number_of_trials(seed: int, total: float, mode: str, trials: int, shape: float) -> int:
    """Trials of every method at total budget ``total``: ``trials`` under composition;
    under Papernot-Steinke K drawn once per total ε with mean ``trials`` (the same K for
    every method, so none has more trials than another). A seeded simulation: K is
    recorded in the leaderboard's files, which therefore are not a release."""
    from tuning import selection

    if not selection.is_papernot_steinke(mode):
        return trials
    key = zlib.crc32(f"{total:g}".encode())
    return selection.draw_num_trials(
        mode, trials, shape, rngs.numpy_rng(seed, rngs.LEADERBOARD, TRIAL_COUNT, key)
    )
