"""LEAF JSON sources with natural clients: FEMNIST (writers) and Shakespeare (roles).

Layout (as written by LEAF's ``preprocess.sh``): ``root/train/*.json`` and
``root/test/*.json``, each file a dict with keys ``users`` (list of ids),
``num_samples`` (list of counts) and ``user_data`` (``{user: {"x": [...], "y": [...]}}``);
an optional ``hierarchies`` key is ignored.

* **Training arrays** are the concatenation of every user of ``train/*.json`` (files
  in sorted name order, users in each file's ``users`` order). ``groups[i]`` is the
  index of the user owning example ``i``, numbered in order of first appearance, so
  users are the natural clients. A user listed in two files keeps one index; users
  without samples are skipped.
* **Test arrays** are every user of ``test/*.json``, with ``test_groups`` numbered like
  ``groups`` (a user only in test gets a new index). They are the same writers' data,
  hence not public: :func:`engine.data.build_dataset` evaluates on held-out writers.

FEMNIST: ``x`` is 784 floats per sample (a 28x28 image, values in [0, 1] exactly as
LEAF stores them, background 1.0); kept as is and reshaped to float32 ``(n, 1, 28, 28)``.
``y`` is 0..61, so ``num_classes`` is 62.

Shakespeare: ``x`` is a string of 80 characters and ``y`` the next character. Both
are encoded with LEAF's fixed vocabulary :data:`ALL_LETTERS` (index = position in
the string); any other character maps to the extra out-of-vocabulary id
:data:`UNKNOWN_ID` (= 80). ``x`` becomes int64 ``(n, 80)``, ``y`` int64 ``(n,)``
and ``num_classes`` is 81 (80 characters plus the unknown token).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from engine.data.sources import DatasetFilesMissing, PooledData

LEAF_SOURCES: tuple[str, ...] = ("femnist", "shakespeare")

#: LEAF's Shakespeare vocabulary (``leaf/models/utils/language_utils.py``), 80 characters.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
#: Id of any character outside :data:`ALL_LETTERS`.
UNKNOWN_ID = len(ALL_LETTERS)
#: Shakespeare's number of classes: the vocabulary plus the unknown token.
SHAKESPEARE_NUM_CLASSES = len(ALL_LETTERS) + 1
FEMNIST_NUM_CLASSES = 62

_FORMAT = (
    "LEAF JSON: {root}/train/*.json and {root}/test/*.json with keys users, num_samples, user_data"
)


def _validate(name: str) -> None:
    if name not in LEAF_SOURCES:
        raise ValueError(
            f"dataset.name={name!r} is not a LEAF source; expected one of {', '.join(LEAF_SOURCES)}"
        )


def _json_files(root: str, split: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, split, "*.json")))


def check_leaf_files(name: str, root: str | None) -> None:
    """Raise :class:`DatasetFilesMissing` unless ``root`` holds LEAF train and test JSON.

    Only checks that the files exist (cheap; meant for validation before any work).
    Raises ``ValueError`` for an unknown ``name``.
    """
    _validate(name)
    if root is None:
        raise DatasetFilesMissing(
            f"dataset.name={name}: dataset.root is not set (expected "
            f"{_FORMAT.format(root='<root>')}); set dataset.root to LEAF's data folder"
        )
    root = os.path.expanduser(root)
    for split in ("train", "test"):
        folder = os.path.join(root, split)
        if not _json_files(root, split):
            what = "no *.json files in" if os.path.isdir(folder) else "no directory"
            raise DatasetFilesMissing(
                f"dataset.name={name}: {what} {folder} (expected {_FORMAT.format(root=root)}); "
                "set dataset.root to the folder LEAF's preprocess.sh wrote (e.g. data/<name>/data)"
            )


def encode_text(strings: list[str]) -> np.ndarray:
    """Encode equal-length strings into an int64 ``(n, length)`` array of vocabulary ids.

    Vectorised: the strings are joined and decoded to code points once.
    """
    if not strings:
        return np.zeros((0, 0), dtype=np.int64)
    length = len(strings[0])
    if any(len(s) != length for s in strings):
        raise ValueError(f"Shakespeare sequences differ in length (first has {length})")
    codes = np.frombuffer("".join(strings).encode("utf-32-le"), dtype="<u4")
    lut = np.full(128, UNKNOWN_ID, dtype=np.int64)
    for i, ch in enumerate(ALL_LETTERS):
        lut[ord(ch)] = i
    ids = np.where(codes < 128, lut[np.minimum(codes, 127)], UNKNOWN_ID)
    return ids.reshape(len(strings), length)


def _user_arrays(name: str, data: dict[str, Any], path: str, user: str) -> tuple[Any, Any]:
    """``x`` and ``y`` lists of ``user`` in one LEAF file, checked for equal length."""
    try:
        entry = data["user_data"][user]
        xs, ys = entry["x"], entry["y"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"dataset.name={name}: {path} lacks user_data[{user!r}].x/y") from err
    if len(xs) != len(ys):
        raise ValueError(f"dataset.name={name}: {path} user {user!r} has {len(xs)} x, {len(ys)} y")
    return xs, ys


def _convert(name: str, xs: list[Any], ys: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """One user's ``x``/``y`` lists as arrays: float32 (k, 1, 28, 28) or int64 (k, len)."""
    if name == "femnist":
        try:
            x = np.asarray(xs, dtype=np.float32)
        except (TypeError, ValueError) as err:
            raise ValueError(f"dataset.name=femnist: {where} x is not 784 numbers each") from err
        if x.shape[1:] != (784,):
            raise ValueError(f"dataset.name=femnist: {where} samples have shape {x.shape[1:]}")
        return x.reshape(-1, 1, 28, 28), np.asarray(ys, dtype=np.int64)
    if any(not isinstance(c, str) or len(c) != 1 for c in ys):
        raise ValueError(f"dataset.name=shakespeare: {where} has a y that is not one character")
    return encode_text(xs), encode_text(ys).reshape(-1)


