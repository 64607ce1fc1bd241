"""The ``algo:`` section: the recipes' hyperparameters, declared by the pieces that read
them (:mod:`algorithms.registry`); ``None`` means the recipe's (paper's) default.

:class:`AlgoConfig` is a frozen dataclass made from the registry's keys, in their order,
each validated by its declaration (one rule and one message per key). A piece registered
later (an extension, a test's toy piece) adds its keys: :func:`algo_config_class` gives
the class for the registry as it is now, the same class object for the same keys, and
:data:`AlgoConfig` names the class of the built-in pieces (and, while a piece is
registered, the class with its keys, so that configs holding them pickle by name).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from algorithms import registry
from algorithms.spec import Key

_CLASSES: dict[tuple[Key, ...], type] = {}


def _post_init(self: Any) -> None:
    for key in registry.algo_keys():
        if hasattr(self, key.name):
            key.check(getattr(self, key.name))


def algo_config_class() -> type:
    """The ``algo:`` section's dataclass for the currently registered keys."""
    keys = registry.algo_keys()
    cls = _CLASSES.get(keys)
    if cls is None:
        cls = dataclasses.make_dataclass(
            "AlgoConfig",
            [(k.name, k.type, dataclasses.field(default=k.default)) for k in keys],
            namespace={"__post_init__": _post_init, "__doc__": __doc__},
            frozen=True,
            kw_only=True,
        )
        cls.__module__ = __name__
        _CLASSES[keys] = cls
    globals()["AlgoConfig"] = cls  # what pickle finds by name
    return cls


#: The ``algo:`` section's class (see :func:`algo_config_class`), kept current.
AlgoConfig: Any = algo_config_class()
registry.on_change(algo_config_class)
