"""Algorithms: one recipe per method, named as on the command line.

This release ships the baselines of ALGORITHMS.md §1. A recipe records what a
method is and whether it is private; the engine (``engine.simulate``) fixes the
order of its pieces: local training → Δ → clip → noise on the sum → fixed public
denominator → server update → the accountant composes the round's event.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """A method: its CLI name, one-line summary, paper, and privacy."""

    name: str
    summary: str
    paper: str
    private: bool


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "fedavg",
            "FedAvg: local SGD, server averages the updates (not private)",
            "McMahan et al., AISTATS 2017",
            private=False,
        ),
        Recipe(
            "dp_fedavg",
            "DP-FedAvg: whole-update clipping, central Gaussian noise, fixed denominator",
            "McMahan et al., ICLR 2018",
            private=True,
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"algorithm={name!r} is not one of {', '.join(RECIPES)}")
    return RECIPES[name]
