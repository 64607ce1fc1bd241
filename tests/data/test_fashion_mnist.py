"""``dataset.name=fashion_mnist`` (issue 28): small IDX files the tests write, in Debian's
flat layout and torchvision's, the one-line error when the package is missing, and (where
Debian's ``dataset-fashion-mnist`` is installed) the real files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.config import load_config
from engine.data import build_dataset, check_dataset_files
from engine.data import torchvision_sources as tvs
from engine.data.sources import DatasetFilesMissing
from engine.data.torchvision_sources import check_torchvision_files, load_torchvision_source
from tests.data.test_torchvision_sources import write_idx

FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
REAL = os.path.isfile(os.path.join(tvs.FASHION_MNIST_ROOT, FILES[0] + ".gz"))
needs_real = pytest.mark.skipif(
    not REAL,
    reason=f"Fashion-MNIST not under {tvs.FASHION_MNIST_ROOT} "
    "(Debian package dataset-fashion-mnist: apt-get install dataset-fashion-mnist)",
)


def write_fashion(folder: str, gz: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        FILES[0]: rng.integers(0, 256, size=(9, 28, 28), dtype=np.uint8),
        FILES[1]: np.array([0, 1, 2, 3, 4, 5, 6, 7, 9], dtype=np.uint8),
        FILES[2]: rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8),
        FILES[3]: np.array([8, 9, 0, 1], dtype=np.uint8),
    }
    for name, arr in arrays.items():
        write_idx(os.path.join(folder, name), arr, gz=gz)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_debian_layout_unit_interval_by_default(tmp_path, gz: bool) -> None:
    arrays = write_fashion(str(tmp_path), gz)
    data = load_torchvision_source("fashion_mnist", str(tmp_path))
    assert data.x_train.shape == (9, 1, 28, 28) and data.x_test.shape == (4, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.num_classes == 10
    assert data.input_shape == (1, 28, 28) and data.groups is None
    # default: pixel / 255 (the grey-scale sources' recipe), to float32 rounding
    np.testing.assert_allclose(data.x_train[:, 0], arrays[FILES[0]] / 255.0, rtol=0, atol=1e-7)
    np.testing.assert_allclose(data.x_test[:, 0], arrays[FILES[2]] / 255.0, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(data.y_train, arrays[FILES[1]])
    np.testing.assert_array_equal(data.y_test, arrays[FILES[3]])
    std = load_torchvision_source("fashion_mnist", str(tmp_path), normalize="standardize")
    np.testing.assert_allclose(std.x_train, (data.x_train - 0.2860) / 0.3530, rtol=1e-5)


def test_torchvision_layout(tmp_path) -> None:
    arrays = write_fashion(os.path.join(str(tmp_path), "FashionMNIST", "raw"), gz=False, seed=1)
    data = load_torchvision_source("fashion_mnist", str(tmp_path))
    np.testing.assert_array_equal(data.y_test, arrays[FILES[3]])
    np.testing.assert_array_equal(np.rint(data.x_train[:, 0] * 255), arrays[FILES[0]])
    datasets = pytest.importorskip("torchvision.datasets")  # torchvision reads the same
    theirs = datasets.FashionMNIST(str(tmp_path), train=True, download=False)
    np.testing.assert_array_equal(theirs.data.numpy(), arrays[FILES[0]])


def test_root_defaults_to_the_debian_path(tmp_path, monkeypatch) -> None:
    write_fashion(str(tmp_path), gz=True)
    monkeypatch.setattr(tvs, "FASHION_MNIST_ROOT", str(tmp_path))
    assert load_torchvision_source("fashion_mnist", None).x_train.shape[0] == 9
    cfg = load_config(overrides=["dataset.name=fashion_mnist", "dataset.num_clients=3"])
    assert cfg.dataset.root is None
    check_dataset_files(cfg.dataset)
    ds = build_dataset(cfg.dataset, np.random.default_rng(0))
    assert sum(len(c) for c in ds.client_train) == 9  # dp_fedavg: no held-out split


def test_missing_package_one_line_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tvs, "FASHION_MNIST_ROOT", str(tmp_path / "absent"))
    monkeypatch.setattr(tvs, "_download", lambda *a: pytest.fail("download attempted"))
    for call in (
        lambda: load_torchvision_source("fashion_mnist", None),
        lambda: check_torchvision_files("fashion_mnist", None),
    ):
        with pytest.raises(DatasetFilesMissing) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("dataset.name=fashion_mnist: ")
        assert str(tmp_path / "absent") in msg
        assert "dataset-fashion-mnist" in msg
        assert "apt-get install dataset-fashion-mnist" in msg
    # files partly there: the missing one is named, with the same hint
    write_fashion(str(tmp_path), gz=True)
    os.remove(os.path.join(tmp_path, FILES[3] + ".gz"))
    with pytest.raises(DatasetFilesMissing, match=f"missing {FILES[3]} under") as err:
        load_torchvision_source("fashion_mnist", str(tmp_path))
    assert "apt-get install dataset-fashion-mnist" in str(err.value)


def test_cli_missing_package_exits_2_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    from engine.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tvs, "FASHION_MNIST_ROOT", str(tmp_path / "absent"))
    status = main(["run", "--set", "dataset.name=fashion_mnist", "--set", "rounds=1"])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpfl: error: dataset.name=fashion_mnist")
    assert "apt-get install dataset-fashion-mnist" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


@needs_real
def test_real_files() -> None:
    """The installed package: 60,000 / 10,000 images, ten balanced classes, [0, 1]."""
    data = load_torchvision_source("fashion_mnist", None)
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(data.y_train).tolist() == [6000] * 10
    assert np.bincount(data.y_test).tolist() == [1000] * 10
    assert float(data.x_train.min()) == 0.0 and float(data.x_train.max()) == 1.0
    # the usual published mean and std of the training pixels (used by standardize)
    assert float(data.x_train.mean()) == pytest.approx(0.2860, abs=5e-4)
    assert float(data.x_train.std()) == pytest.approx(0.3530, abs=5e-4)