def _read_split(
    name: str, paths: list[str], user_ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, labels and per-example user index of every user in ``paths``.

    ``user_ids`` maps user name to index and is extended in order of first appearance.
    Each user's data is converted to arrays as soon as its file is parsed, so only one
    file's JSON objects are alive at a time.
    """
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or "users" not in data or "user_data" not in data:
            raise ValueError(
                f"dataset.name={name}: {path} is not LEAF JSON (keys users, num_samples, "
                "user_data expected)"
            )
        for user in data["users"]:
            ux, uy = _user_arrays(name, data, path, user)
            if not len(uy):
                continue
            x, y = _convert(name, ux, uy, f"{path} user {user!r}")
            xs.append(x)
            ys.append(y)
            owners.append(np.full(len(y), user_ids.setdefault(user, len(user_ids)), np.int64))
        del data
    if not xs:
        shape, dtype = ((0, 1, 28, 28), np.float32) if name == "femnist" else ((0, 80), np.int64)
        return np.zeros(shape, dtype), np.zeros(0, np.int64), np.zeros(0, np.int64)
    if name == "shakespeare" and len({x.shape[1] for x in xs}) > 1:
        raise ValueError(f"dataset.name=shakespeare: sequences in {paths} differ in length")
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(owners)


def load_leaf_source(name: str, root: str | None) -> PooledData:
    """Load LEAF ``femnist`` or ``shakespeare`` from ``root`` (see the module docstring).

    Returns:
        :class:`PooledData` with ``groups`` = user index per training example.

    Raises:
        DatasetFilesMissing: ``root/train`` or ``root/test`` holds no JSON file.
        ValueError: unknown ``name`` or malformed files (bad keys, shapes or labels).
    """
    check_leaf_files(name, root)
    assert root is not None
    root = os.path.expanduser(root)
    train_users: dict[str, int] = {}
    x_train, y_train, groups = _read_split(name, _json_files(root, "train"), train_users)
    x_test, y_test, test_groups = _read_split(name, _json_files(root, "test"), train_users)
    if len(y_train) == 0:
        raise ValueError(f"dataset.name={name}: {root}/train/*.json holds no examples")
    if name == "femnist":
        num_classes = FEMNIST_NUM_CLASSES
        input_shape: tuple[int, ...] = (1, 28, 28)
    else:
        num_classes = SHAKESPEARE_NUM_CLASSES
        input_shape = (int(x_train.shape[1]),)
        if x_test.size and x_test.shape[1:] != input_shape:
            raise ValueError(
                f"dataset.name=shakespeare: test sequences have length {x_test.shape[1]}, "
                f"train sequences {input_shape[0]}"
            )
    for split, y in (("train", y_train), ("test", y_test)):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(
                f"dataset.name={name}: {split} labels span [{y.min()}, {y.max()}], "
                f"expected [0, {num_classes})"
            )
    return PooledData(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        input_shape=input_shape,
        groups=groups,
        test_groups=test_groups,
    )
