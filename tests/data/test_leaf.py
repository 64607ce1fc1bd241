"""Tests for engine.data.leaf on small LEAF JSON trees (2 train files, 1 test file)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.data.leaf import (
    ALL_LETTERS,
    SHAKESPEARE_NUM_CLASSES,
    UNKNOWN_ID,
    check_leaf_files,
    encode_text,
    load_leaf_source,
)
from engine.data.sources import DatasetFilesMissing


def write_leaf(root, split: str, fname: str, user_data: dict, hierarchies: bool = False) -> None:
    users = list(user_data)
    blob = {
        "users": users,
        "num_samples": [len(user_data[u]["y"]) for u in users],
        "user_data": user_data,
    }
    if hierarchies:
        blob["hierarchies"] = ["h" for _ in users]
    os.makedirs(os.path.join(root, split), exist_ok=True)
    with open(os.path.join(root, split, fname), "w", encoding="utf-8") as f:
        json.dump(blob, f)


def femnist_user(n: int, label0: int, rng: np.random.Generator) -> dict:
    imgs = rng.random((n, 784)).round(4)
    imgs[:, 28 * 3 + 17] = 0.0  # a dark pixel at row 3, column 17
    return {"x": imgs.tolist(), "y": [(label0 + k) % 62 for k in range(n)]}


@pytest.fixture
def femnist_root(tmp_path):
    rng = np.random.default_rng(0)
    # Sorted file order is a.json then b.json; "carol" also appears in b.json.
    a = {"carol": femnist_user(3, 0, rng), "alice": femnist_user(2, 10, rng)}
    b = {"bob": femnist_user(4, 58, rng), "carol": femnist_user(1, 61, rng)}
    test = {"alice": femnist_user(2, 5, rng), "dave": femnist_user(3, 7, rng)}
    write_leaf(tmp_path, "train", "b.json", b, hierarchies=True)
    write_leaf(tmp_path, "train", "a.json", a)
    write_leaf(tmp_path, "test", "all_test.json", test)
    return tmp_path, a, b, test


def test_femnist(femnist_root) -> None:
    root, a, b, test = femnist_root
    data = load_leaf_source("femnist", str(root))
    assert data.num_classes == 62
    assert data.input_shape == (1, 28, 28)
    assert data.x_train.shape == (10, 1, 28, 28)
    assert data.x_train.dtype == np.float32
    assert data.y_train.dtype == np.int64
    assert data.groups.dtype == np.int64
    # carol=0, alice=1 (a.json), bob=2 (b.json); carol's b.json samples keep id 0.
    np.testing.assert_array_equal(data.groups, [0, 0, 0, 1, 1, 2, 2, 2, 2, 0])
    expected_x = np.array(
        a["carol"]["x"] + a["alice"]["x"] + b["bob"]["x"] + b["carol"]["x"], np.float32
    )
    np.testing.assert_array_equal(data.x_train.reshape(10, 784), expected_x)
    expected_y = a["carol"]["y"] + a["alice"]["y"] + b["bob"]["y"] + b["carol"]["y"]
    np.testing.assert_array_equal(data.y_train, expected_y)
    assert (data.x_train[:, 0, 3, 17] == 0.0).all()  # row-major reshape
    assert data.x_test.shape == (5, 1, 28, 28)
    np.testing.assert_array_equal(data.y_test, test["alice"]["y"] + test["dave"]["y"])
    np.testing.assert_array_equal(np.bincount(data.groups), [4, 2, 4])


def shakespeare_user(lines: list[str]) -> dict:
    return {"x": [s[:80] for s in lines], "y": [s[80] for s in lines]}


def test_shakespeare(tmp_path) -> None:
    text = "To be, or not to be: that is the question!\nWhether 'tis nobler in the mind..."
    text = (text * 3)[:200]
    odd = "Caf\u00e9 $ <> |" + text  # é, $, <, | are outside LEAF's vocabulary
    write_leaf(tmp_path, "train", "1.json", {"HAMLET": shakespeare_user([text, text[5:]])})
    write_leaf(tmp_path, "train", "2.json", {"OPHELIA": shakespeare_user([odd])})
    write_leaf(tmp_path, "test", "t.json", {"HAMLET": shakespeare_user([text[9:]])})
    data = load_leaf_source("shakespeare", str(tmp_path))
    assert len(ALL_LETTERS) == 80
    assert UNKNOWN_ID == 80
    assert data.num_classes == SHAKESPEARE_NUM_CLASSES == 81
    assert data.input_shape == (80,)
    assert data.x_train.shape == (3, 80)
    assert data.x_train.dtype == np.int64
    np.testing.assert_array_equal(data.groups, [0, 0, 1])
    np.testing.assert_array_equal(data.x_train[0], [ALL_LETTERS.index(c) for c in text[:80]])
    assert data.y_train[0] == ALL_LETTERS.index(text[80])
    assert data.y_train[1] == ALL_LETTERS.index(text[85])
    assert data.x_train[0, 0] == ALL_LETTERS.index("T")
    assert data.x_train[0, 2] == 1
    assert data.x_train[0, 42] == 0  # "\n"
    assert list(data.x_train[2, :11]) == [
        ALL_LETTERS.index("C"), ALL_LETTERS.index("a"), ALL_LETTERS.index("f"), 80,
        1, 80, 1, 80, ALL_LETTERS.index(">"), 1, 80,
    ]  # fmt: skip
    np.testing.assert_array_equal(data.x_test[0], encode_text([text[9:89]])[0])
    assert data.y_test.tolist() == [ALL_LETTERS.index(text[89])]


def test_encode_text() -> None:
    assert encode_text(["}\n", "a\u4e16"]).tolist() == [[79, 0], [ALL_LETTERS.index("a"), 80]]
    with pytest.raises(ValueError, match="differ in length"):
        encode_text(["ab", "abc"])


def test_missing_files(tmp_path) -> None:
    for name in ("femnist", "shakespeare"):
        with pytest.raises(DatasetFilesMissing) as err:
            load_leaf_source(name, str(tmp_path))
        msg = str(err.value)
        assert "\n" not in msg
        assert f"dataset.name={name}" in msg
        assert f"no directory {os.path.join(tmp_path, 'train')}" in msg
        assert f"{tmp_path}/train/*.json and {tmp_path}/test/*.json" in msg
        assert "users, num_samples, user_data" in msg
    write_leaf(tmp_path, "train", "a.json", {"u": femnist_user(1, 0, np.random.default_rng(1))})
    os.makedirs(os.path.join(tmp_path, "test"))
    with pytest.raises(DatasetFilesMissing, match=r"no \*\.json files in .*test"):
        check_leaf_files("femnist", str(tmp_path))
    with pytest.raises(DatasetFilesMissing, match=r"dataset.root is not set"):
        check_leaf_files("femnist", None)


def test_bad_input(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"dataset.name='cifar10'"):
        load_leaf_source("cifar10", str(tmp_path))
    write_leaf(tmp_path, "test", "t.json", {"u": {"x": ["a" * 80], "y": ["b"]}})
    write_leaf(tmp_path, "train", "a.json", {"u": {"x": ["a" * 80], "y": ["bc"]}})
    with pytest.raises(ValueError, match="not one character"):
        load_leaf_source("shakespeare", str(tmp_path))
    with pytest.raises(ValueError, match="x is not 784 numbers each"):
        load_leaf_source("femnist", str(tmp_path))
    write_leaf(tmp_path, "test", "t.json", {"u": {"x": [[0.5] * 784], "y": [3]}})
    write_leaf(tmp_path, "train", "a.json", {"u": {"x": [[0.0] * 10], "y": [1]}})
    with pytest.raises(ValueError, match="samples have shape"):
        load_leaf_source("femnist", str(tmp_path))
    write_leaf(tmp_path, "train", "a.json", {"u": {"x": [[0.0] * 784], "y": [62]}})
    with pytest.raises(ValueError, match=r"labels span \[62, 62\]"):
        load_leaf_source("femnist", str(tmp_path))
    write_leaf(tmp_path, "train", "a.json", {"u": {"x": [[0.0] * 784] * 2, "y": [1]}})
    with pytest.raises(ValueError, match="has 2 x, 1 y"):
        load_leaf_source("femnist", str(tmp_path))
    with open(os.path.join(tmp_path, "train", "a.json"), "w") as f:
        json.dump({"something": 1}, f)
    with pytest.raises(ValueError, match="is not LEAF JSON"):
        load_leaf_source("femnist", str(tmp_path))


def test_leaf_public_test_set_is_held_out_writers(tmp_path) -> None:
    """Issue 13 item 3: LEAF's test JSON holds the same writers' data, so the public
    test set is the data (train and test JSON) of writers held out of the population."""
    from engine.config import DatasetConfig
    from engine.data import build_dataset

    rng = np.random.default_rng(3)
    a = {"carol": femnist_user(3, 0, rng), "alice": femnist_user(2, 10, rng)}
    b = {"bob": femnist_user(4, 20, rng)}
    test = {"alice": femnist_user(2, 30, rng), "bob": femnist_user(3, 40, rng)}
    write_leaf(tmp_path, "train", "a.json", a)
    write_leaf(tmp_path, "train", "b.json", b)
    write_leaf(tmp_path, "test", "t.json", test)
    cfg = DatasetConfig(
        name="femnist",
        root=str(tmp_path),
        num_clients=2,
        partition="natural",
        public_eval_clients=1,
        client_test_fraction=0.0,
    )
    ds = build_dataset(cfg, np.random.default_rng(0))
    assert ds.meta["eval_source"] == "public: 1 held-out writers/roles"
    # The population is carol and alice (train JSON only); bob is the public test set.
    assert ds.num_clients == 2
    np.testing.assert_array_equal(
        ds.x_train.reshape(-1, 784), np.array(a["carol"]["x"] + a["alice"]["x"], np.float32)
    )
    np.testing.assert_array_equal(
        ds.x_test.reshape(-1, 784), np.array(b["bob"]["x"] + test["bob"]["x"], np.float32)
    )
    np.testing.assert_array_equal(ds.y_test, b["bob"]["y"] + test["bob"]["y"])
    with pytest.raises(ValueError, match="dataset.public_eval_clients"):
        build_dataset(
            DatasetConfig(name="femnist", root=str(tmp_path), num_clients=3, partition="natural"),
            np.random.default_rng(0),
        )
