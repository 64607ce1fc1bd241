"""What a piece declares about itself (:class:`PieceSpec`) and its config keys (:class:`Key`).

:mod:`algorithms.registry` holds the declared pieces; everything that lists pieces or
``algo.*`` keys derives from it. Plain data, no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The kinds of piece: the client's (a step rule, a regularizer, a constraint, client
#: transforms, the personal split), the server's transforms, and the three extension
#: points of a round — how the aggregate moves the model (``server_step``,
#: algorithms.server_step), what a round's noise draw is and costs (``noise``,
#: engine.privacy.noise) and who takes part (``participation``,
#: engine.privacy.participation).
KINDS = (
    "step",
    "regularizer",
    "constraint",
    "client_transform",
    "server_transform",
    "personal",
    "server_step",
    "noise",
    "participation",
)


@dataclass(frozen=True)
class Key:
    """One ``algo.<name>`` config key. ``valid(value)`` is the rule (never called with
    ``None`` when ``default`` is ``None``: null means the recipe's default); ``rule`` is
    the error text, e.g. ``must be >= 0``."""

    name: str
    type: Any
    default: Any
    help: str
    valid: Callable[[Any], bool] | None = None
    rule: str = ""

    def check(self, value: Any) -> None:
        """ConfigError ``algo.<name>=<value>: <rule>`` unless ``value`` is valid."""
        if self.valid is None or (value is None and self.default is None):
            return
        if not self.valid(value):
            from engine.base.errors import ConfigError  # here: importing engine loads engine.config

            raise ConfigError(f"algo.{self.name}={value!r}: {self.rule}")


@dataclass(frozen=True)
class BuildContext:
    """What a builder may read besides the ``algo:`` section (public config only)."""

    clip_norm: float  # C, or inf for a non-private recipe
    model_name: str | None
    recipe: Any  # the algorithms.compose.RecipeConfig being built
    #: a participation's builder reads these (engine.simulation.privacy_plan)
    sampling: Any = None  # the config's sampling: section
    num_clients: int = 0  # N
    rounds: int = 0  # T


@dataclass(frozen=True)
class PieceSpec:
    """One piece, declared once.

    ``piece``: ``"module:Class"`` of the object :attr:`build` returns (imported only when
    needed); ``build(cls, algo, ctx)`` makes it from the ``algo:`` section;
    ``report(obj, pipeline)`` gives its resolved hyperparameters (keyed by the key's last
    part: the ``rounds.parquet`` columns); ``space``: default Tune ranges by config key.
    A participation's builder also reads the run's sampling section, N and rounds from
    its :class:`BuildContext`."""

    name: str
    kind: str
    piece: str
    build: Callable[[type, Any, BuildContext], Any]
    keys: tuple[Key, ...] = ()
    space: dict[str, dict[str, Any]] = field(default_factory=dict)
    report: Callable[[Any, Any], dict[str, Any]] = lambda obj, pipeline: {}
    #: a step rule that brings more pieces with it (its method's transforms and
    #: server step): ``extend(built_step, parts)`` edits the pipeline's parts
    extend: Callable[[Any, dict[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"piece {self.name!r}: kind {self.kind!r} is not one of {KINDS}")

    def piece_class(self) -> type:
        module, _, name = self.piece.partition(":")
        return getattr(importlib.import_module(module), name)
