"""Loading a config: YAML files, ``--set key=value`` overrides and dotted paths.

A config is built from the defaults, then a YAML file (a diff over the defaults), then
the overrides, in that order (:func:`load_config`); every value is coerced to its
field's annotation and an unknown or renamed key is a one-line :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from algorithms.compose import RecipeConfig
from engine.base.errors import ConfigError
from engine.config.algo import algo_config_class
from engine.config.schema import CUSTOM, RunConfig


@functools.cache
def _section_types(cls: type) -> dict[str, Any]:
    """A config class's field annotations, resolved once per class (``get_type_hints``
    evaluates the string annotations again at every call: 0.14 ms each, eleven per
    config built, and a sweep of tiny trials builds several configs per trial). The
    dict is shared: read it, never change it."""
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Coerce ``value`` (from YAML or a ``--set`` string) to annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        number: float | None = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}={value!r}: expected a number")
        # NaN is no setting, nor is infinity but where it means something
        if math.isnan(number) or (math.isinf(number) and key not in INFINITE_OK):
            if key != "privacy.epsilon":  # its own check says what NaN and inf mean
                raise ConfigError(f"{key}={value!r}: must be a finite number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            if not str(value).strip():  # never read as "unset": say so
                raise ConfigError(f"{key}={value!r}: is empty; give a value (or null)")
            return str(value)
        raise ConfigError(f"{key}={value!r}: expected a string")
    if origin is tuple:  # tuple[str, ...]: a YAML list, or a comma-separated string
        if isinstance(value, str):
            if not value.strip():
                raise ConfigError(f"{key}={value!r}: is empty; write [] for an empty list")
            value = [v.strip() for v in value.split(",")]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            if any(not v.strip() for v in value):
                raise ConfigError(f"{key}={value!r}: has an empty item")
            return tuple(v.strip() for v in value)
        raise ConfigError(f"{key}={value!r}: expected a list of names")
    raise ConfigError(f"{key}: unsupported type {tp}")


#: Float keys for which infinity means something: no clipping (``privacy.clip_norm``,
#: with no noise: a non-private check), or a budget the key's own check refuses in words.
INFINITE_OK = ("privacy.clip_norm", "privacy.epsilon")

#: Keys that were renamed, with what to write instead (a one-line error, never a guess).
RENAMED = {
    "algo.sparsity": (
        "write algo.keep_fraction for the kept fraction p of top-k / rand-k / server "
        "top-k, or algo.zero_fraction for the zeroed fraction c of LUS"
    ),
}


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}={data!r}: expected a mapping")
    hints = _section_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in known:
            if key in RENAMED:
                raise ConfigError(f"{key}: renamed; {RENAMED[key]}")
            close = difflib.get_close_matches(str(k), sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{close[0]}? " if close else ""
            raise ConfigError(
                f"{key}: unknown config key ({hint}known: {', '.join(sorted(known))})"
            )
        tp = algo_config_class() if cls is RunConfig and k == "algo" else hints[k]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, f"{key}.")
        else:
            kwargs[k] = _coerce(key, v, tp)
    return cls(**kwargs)


def set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree``'s entry at the dotted key ``a.b.c`` to ``value``, making the missing
    sections; ConfigError when a part of the path is a value, not a section."""
    parts = dotted.split(".")
    if any(not p.strip() for p in parts):
        raise ConfigError(f"--set {dotted}=...: the key {dotted!r} has an empty part")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``key=value``; the value is read as YAML (so ``1e-5``, ``true``, ``null``)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; ConfigError naming ``--config`` otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--config {str(p)!r}: is a folder, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"--config {str(p)!r}: no such file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"--config {str(p)!r}: not UTF-8 text (byte {raw[e.start]:#04x} on line {line}); "
            "save the file as UTF-8"
        ) from None
    loaded = yaml.safe_load(text) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {str(p)!r}: expected a YAML mapping at top level")
    return loaded


def user_tree(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the user wrote, as a nested mapping: ``base``, then the YAML file (a diff),
    then the ``key=value`` overrides, in that order; no defaults filled in."""
    tree: dict[str, Any] = json.loads(json.dumps(base)) if base else {}
    if path is not None:
        loaded = read_yaml_mapping(path)
        if "preset" in loaded:  # engine.config.presets: a paper table, several runs
            raise ConfigError(
                f"--config {str(path)!r}: is a paper preset (preset: section); run it with "
                "dpfl compare --config FILE [--scale cpu]"
            )
        tree = merge_trees(tree, loaded)
    for item in overrides or []:
        key, value = parse_override(item)
        set_path(tree, key, value)
    return tree


def dotted_leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: every non-mapping value by its dotted key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(dotted_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """Build a :class:`RunConfig` from defaults, a YAML file (a diff over the defaults)
    and ``key=value`` overrides, in that order (:func:`user_tree`)."""
    return _build(RunConfig, user_tree(path, overrides, base), "")


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a config from :meth:`RunConfig.to_dict` output (or any nested mapping)."""
    return _build(RunConfig, data, "")


def merge_trees(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``b`` over ``a``, section by section (a YAML diff over a base); new dicts."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_trees(out[k], v)
        else:
            out[k] = v
    return out


def with_algorithm(config: RunConfig, algorithm: str, **changes: Any) -> RunConfig:
    """``config`` run by ``algorithm`` (plus dotted ``changes``). A built-in recipe gets
    the default ``recipe:`` section: a config's composed recipe belongs to its
    ``custom`` row only, so ``dpfl compare``/``tune`` can set it beside built-in ones.

    ``dataset.client_test_fraction`` is resolved again for ``algorithm`` when it holds
    the default of the config's own recipe (a null fraction resolved when the config
    was loaded): a personalised row of a comparison from a global recipe's config keeps
    its held-out split (0.2), and a global row trains on all its data (0). A fraction
    that differs from that default was chosen and is kept; one chosen equal to it is
    read as unset, the one case this cannot tell apart."""
    if algorithm != CUSTOM:
        changes = {"recipe": dataclasses.asdict(RecipeConfig()), **changes}
    fraction = "dataset.client_test_fraction"
    if fraction not in changes and (
        config.dataset.client_test_fraction == config.default_client_test_fraction()
    ):
        changes[fraction] = None  # resolved for the new recipe by RunConfig
    return replace(config, algorithm=algorithm, **changes)


def replace(config: RunConfig, **changes: Any) -> RunConfig:
    """``dataclasses.replace`` that accepts dotted keys, e.g. ``{"privacy.epsilon": 4}``."""
    tree = config.to_dict()
    for k, v in changes.items():
        set_path(tree, k.replace("__", "."), v)
    return config_from_dict(tree)
