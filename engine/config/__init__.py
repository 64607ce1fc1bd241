"""The configuration room: the typed run configuration, how it is loaded, and its docs.

A run is described by one frozen tree of dataclasses, :class:`RunConfig` at the root,
whose keys are the README's *Configuration reference*. Every section validates itself
when built and raises :class:`ConfigError` (a ``ValueError``) with one line naming the
key and the bad value, so a bad config fails before any work starts.

* :mod:`engine.config.sections`: the self-contained sections (dataset, model, sampling,
  eval, privacy, local, server, ray);
* :mod:`engine.config.algo`: the ``algo:`` section, declared by the recipes' pieces;
* :mod:`engine.config.schema`: :class:`RunConfig` and its checks across sections;
* :mod:`engine.config.loading`: YAML files, ``--set`` overrides, dotted paths;
* :mod:`engine.config.doc`: one line of help per key, ``dpfl config``'s YAML;
* :mod:`engine.config.presets`: paper presets (several runs in one file).

This package re-exports the names other rooms import.
"""

from __future__ import annotations

from algorithms.compose import RecipeConfig
from engine.base.errors import ConfigError
from engine.config.algo import AlgoConfig
from engine.config.loading import (
    RENAMED,
    config_from_dict,
    dotted_leaves,
    load_config,
    merge_trees,
    parse_override,
    read_yaml_mapping,
    replace,
    set_path,
    user_tree,
    with_algorithm,
)
from engine.config.schema import ALGORITHMS, CUSTOM, NON_PRIVATE, RunConfig
from engine.config.sections import (
    DEFAULT_EPSILON,
    HELD_OUT_FRACTION,
    DatasetConfig,
    EvalConfig,
    LocalConfig,
    ModelConfig,
    PrivacyConfig,
    RayConfig,
    SamplingConfig,
    ServerConfig,
)

__all__ = [
    "ALGORITHMS",
    "CUSTOM",
    "DEFAULT_EPSILON",
    "HELD_OUT_FRACTION",
    "NON_PRIVATE",
    "RENAMED",
    "AlgoConfig",
    "ConfigError",
    "DatasetConfig",
    "EvalConfig",
    "LocalConfig",
    "ModelConfig",
    "PrivacyConfig",
    "RayConfig",
    "RecipeConfig",
    "RunConfig",
    "SamplingConfig",
    "ServerConfig",
    "config_from_dict",
    "dotted_leaves",
    "load_config",
    "merge_trees",
    "parse_override",
    "read_yaml_mapping",
    "replace",
    "set_path",
    "user_tree",
    "with_algorithm",
]
