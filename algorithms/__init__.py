"""Algorithms: the pieces each method is made of and one recipe per method.

``RECIPES`` maps each CLI name (``dpfl algorithms``) to its :class:`Recipe`;
:func:`build_pipeline` assembles a recipe's pieces. The engine fixes their order.
"""

from __future__ import annotations

from algorithms.recipes import RECIPES, Recipe, build_pipeline, get_recipe

__all__ = ["RECIPES", "Recipe", "build_pipeline", "get_recipe"]
