"""Algorithms: the pieces each method is made of and one recipe per method.

``RECIPES`` maps each CLI name (``dpfl algorithms``) to its :class:`Recipe`;
:func:`build_pipeline` assembles a recipe's pieces. The engine fixes their order.
The names below are loaded on first use, so importing :mod:`algorithms.catalog` (what
``dpfl algorithms`` prints) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from algorithms.recipes import RECIPES, Recipe, build_pipeline, get_recipe

__all__ = ["RECIPES", "Recipe", "build_pipeline", "get_recipe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from algorithms import recipes

        return getattr(recipes, name)
    raise AttributeError(f"module 'algorithms' has no attribute {name!r}")
