"""Paper presets (``experiments/*.yaml``): one file per paper table, at two scales.

A preset is a ``--config`` file with a top-level ``preset:`` section; everything else
in the file is an ordinary config diff shared by both scales::

    preset:
      paper: Liang et al., DP-Fed-LS           # who claims it
      table: MNIST logistic regression         # which table / figure
      claim: dp_fed_ls >= dp_fedavg at every epsilon
      algorithms: [dp_fedavg, dp_fed_ls]       # the table's rows
      epsilons: [1, 6]                         # its columns (privacy.epsilon targets)
      scales:
        paper: {dataset: {...}, rounds: 30}    # as the paper states it (full data)
        cpu: {dataset: {name: digits}, ...}    # runs in minutes on a laptop CPU
    model: {name: logreg}                      # shared config diff
    ...

A row may be a *variant* rather than a recipe: ``variants:`` maps a row name to a
config diff with its own ``algorithm`` (FedAvg's table compares local-step settings
of one recipe, e.g. ``fedsgd: {algorithm: fedavg, local: {epochs: 1, batch_size:
600}}``); the diff applies on top of the scale's config for that row only.

A scale may set its own ``epsilons`` (e.g. fewer columns at CPU scale); otherwise the
preset's apply. ``dpfl compare --config experiments/X.yaml [--scale cpu] --seeds 0,1,2``
runs every algorithm at every ε and prints the table algorithm × ε with mean ± std.
Each ε is a *target*: σ is calibrated to it by the accountant for the run's own
sampling and rounds, and the table reports the ε the accountant computed (never the
target itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError
from engine.config.loading import merge_trees, read_yaml_mapping

PRESET_KEY = "preset"
SCALES = ("paper", "cpu", "real")


@dataclass(frozen=True)
class Preset:
    """A parsed preset file (see the module docstring)."""

    path: str
    paper: str
    table: str
    claim: str
    algorithms: tuple[str, ...]
    epsilons: tuple[float, ...]
    scales: dict[str, dict[str, Any]]
    common: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)

    def recipe(self, row: str) -> str:
        """The recipe a row of the table runs (a variant's ``algorithm``, or the row)."""
        return str(self.variants.get(row, {}).get("algorithm", row))

    def tree(self, scale: str) -> dict[str, Any]:
        """The config diff of ``scale`` (common part, then the scale's keys)."""
        if scale not in self.scales:
            raise ConfigError(
                f"--scale={scale!r}: {self.path} defines {', '.join(self.scales) or 'no'} scales"
            )
        body = {k: v for k, v in self.scales[scale].items() if k != "epsilons"}
        return merge_trees(json.loads(json.dumps(self.common)), body)

    def scale_epsilons(self, scale: str) -> tuple[float, ...]:
        own = self.scales.get(scale, {}).get("epsilons")
        if own is None:
            return self.epsilons
        return tuple(_floats(own, f"preset.scales.{scale}.epsilons"))


def _floats(values: Any, key: str) -> list[float]:
    """Target epsilons; ``[]`` means one column at the config's own privacy settings
    (a table stated by σ rather than by ε)."""
    if not isinstance(values, list):
        raise ConfigError(f"{key}={values!r}: expected a list of numbers")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{key}={values!r}: every epsilon must be a number > 0")
        out.append(float(v))
    return out


def read_preset(path: str | Path) -> Preset | None:
    """The preset in ``path``, or ``None`` when the file has no ``preset:`` section."""
    data = read_yaml_mapping(path)
    section = data.get(PRESET_KEY)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"preset={section!r}: expected a mapping in {path}")
    for key in ("paper", "table", "claim", "algorithms", "epsilons", "scales"):
        if key not in section:
            raise ConfigError(f"preset.{key}: missing in {path}")
    algorithms = section["algorithms"]
    if not isinstance(algorithms, list) or not algorithms:
        raise ConfigError(f"preset.algorithms={algorithms!r}: expected a non-empty list")
    scales = section["scales"]
    if not isinstance(scales, dict) or not all(isinstance(v, dict) for v in scales.values()):
        raise ConfigError(f"preset.scales={scales!r}: expected a mapping of scale -> config")
    unknown = [s for s in scales if s not in SCALES]
    if unknown:
        raise ConfigError(f"preset.scales: unknown scale(s) {unknown}; known: {SCALES}")
    variants = section.get("variants") or {}
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        raise ConfigError(f"preset.variants={variants!r}: expected a mapping of row -> config")
    from algorithms import RECIPES

    for row, diff in variants.items():
        if diff.get("algorithm") not in RECIPES:
            raise ConfigError(
                f"preset.variants.{row}.algorithm={diff.get('algorithm')!r}: "
                f"expected a recipe name ({', '.join(RECIPES)})"
            )
    missing = [a for a in algorithms if a not in RECIPES and a not in variants]
    if missing:
        raise ConfigError(
            f"preset.algorithms: {missing} are neither recipes nor preset.variants in {path}"
        )
    known = {"paper", "table", "claim", "algorithms", "epsilons", "scales", "variants"}
    return Preset(
        path=str(path),
        paper=str(section["paper"]),
        table=str(section["table"]),
        claim=str(section["claim"]),
        algorithms=tuple(str(a) for a in algorithms),
        epsilons=tuple(_floats(section["epsilons"], "preset.epsilons")),
        scales=scales,
        common={k: v for k, v in data.items() if k != PRESET_KEY},
        meta={k: v for k, v in section.items() if k not in known},
        variants=variants,
    )
