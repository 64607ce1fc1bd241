"""Pieces declare themselves once: a :class:`PieceSpec` per piece, one registry.

A piece (a step rule, a regularizer, a constraint, a client or server transform, the
personal split) is declared by one :class:`PieceSpec`: its name and kind, the ``algo.*``
keys it reads (each a :class:`Key` with its type, default, one line of help and its
validation), its default Tune ranges, how it is built from the ``algo:`` section, and
what it reports as resolved hyperparameters (the ``rounds.parquet`` columns). Everything
else derives from the registry: the names a ``recipe:`` section accepts and
:func:`algorithms.compose.build`, the ``algo:`` section of the config tree
(:mod:`engine.config.algo`) with its checks and its ``dpfl config`` help, the Tune spaces
(:mod:`tuning.spaces`) and :func:`algorithms.recipes.resolved_hyperparameters`.

Adding a piece: its module (the piece and its spec) and one line of the registry below
(the built-in specs are in :mod:`algorithms.piece_specs`, a method's in its module under
the methods' modules in ``algorithms``); an extension registers its spec with :func:`register`. The
kinds include a round's extension points: server steps, noise schemes and
participations (:data:`algorithms.spec.KINDS`). Specs are plain data and their builders
import torch only when they run, so the config can be read without torch.

Privacy: a key's validation only bounds a hyperparameter; clipping and noise are the
privatizer's (docs/algorithms.md §0), whatever pieces a recipe names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from algorithms import dp_bandmf, dp_fedpgn, dp_ftrl
from algorithms.piece_specs import (
    ALGO_KEYS,
    BALL,
    BLUR,
    FEDAVG,
    GAUSSIAN,
    LAPLACIAN_SMOOTHING,
    LUS,
    PERSONAL,
    RANDK,
    SAM,
    SAMPLED,
    SERVER_TOPK,
    SGD,
    TOPK,
)
from algorithms.spec import Key, PieceSpec

#: The registry: one line per piece (engine order within a kind), then each method
#: module's pieces (the methods' modules in algorithms: one line per method).
_REGISTRY: dict[str, PieceSpec] = {
    s.name: s
    for s in (
        SGD,
        SAM,
        BLUR,
        BALL,
        TOPK,
        RANDK,
        LUS,
        LAPLACIAN_SMOOTHING,
        SERVER_TOPK,
        PERSONAL,
        FEDAVG,
        GAUSSIAN,
        SAMPLED,
        *dp_fedpgn.SPECS,
        *dp_ftrl.SPECS,
        *dp_bandmf.SPECS,
    )
}
#: The built-in ``algo.*`` keys, in the ``algo:`` section's order.
_ALGO_KEYS: tuple[Key, ...] = ALGO_KEYS


def register(spec: PieceSpec) -> None:
    """Add ``spec``; a key it shares with a registered piece must be the same Key."""
    if spec.name in _REGISTRY:
        raise ValueError(f"piece {spec.name!r} is already registered")
    known = {k.name: k for k in algo_keys()}
    for key in spec.keys:
        if key.name in known and known[key.name] != key:
            raise ValueError(f"piece {spec.name!r}: algo.{key.name} differs from its declaration")
    _REGISTRY[spec.name] = spec
    _changed()


def unregister(name: str) -> None:
    del _REGISTRY[name]
    _changed()


_LISTENERS: list[Callable[[], Any]] = []


def on_change(listener: Callable[[], Any]) -> None:
    """Call ``listener()`` after every :func:`register` and :func:`unregister` (the
    config's ``algo:`` class follows the registry: engine.config.algo)."""
    _LISTENERS.append(listener)


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


@contextmanager
def registered(spec: PieceSpec) -> Iterator[PieceSpec]:
    """``spec`` registered for the duration of a ``with`` block (tests, notebooks)."""
    register(spec)
    try:
        yield spec
    finally:
        unregister(spec.name)


def specs() -> tuple[PieceSpec, ...]:
    return tuple(_REGISTRY.values())


def spec(name: str) -> PieceSpec:
    return _REGISTRY[name]


def names(kind: str) -> tuple[str, ...]:
    """The registered pieces of ``kind``, in registry order."""
    return tuple(s.name for s in _REGISTRY.values() if s.kind == kind)


def algo_keys() -> tuple[Key, ...]:
    """Every ``algo.*`` key, once: the built-in keys in their declared order
    (:data:`algorithms.piece_specs.ALGO_KEYS`), then a registered
    piece's new keys, in registry order."""
    out: dict[str, Key] = {k.name: k for k in _ALGO_KEYS}
    for s in _REGISTRY.values():
        for k in s.keys:
            out.setdefault(k.name, k)
    return tuple(out.values())


def key_help() -> dict[str, str]:
    """``{"algo.<name>": help}`` for every key (``dpfl config``, docs/reference/config.md)."""
    return {f"algo.{k.name}": k.help for k in algo_keys()}


def defaults() -> SimpleNamespace:
    """An ``algo:`` section holding every key's default (a recipe's default spelling)."""
    return SimpleNamespace(**{k.name: k.default for k in algo_keys()})


def piece_keys(name: str) -> tuple[str, ...]:
    """The ``algo.*`` keys (last part) piece ``name`` reads."""
    return tuple(k.name for k in _REGISTRY[name].keys)


def space(piece_names: list[str]) -> dict[str, dict[str, Any]]:
    """The default Tune ranges of the named pieces (a later piece's range wins)."""
    out: dict[str, dict[str, Any]] = {}
    for n in piece_names:
        if n in _REGISTRY:
            out.update(_REGISTRY[n].space)
    return out


def report(obj: Any, pipeline: Any) -> dict[str, Any]:
    """The resolved hyperparameters of one built piece: its spec's report, or for a
    piece no spec built (one a step rule brought) its own ``report()``, else ``{}``."""
    if obj is None:
        return {}
    for s in _REGISTRY.values():
        if s.kind != "participation" and type(obj) is s.piece_class():
            return s.report(obj, pipeline)
    own = getattr(obj, "report", None)
    return own() if callable(own) else {}
