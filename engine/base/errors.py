"""The one error a bad configuration raises, and the check that raises it (and the
error of work that ran and failed in part, :class:`RunFailed`).

A leaf module (it imports nothing from dpfl), so every room can name a bad value the
same way: :mod:`algorithms.compose` checks a ``recipe:`` section with it and
:mod:`engine.config` every other key.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "RunFailed", "check"]


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key."""


class RunFailed(Exception):
    """Work that ran and failed in part (e.g. trials of a sweep); the message, one
    line, says what failed, why, and how to continue. The CLI exits with status 1."""


def check(cond: bool, key: str, value: Any, why: str) -> None:
    """Raise :class:`ConfigError` ``key=value: why`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")
