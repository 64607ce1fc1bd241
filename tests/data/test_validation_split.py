"""``dataset.validation_size``: a public validation set that no client holds, disjoint
from the test set, drawn from the data seed (engine.data.validation)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.data import build_dataset
from engine.privacy import rng as rngs


def _rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in np.asarray(x).reshape(len(x), -1)}


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_validation_examples_are_no_clients_and_not_the_test_set(partition: str) -> None:
    pytest.importorskip("sklearn")
    cfg = load_config(
        overrides=[
            "dataset.name=digits",
            "dataset.num_clients=20",
            f"dataset.partition={partition}",
            "dataset.alpha=0.3",
            "dataset.validation_size=150",
        ]
    ).dataset
    data = build_dataset(cfg, rngs.numpy_rng(0, rngs.DATA))
    plain = build_dataset(
        load_config(overrides=["dataset.name=digits", "dataset.num_clients=20"]).dataset,
        rngs.numpy_rng(0, rngs.DATA),
    )
    assert data.x_val is not None and data.y_val is not None
    assert len(data.y_val) == 150 and data.x_val.shape[1:] == data.x_train.shape[1:]
    # every example of the pool is either a client's or the validation set's, never both
    assert len(data.y_train) + 150 == len(plain.y_train)
    held = _rows(data.x_val)
    clients = np.concatenate([data.client_train.flat, data.client_test.flat])
    assert np.array_equal(np.sort(clients), np.arange(len(data.y_train)))
    assert not held & _rows(data.x_train)
    assert not held & _rows(data.x_test)  # disjoint from the public test set
    assert _rows(data.x_test) == _rows(plain.x_test)  # the test set is untouched
    assert "validation_source" in data.meta
    # the draw is the data seed's: the same seed holds out the same examples
    again = build_dataset(cfg, rngs.numpy_rng(0, rngs.DATA))
    assert np.array_equal(again.x_val, data.x_val)
    other = build_dataset(cfg, rngs.numpy_rng(1, rngs.DATA))
    assert not np.array_equal(other.x_val, data.x_val)


def test_without_a_validation_size_nothing_changes() -> None:
    cfg = load_config(overrides=["dataset.num_clients=30"]).dataset
    data = build_dataset(cfg, rngs.numpy_rng(3, rngs.DATA))
    assert data.x_val is None and data.y_val is None


@pytest.mark.parametrize(
    "override, key",
    [
        (["dataset.validation_size=-1"], "dataset.validation_size"),
        (["dataset.validation_size=10", "dataset.partition=natural"], "dataset.validation_size"),
    ],
)
def test_bad_validation_sizes_are_refused_naming_the_key(override, key) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(overrides=override)


def test_a_validation_set_that_leaves_no_client_data_is_refused() -> None:
    pytest.importorskip("sklearn")
    cfg = load_config(overrides=["dataset.name=digits", "dataset.validation_size=100000"]).dataset
    with pytest.raises(ValueError, match="dataset.validation_size=100000"):
        build_dataset(cfg, rngs.numpy_rng(0, rngs.DATA))
