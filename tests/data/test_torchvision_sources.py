"""Tests for engine.data.torchvision_sources on small files written in the real formats.

Each fixture writes files in torchvision's on-disk layout; where torchvision itself can
read them (MNIST/EMNIST always; CIFAR/SVHN once its md5 check is patched out) its arrays
are compared with ours, so the fixtures and the loader both match torchvision.
"""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest

from engine.data import torchvision_sources as tvs
from engine.data.sources import DatasetFilesMissing, PooledData
from engine.data.torchvision_sources import (
    DEFAULT_NORMALIZE,
    EMNIST_NUM_CLASSES,
    NORMALIZATION,
    check_torchvision_files,
    load_torchvision_source,
    read_idx,
)


def write_idx(path: str, arr: np.ndarray, gz: bool = False) -> None:
    """Write an unsigned-byte IDX file (magic 0x00000800 + ndim, big-endian dims)."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    header = (0x0800 + arr.ndim).to_bytes(4, "big")
    header += b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    opener = gzip.open if gz else open
    with opener(path + (".gz" if gz else ""), "wb") as f:
        f.write(header + arr.tobytes())


def upright_images(n: int, rng: np.random.Generator) -> np.ndarray:
    """Random 28x28 images with a marker at row 2, column 20 (orientation check)."""
    imgs = rng.integers(0, 200, size=(n, 28, 28), dtype=np.uint8)
    imgs[:, 2, 20] = 255
    imgs[:, 20, 2] = 0
    return imgs


def pixels(data: PooledData, x: np.ndarray, name: str) -> np.ndarray:
    """Undo the source's default normalisation: recover the uint8 pixels."""
    if DEFAULT_NORMALIZE[name] == "unit_interval":
        return np.rint(x * 255.0).astype(np.int64)
    mean, std = (np.asarray(v, np.float32).reshape(1, -1, 1, 1) for v in NORMALIZATION[name])
    return np.rint((x * std + mean) * 255.0).astype(np.int64)


