"""The offline ``digits`` source (scikit-learn's bundled 8x8 images), issue 14 item 4."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from engine.config import load_config
from engine.data import build_dataset
from engine.data.digits import (
    DIGITS_MEAN,
    DIGITS_STD,
    DIGITS_TEST_FRACTION,
    digits_split,
    load_digits_source,
)

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def _raw() -> tuple[np.ndarray, np.ndarray]:
    bunch = sklearn_datasets.load_digits()
    return bunch.images, bunch.target


def test_public_test_split_is_fixed_disjoint_and_never_given_to_clients() -> None:
    images, labels = _raw()
    n = len(labels)
    assert n == 1797
    mask = digits_split(n)
    assert mask.sum() == round(DIGITS_TEST_FRACTION * n)
    data = load_digits_source("unit_interval")
    assert len(data.y_test) == mask.sum() and len(data.y_train) == n - mask.sum()
    np.testing.assert_array_equal(data.x_test[:, 0], images[mask] / 16.0)
    np.testing.assert_array_equal(data.y_train, labels[~mask])
    # every run (any seed, any partition) partitions only the pool: no test image reaches
    # a client, and the global test set is the same fixed split
    for seed, part in ((0, "iid"), (5, "dirichlet")):
        cfg = load_config(
            overrides=["dataset.name=digits", f"dataset.partition={part}", "dataset.num_clients=30"]
        ).dataset
        ds = build_dataset(cfg, np.random.default_rng(seed))
        owned = np.concatenate(ds.client_train + ds.client_test)
        assert np.array_equal(np.sort(owned), np.arange(n - mask.sum()))  # all pool, once
        np.testing.assert_array_equal(ds.y_test, labels[mask])
        assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
        assert ds.meta["eval_source"] == "public: fixed held-out 20% of the digits"


def test_dirichlet_partition_skews_labels_and_iid_does_not() -> None:
    def mean_label_entropy(partition: str) -> float:
        cfg = load_config(
            overrides=[
                "dataset.name=digits",
                f"dataset.partition={partition}",
                "dataset.alpha=0.1",
                "dataset.num_clients=20",
            ]
        ).dataset
        ds = build_dataset(cfg, np.random.default_rng(0))
        ent = []
        for ix in ds.client_train:
            p = np.bincount(ds.y_train[ix], minlength=10) / max(len(ix), 1)
            ent.append(-(p[p > 0] * np.log(p[p > 0])).sum())
        return float(np.mean(ent))

    assert mean_label_entropy("iid") > 2.0  # close to log(10) = 2.30
    assert mean_label_entropy("dirichlet") < 1.2


def test_standardize_uses_fixed_public_constants() -> None:
    images, _ = _raw()
    x = images / 16.0
    # the written-down constants are the bundled set's pixel statistics (to 1e-3) ...
    assert abs(x.mean() - DIGITS_MEAN) < 1e-3 and abs(x.std() - DIGITS_STD) < 1e-3
    std = load_digits_source("standardize")
    unit = load_digits_source("unit_interval")
    np.testing.assert_allclose(std.x_train, (unit.x_train - DIGITS_MEAN) / DIGITS_STD, rtol=1e-5)
    assert load_digits_source(None).x_train.tobytes() == std.x_train.tobytes()  # default
    # ... and are constants: a run's clients' statistics never enter (pool mean != 0)
    assert abs(float(std.x_train.mean())) > 1e-4
    assert unit.x_train.min() == 0.0 and unit.x_train.max() == 1.0


def test_missing_sklearn_is_a_clear_error(monkeypatch) -> None:
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError("no sklearn")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="dataset.name=digits needs scikit-learn"):
        load_digits_source()


def test_missing_sklearn_is_one_line_before_any_work(monkeypatch) -> None:
    import importlib.util

    from engine.config import ConfigError
    from engine.simulation import prepare

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name)
    )
    with pytest.raises(ConfigError, match=r"^dataset.name=digits needs scikit-learn"):
        prepare(load_config(overrides=["dataset.name=digits", "model.name=logreg"]))


def test_dataset_normalize_key_reaches_the_clients_inputs() -> None:
    def built(*extra: str):
        cfg = load_config(overrides=["dataset.name=digits", "dataset.num_clients=10", *extra])
        return build_dataset(cfg.dataset, np.random.default_rng(0))

    unit = built("dataset.normalize=unit_interval")
    default = built()
    assert unit.x_train.min() == 0.0 and unit.x_train.max() == 1.0
    assert unit.x_test.min() >= 0.0 and unit.x_test.max() <= 1.0
    assert default.x_train.min() < 0.0  # standardised by default
    np.testing.assert_allclose(
        default.x_train, (unit.x_train - DIGITS_MEAN) / DIGITS_STD, rtol=1e-5, atol=1e-6
    )