def write_mnist(root: str, rng: np.random.Generator, gz: bool = False) -> dict[str, np.ndarray]:
    raw = os.path.join(root, "MNIST", "raw")
    arrays = {
        "train-images-idx3-ubyte": upright_images(7, rng),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 7, dtype=np.uint8),
        "t10k-images-idx3-ubyte": upright_images(3, rng),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 3, dtype=np.uint8),
    }
    for fname, arr in arrays.items():
        write_idx(os.path.join(raw, fname), arr, gz=gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist(tmp_path, gz: bool) -> None:
    arrays = write_mnist(str(tmp_path), np.random.default_rng(0), gz=gz)
    data = load_torchvision_source("mnist", str(tmp_path))
    assert data.x_train.shape == (7, 1, 28, 28)
    assert data.x_test.shape == (3, 1, 28, 28)
    assert data.x_train.dtype == np.float32
    assert data.y_train.dtype == np.int64
    assert data.input_shape == (1, 28, 28)
    assert data.num_classes == 10
    assert data.groups is None
    np.testing.assert_array_equal(
        pixels(data, data.x_train, "mnist")[:, 0], arrays["train-images-idx3-ubyte"]
    )
    np.testing.assert_array_equal(
        pixels(data, data.x_test, "mnist")[:, 0], arrays["t10k-images-idx3-ubyte"]
    )
    np.testing.assert_array_equal(data.y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(data.y_test, arrays["t10k-labels-idx1-ubyte"])
    # MNIST's default is pixels in [0, 1] (issue 28; standardised before)
    assert data.x_train[0, 0, 2, 20] == 1.0
    assert data.x_train[0, 0, 20, 2] == 0.0


def test_mnist_files_match_torchvision(tmp_path) -> None:
    datasets = pytest.importorskip("torchvision.datasets")
    write_mnist(str(tmp_path), np.random.default_rng(1))
    ours = load_torchvision_source("mnist", str(tmp_path))
    theirs = datasets.MNIST(str(tmp_path), train=True, download=False)
    np.testing.assert_array_equal(pixels(ours, ours.x_train, "mnist")[:, 0], theirs.data.numpy())
    np.testing.assert_array_equal(ours.y_train, theirs.targets.numpy())


def write_emnist(root: str, split: str, labels: tuple[int, int], rng: np.random.Generator):
    """EMNIST raw files store each image transposed; return the upright originals."""
    raw = os.path.join(root, "EMNIST", "raw")
    out = {}
    for part, n in (("train", 6), ("test", 4)):
        imgs = upright_images(n, rng)
        lab = rng.integers(labels[0], labels[1] + 1, n, dtype=np.uint8)
        lab[0], lab[-1] = labels  # both ends of the label range occur
        write_idx(
            os.path.join(raw, f"emnist-{split}-{part}-images-idx3-ubyte"), imgs.transpose(0, 2, 1)
        )
        write_idx(os.path.join(raw, f"emnist-{split}-{part}-labels-idx1-ubyte"), lab)
        out[part] = (imgs, lab.astype(np.int64))
    return out


def test_emnist_upright_and_matches_torchvision(tmp_path) -> None:
    written = write_emnist(str(tmp_path), "byclass", (0, 61), np.random.default_rng(2))
    data = load_torchvision_source("emnist", str(tmp_path), emnist_split="byclass")
    assert data.num_classes == 62
    assert data.input_shape == (1, 28, 28)
    for x, y, part in ((data.x_train, data.y_train, "train"), (data.x_test, data.y_test, "test")):
        np.testing.assert_array_equal(pixels(data, x, "emnist")[:, 0], written[part][0])
        np.testing.assert_array_equal(y, written[part][1])
    assert (pixels(data, data.x_train, "emnist")[:, 0, 2, 20] == 255).all()
    datasets = pytest.importorskip("torchvision.datasets")
    theirs = datasets.EMNIST(str(tmp_path), split="byclass", train=True, download=False)
    np.testing.assert_array_equal(theirs.data.numpy(), written["train"][0].transpose(0, 2, 1))


def test_emnist_letters_shifted(tmp_path) -> None:
    written = write_emnist(str(tmp_path), "letters", (1, 26), np.random.default_rng(3))
    data = load_torchvision_source("emnist", str(tmp_path), emnist_split="letters")
    assert data.num_classes == 26
    np.testing.assert_array_equal(data.y_train, written["train"][1] - 1)
    assert data.y_train.min() == 0
    assert data.y_train.max() == 25


@pytest.mark.parametrize("split", sorted(EMNIST_NUM_CLASSES))
def test_emnist_num_classes(tmp_path, split: str) -> None:
    top = EMNIST_NUM_CLASSES[split] - (0 if split == "letters" else 1)
    write_emnist(
        str(tmp_path), split, (1 if split == "letters" else 0, top), np.random.default_rng(4)
    )
    assert load_torchvision_source("emnist", str(tmp_path), emnist_split=split).num_classes == (
        {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26}.get(split, 10)
    )


def write_cifar(folder: str, files: dict[str, int], label_key: str, rng, bytes_keys=False):
    os.makedirs(folder, exist_ok=True)
    out = {}
    for fname, n in files.items():
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 100 if label_key == "fine_labels" else 10, n)]
        entry = {"data": data, label_key: labels, "batch_label": fname}
        if label_key == "fine_labels":
            entry["coarse_labels"] = [v // 5 for v in labels]
        if bytes_keys:
            entry = {k.encode(): v for k, v in entry.items()}
        with open(os.path.join(folder, fname), "wb") as f:
            pickle.dump(entry, f, protocol=2)
        out[fname] = (data.reshape(n, 3, 32, 32), np.asarray(labels, np.int64))
    return out


def patch_md5(monkeypatch, module: str) -> None:
    """Let torchvision read our (non-official) files by skipping its md5 check."""
    mod = pytest.importorskip(f"torchvision.datasets.{module}")
    monkeypatch.setattr(mod, "check_integrity", lambda *args, **kwargs: True)


def test_cifar10(tmp_path, monkeypatch) -> None:
    folder = os.path.join(tmp_path, "cifar-10-batches-py")
    files = {f"data_batch_{i}": i + 1 for i in range(1, 6)} | {"test_batch": 4}
    written = write_cifar(folder, files, "labels", np.random.default_rng(5))
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, f, protocol=2)
    data = load_torchvision_source("cifar10", str(tmp_path))
    assert data.x_train.shape == (20, 3, 32, 32)
    assert data.x_test.shape == (4, 3, 32, 32)
    assert data.num_classes == 10
    assert data.input_shape == (3, 32, 32)
    assert data.x_train.dtype == np.float32
    assert data.y_test.dtype == np.int64
    train_imgs = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    train_lab = np.concatenate([written[f"data_batch_{i}"][1] for i in range(1, 6)])
    np.testing.assert_array_equal(pixels(data, data.x_train, "cifar10"), train_imgs)
    np.testing.assert_array_equal(data.y_train, train_lab)
    np.testing.assert_array_equal(pixels(data, data.x_test, "cifar10"), written["test_batch"][0])
    np.testing.assert_array_equal(data.y_test, written["test_batch"][1])
    patch_md5(monkeypatch, "cifar")
    from torchvision import datasets

    theirs = datasets.CIFAR10(str(tmp_path), train=True, download=False)
    np.testing.assert_array_equal(theirs.data, train_imgs.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(theirs.targets, train_lab)


@pytest.mark.parametrize("bytes_keys", [False, True])
def test_cifar100(tmp_path, monkeypatch, bytes_keys: bool) -> None:
    folder = os.path.join(tmp_path, "cifar-100-python")
    written = write_cifar(
        folder,
        {"train": 9, "test": 5},
        "fine_labels",
        np.random.default_rng(6),
        bytes_keys=bytes_keys,
    )
    with open(os.path.join(folder, "meta"), "wb") as f:
        pickle.dump({"fine_label_names": [str(i) for i in range(100)]}, f, protocol=2)
    data = load_torchvision_source("cifar100", str(tmp_path))
    assert data.num_classes == 100
    assert data.x_train.shape == (9, 3, 32, 32)
    np.testing.assert_array_equal(pixels(data, data.x_train, "cifar100"), written["train"][0])
    np.testing.assert_array_equal(data.y_train, written["train"][1])  # fine, not coarse
    np.testing.assert_array_equal(data.y_test, written["test"][1])
    if not bytes_keys:
        patch_md5(monkeypatch, "cifar")
        from torchvision import datasets

        theirs = datasets.CIFAR100(str(tmp_path), train=False, download=False)
        np.testing.assert_array_equal(theirs.data, written["test"][0].transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(theirs.targets, written["test"][1])


def test_svhn(tmp_path, monkeypatch) -> None:
    sio = pytest.importorskip("scipy.io")
    rng = np.random.default_rng(7)
    written = {}
    for part, n in (("train", 6), ("test", 3)):
        imgs = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)  # (n, C, H, W)
        digits = rng.integers(0, 10, n)
        digits[0] = 0
        mat_y = np.where(digits == 0, 10, digits).astype(np.uint8).reshape(n, 1)
        sio.savemat(
            os.path.join(tmp_path, f"{part}_32x32.mat"),
            {"X": imgs.transpose(2, 3, 1, 0), "y": mat_y},
        )  # X is (H, W, C, n)
        written[part] = (imgs, digits.astype(np.int64))
    data = load_torchvision_source("svhn", str(tmp_path))
    assert data.num_classes == 10
    assert data.input_shape == (3, 32, 32)
    np.testing.assert_array_equal(pixels(data, data.x_train, "svhn"), written["train"][0])
    np.testing.assert_array_equal(data.y_train, written["train"][1])
    np.testing.assert_array_equal(data.y_test, written["test"][1])
    assert data.y_train[0] == 0
    assert data.y_train.max() <= 9
    patch_md5(monkeypatch, "svhn")
    from torchvision import datasets

    theirs = datasets.SVHN(str(tmp_path), split="train", download=False)
    np.testing.assert_array_equal(theirs.data, written["train"][0])
    np.testing.assert_array_equal(theirs.labels, written["train"][1])


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("mnist", os.path.join("MNIST", "raw")),
        ("emnist", os.path.join("EMNIST", "raw")),
        ("cifar10", "cifar-10-batches-py"),
        ("cifar100", "cifar-100-python"),
        ("svhn", ""),
    ],
)
def test_missing_files_raise_without_download(tmp_path, monkeypatch, name: str, where: str):
    monkeypatch.setattr(tvs, "_download", lambda *a: pytest.fail("download attempted"))
    expected = os.path.join(str(tmp_path), where) if where else str(tmp_path)
    for call in (
        lambda: load_torchvision_source(name, str(tmp_path)),
        lambda: check_torchvision_files(name, str(tmp_path), "byclass"),
    ):
        with pytest.raises(DatasetFilesMissing) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg
        assert f"dataset.name={name}" in msg
        assert f"under {expected} " in msg
        assert "dataset.download=true" in msg


def test_missing_message_names_the_missing_file(tmp_path) -> None:
    write_mnist(str(tmp_path), np.random.default_rng(8))
    os.remove(os.path.join(tmp_path, "MNIST", "raw", "t10k-labels-idx1-ubyte"))
    with pytest.raises(DatasetFilesMissing, match="missing t10k-labels-idx1-ubyte under"):
        load_torchvision_source("mnist", str(tmp_path))
    with pytest.raises(DatasetFilesMissing, match="emnist-letters-train-images-idx3-ubyte"):
        check_torchvision_files("emnist", str(tmp_path), "letters")


def test_root_not_set() -> None:
    with pytest.raises(DatasetFilesMissing, match=r"dataset.root is not set"):
        load_torchvision_source("cifar10", None)
    with pytest.raises(DatasetFilesMissing, match=r"dataset.root is not set"):
        load_torchvision_source("cifar10", None, download=True)


def test_download_only_when_missing(tmp_path, monkeypatch) -> None:
    calls = []

    def fake_download(name: str, root: str, split: str) -> None:
        calls.append(name)
        write_mnist(root, np.random.default_rng(9))

    monkeypatch.setattr(tvs, "_download", fake_download)
    assert load_torchvision_source("mnist", str(tmp_path), download=True).x_train.shape[0] == 7
    assert load_torchvision_source("mnist", str(tmp_path), download=True).x_test.shape[0] == 3
    assert calls == ["mnist"]


def test_bad_names_and_labels(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"dataset.name='imagenet'"):
        load_torchvision_source("imagenet", str(tmp_path))
    with pytest.raises(ValueError, match=r"dataset.name='imagenet'"):
        check_torchvision_files("imagenet", str(tmp_path), "byclass")
    with pytest.raises(ValueError, match=r"dataset.emnist_split='weird'"):
        load_torchvision_source("emnist", str(tmp_path), emnist_split="weird")
    arrays = write_mnist(str(tmp_path), np.random.default_rng(10))
    labels = arrays["train-labels-idx1-ubyte"].copy()
    labels[0] = 12
    write_idx(os.path.join(tmp_path, "MNIST", "raw", "train-labels-idx1-ubyte"), labels)
    with pytest.raises(ValueError, match=r"labels span \[\d+, 12\]"):
        load_torchvision_source("mnist", str(tmp_path))


def test_read_idx_rejects_bad_files(tmp_path) -> None:
    path = os.path.join(tmp_path, "bad-idx")
    with open(path, "wb") as f:
        f.write((0x0D03).to_bytes(4, "big") + b"\0" * 16)  # float32 IDX, not uint8
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(path)
    with open(path, "wb") as f:
        f.write((0x0801).to_bytes(4, "big") + (5).to_bytes(4, "big") + b"\1\2")
    with pytest.raises(ValueError, match="holds 2 bytes"):
        read_idx(path)


def test_unit_interval_keeps_pixels_in_0_1_and_standardize_uses_published_constants(
    tmp_path,
) -> None:
    """``dataset.normalize=unit_interval``: x = pixel / 255 exactly, in [0, 1] (MNIST's
    default); ``standardize`` uses the published constants, not the data's statistics
    (so one client's images never change another's)."""
    arrays = write_mnist(str(tmp_path), np.random.default_rng(1))
    unit = load_torchvision_source("mnist", str(tmp_path), normalize="unit_interval")
    std = load_torchvision_source("mnist", str(tmp_path), normalize="standardize")
    np.testing.assert_array_equal(
        load_torchvision_source("mnist", str(tmp_path)).x_train, unit.x_train
    )
    assert unit.x_train.min() >= 0.0 and unit.x_train.max() <= 1.0
    np.testing.assert_allclose(
        unit.x_train[:, 0], arrays["train-images-idx3-ubyte"] / 255.0, rtol=0, atol=1e-7
    )
    np.testing.assert_allclose(std.x_train, (unit.x_train - 0.1307) / 0.3081, rtol=1e-5)
    # fixed constants: the standardised images are not re-centred on their own mean
    assert float(std.x_train.mean()) != pytest.approx(0.0, abs=1e-3)
    with pytest.raises(ValueError, match="dataset.normalize"):
        load_torchvision_source("mnist", str(tmp_path), normalize="zscore")
