"""Image sources in torchvision's on-disk layout: MNIST, Fashion-MNIST, EMNIST, CIFAR, SVHN.

Files are expected exactly where ``torchvision.datasets`` keeps them under ``root``:

* ``mnist``: ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (IDX)
* ``fashion_mnist``: the same four IDX names, directly under ``root`` (Debian's package
  ``dataset-fashion-mnist`` installs them, gzipped, in :data:`FASHION_MNIST_ROOT`, the
  default root) or under ``root/FashionMNIST/raw`` (torchvision's layout)
* ``emnist``: ``root/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte``
* ``cifar10``: ``root/cifar-10-batches-py/{data_batch_1..5,test_batch}`` (python pickles)
* ``cifar100``: ``root/cifar-100-python/{train,test}`` (python pickles)
* ``svhn``: ``root/{train,test}_32x32.mat`` (MATLAB v5, read with scipy)

IDX files may also be gzipped (``<name>.gz``), as distributed upstream.

torchvision is used only to *download* (``download=True``, and only when files are
missing); reading is done here, with the same parsing as torchvision, because
torchvision's CIFAR and SVHN classes refuse any file whose md5 differs from the
official release (so subsets or re-packed copies cannot be used), its MNIST class
cannot read ``.gz`` files, and indexing its dataset objects per example is slow.
The existence check runs before anything else, so no network access is attempted
unless ``download=True``.

Images become float32 NCHW scaled to [0, 1]; with ``standardize`` (the default of the
colour sources, see :data:`DEFAULT_NORMALIZE`) they are then normalised per channel
with the fixed constants in :data:`NORMALIZATION`. EMNIST's raw files store images
transposed relative to MNIST (torchvision does not undo this); they are transposed
back so characters are upright. Labels are int64 in ``[0, num_classes)``: EMNIST
``letters`` labels 1..26 become 0..25, and SVHN's label 10 (digit 0) becomes 0.
"""

from __future__ import annotations

import gzip
import os
import pickle
from typing import Any

import numpy as np

from engine.data.sources import DatasetFilesMissing, PooledData

#: Per-channel (mean, std) applied after scaling pixels to [0, 1]. MNIST and CIFAR
#: values are the usual published training-set statistics; EMNIST uses the commonly
#: quoted EMNIST statistics for every split; SVHN the usual training-set statistics.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "emnist": ((0.1751,), (0.3332,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}

#: Number of classes of each EMNIST split (``letters`` after shifting 1..26 to 0..25).
EMNIST_NUM_CLASSES: dict[str, int] = {
    "byclass": 62,
    "bymerge": 47,
    "balanced": 47,
    "letters": 26,
    "digits": 10,
    "mnist": 10,
}

TORCHVISION_SOURCES: tuple[str, ...] = (
    "mnist",
    "fashion_mnist",
    "emnist",
    "cifar10",
    "cifar100",
    "svhn",
)

#: Where Debian's ``dataset-fashion-mnist`` package installs the four ``.gz`` files;
#: ``dataset.root`` defaults to it for ``fashion_mnist``.
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE_HINT = (
    "install Debian's package dataset-fashion-mnist (apt-get install dataset-fashion-mnist), "
    "or set dataset.root to a folder holding these files (or dataset.download=true when online)"
)

#: Input preprocessing when ``dataset.normalize`` is null: the 28x28 grey-scale sources
#: stay in [0, 1] as in the FedAvg paper, TensorFlow Federated's EMNIST and LEAF's
#: FEMNIST (and, at C = 1, a 3-5 point gain for DP-FedAvg on MNIST: docs/fidelity.md);
#: the colour sources are standardised per channel, as the CIFAR codebases of the
#: FedSAM / DP-FedSAM papers do.
DEFAULT_NORMALIZE: dict[str, str] = {
    "mnist": "unit_interval",
    "fashion_mnist": "unit_interval",
    "emnist": "unit_interval",
    "cifar10": "standardize",
    "cifar100": "standardize",
    "svhn": "standardize",
}

_IDX_FORMAT = "IDX files, optionally .gz"


def _layout(name: str, root: str, emnist_split: str) -> tuple[str, list[str], str]:
    """Folder, file names (train files first) and a format description (``name`` valid)."""
    if name in ("mnist", "fashion_mnist"):
        files = [
            f"{s}-{k}"
            for s in ("train", "t10k")
            for k in ("images-idx3-ubyte", "labels-idx1-ubyte")
        ]
        if name == "mnist":
            return os.path.join(root, "MNIST", "raw"), files, _IDX_FORMAT
        torchvision_folder = os.path.join(root, "FashionMNIST", "raw")
        if _existing(root, files[0], True) is None and os.path.isdir(torchvision_folder):
            return torchvision_folder, files, _IDX_FORMAT
        return root, files, _IDX_FORMAT
    if name == "emnist":
        files = [
            f"emnist-{emnist_split}-{s}-{k}"
            for s in ("train", "test")
            for k in ("images-idx3-ubyte", "labels-idx1-ubyte")
        ]
        return os.path.join(root, "EMNIST", "raw"), files, _IDX_FORMAT
    if name == "cifar10":
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        return os.path.join(root, "cifar-10-batches-py"), files, "CIFAR python pickles"
    if name == "cifar100":
        return os.path.join(root, "cifar-100-python"), ["train", "test"], "CIFAR python pickles"
    return root, ["train_32x32.mat", "test_32x32.mat"], "SVHN MATLAB .mat files"


def _validate(name: str, emnist_split: str) -> None:
    if name not in TORCHVISION_SOURCES:
        raise ValueError(
            f"dataset.name={name!r} is not a torchvision source; expected one of "
            f"{', '.join(TORCHVISION_SOURCES)}"
        )
    if name == "emnist" and emnist_split not in EMNIST_NUM_CLASSES:
        raise ValueError(
            f"dataset.emnist_split={emnist_split!r} must be one of {', '.join(EMNIST_NUM_CLASSES)}"
        )


def _existing(folder: str, fname: str, gz_ok: bool) -> str | None:
    """Path of ``fname`` in ``folder`` (or of its ``.gz`` twin when allowed), else None."""
    path = os.path.join(folder, fname)
    if os.path.isfile(path):
        return path
    if gz_ok and os.path.isfile(path + ".gz"):
        return path + ".gz"
    return None


def _missing_message(name: str, root: str | None, emnist_split: str) -> str | None:
    """One-line error if any file of ``name`` is absent under ``root``, else None."""
    folder, files, fmt = _layout(name, root if root is not None else "<root>", emnist_split)
    hint = "set dataset.root to the folder that holds them or dataset.download=true when online"
    if name == "fashion_mnist":
        hint = FASHION_MNIST_PACKAGE_HINT
        if root == FASHION_MNIST_ROOT and not os.path.isdir(root):
            return (
                f"dataset.name=fashion_mnist: {root} (the default dataset.root) does not exist; "
                f"{hint}"
            )
    if root is None:
        return (
            f"dataset.name={name}: dataset.root is not set (expected torchvision's layout: "
            f"{', '.join(files)} under {folder}, {fmt}); {hint}"
        )
    missing = [f for f in files if _existing(folder, f, fmt == _IDX_FORMAT) is None]
    if not missing:
        return None
    where = f"under {folder}"
    if name == "fashion_mnist":
        where += f" or {os.path.join(folder, 'FashionMNIST', 'raw')}"
    return (
        f"dataset.name={name}: missing {', '.join(missing)} under {folder} (expected "
        f"{', '.join(files)} {where}, {fmt}); {hint}"
    )


def check_torchvision_files(name: str, root: str | None, emnist_split: str = "byclass") -> None:
    """Raise :class:`DatasetFilesMissing` unless every file of ``name`` is under ``root``.

    Only checks that the files exist (cheap; meant for validation before any work).
    Raises ``ValueError`` for an unknown ``name`` or EMNIST split.
    """
    _validate(name, emnist_split)
    root = default_root(name, root)
    msg = _missing_message(name, root, emnist_split)
    if msg is not None:
        raise DatasetFilesMissing(msg)


def source_files(name: str, root: str | None, emnist_split: str = "byclass") -> list[str]:
    """The paths of ``name``'s files under ``root`` (each file's own path, or its ``.gz``
    twin where one is allowed and present), in :func:`_layout`'s order; empty when
    ``root`` is unset. For checks that read the files' first bytes."""
    _validate(name, emnist_split)
    root = default_root(name, root)
    if root is None:
        return []
    folder, files, fmt = _layout(name, root, emnist_split)
    return [_existing(folder, f, fmt == _IDX_FORMAT) or os.path.join(folder, f) for f in files]


def default_root(name: str, root: str | None) -> str | None:
    """``root`` with ``~`` expanded; for ``fashion_mnist`` a null root is
    :data:`FASHION_MNIST_ROOT` (where Debian's package installs the files)."""
    if root is None:
        return FASHION_MNIST_ROOT if name == "fashion_mnist" else None
    return os.path.expanduser(root)


def _download(name: str, root: str, emnist_split: str) -> None:
    """Fetch ``name`` into ``root`` with torchvision (which verifies the official md5s)."""
    from torchvision import datasets

    try:
        if name == "mnist":
            datasets.MNIST(root, train=True, download=True)
        elif name == "fashion_mnist":
            datasets.FashionMNIST(root, train=True, download=True)
        elif name == "emnist":
            datasets.EMNIST(root, split=emnist_split, train=True, download=True)
        elif name == "cifar10":
            datasets.CIFAR10(root, train=True, download=True)
        elif name == "cifar100":
            datasets.CIFAR100(root, train=True, download=True)
        else:
            for split in ("train", "test"):
                datasets.SVHN(root, split=split, download=True)
    except Exception as err:  # network errors come in many types (URLError, RuntimeError, ...)
        raise RuntimeError(f"dataset.name={name}: download into {root} failed: {err}") from err


def read_idx(path: str) -> np.ndarray:
    """Read an unsigned-byte IDX file (plain or ``.gz``) as torchvision's MNIST does."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim, dtype_code = magic & 0xFF, (magic >> 8) & 0xFF
    if magic >> 16 != 0 or dtype_code != 0x08 or not 1 <= ndim <= 3:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {magic:#010x})")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 * (ndim + 1)
    arr = np.frombuffer(data, dtype=np.uint8, offset=offset)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {arr.size} bytes of data")
    return arr.reshape(dims)


def _pickle_get(entry: dict[Any, Any], key: str) -> Any:
    """Look up ``key`` in a CIFAR pickle whose keys may be str (latin1) or bytes."""
    if key in entry:
        return entry[key]
    return entry.get(key.encode())


def _read_cifar(paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate CIFAR pickles into uint8 NCHW images and int64 (fine) labels."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        lab = _pickle_get(entry, "labels")
        if lab is None:
            lab = _pickle_get(entry, "fine_labels")
        data = _pickle_get(entry, "data")
        if data is None or lab is None:
            raise ValueError(f"{path}: CIFAR pickle lacks 'data' or 'labels'/'fine_labels'")
        images.append(np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(lab, dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def _read_svhn(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read an SVHN ``*_32x32.mat`` file: X (32, 32, 3, n) uint8 and y (n, 1)."""
    try:
        import scipy.io as sio
    except ImportError as err:  # pragma: no cover - scipy is a declared dependency
        raise ImportError("dataset.name=svhn needs scipy to read .mat files") from err
    mat = sio.loadmat(path)
    images = np.transpose(mat["X"], (3, 2, 0, 1))  # as torchvision: (n, C, H, W)
    labels = mat["y"].astype(np.int64).reshape(-1)
    labels[labels == 10] = 0  # SVHN labels digit 0 as 10
    return np.ascontiguousarray(images, dtype=np.uint8), labels


def _normalise(images: np.ndarray, name: str, normalize: str) -> np.ndarray:
    """uint8 NCHW -> float32 scaled to [0, 1]; with ``standardize`` then (x - mean) / std
    per channel with the published constants of :data:`NORMALIZATION` (never statistics
    of the run's clients). ``unit_interval`` stops at [0, 1] (``dataset.normalize``)."""
    if normalize not in ("standardize", "unit_interval"):
        raise ValueError(f"dataset.normalize={normalize!r}: expected standardize or unit_interval")
    mean, std = NORMALIZATION[name]
    x = images.astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    if normalize == "unit_interval":
        return x
    x -= np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    x /= np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    return x


def _read_split(name: str, paths: list[str], emnist_split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (uint8 NCHW) and labels (int64) of one split from its files."""
    if name in ("mnist", "fashion_mnist", "emnist"):
        images, labels = read_idx(paths[0]), read_idx(paths[1]).astype(np.int64)
        if name == "emnist":
            images = images.transpose(0, 2, 1)  # raw EMNIST is stored transposed
            if emnist_split == "letters":
                labels = labels - 1
        return np.ascontiguousarray(images[:, None]), labels
    if name in ("cifar10", "cifar100"):
        return _read_cifar(paths)
    return _read_svhn(paths[0])


def load_torchvision_source(
    name: str,
    root: str | None,
    download: bool = False,
    emnist_split: str = "byclass",
    normalize: str | None = None,
) -> PooledData:
    """Load ``name`` (mnist, fashion_mnist, emnist, cifar10, cifar100, svhn) from ``root``.

    Args:
        name: Source name.
        root: Folder in torchvision's layout (see the module docstring); for
            ``fashion_mnist`` None means :data:`FASHION_MNIST_ROOT`.
        download: Download with torchvision when files are missing (needs network;
            needs an explicit ``root``).
        emnist_split: EMNIST split (byclass, bymerge, balanced, letters, digits, mnist).
        normalize: ``standardize`` (published per-channel constants), ``unit_interval``,
            or None for the source's default (:data:`DEFAULT_NORMALIZE`).

    Returns:
        :class:`PooledData` with normalised float32 NCHW images, int64 labels and
        ``groups=None`` (these sources have no natural clients).

    Raises:
        DatasetFilesMissing: files are absent and ``download`` is false (one line
            naming the expected paths and format).
        ValueError: unknown ``name``/``emnist_split``, malformed files or labels.
    """
    _validate(name, emnist_split)
    given_root = root
    root = default_root(name, root)
    msg = _missing_message(name, root, emnist_split)
    if msg is not None:
        if not download or given_root is None or root is None:
            raise DatasetFilesMissing(msg)
        _download(name, root, emnist_split)
        check_torchvision_files(name, root, emnist_split)
    assert root is not None
    folder, files, fmt = _layout(name, root, emnist_split)
    paths = [_existing(folder, f, fmt == _IDX_FORMAT) or "" for f in files]
    n_train_files = {"cifar10": 5, "cifar100": 1, "svhn": 1}.get(name, 2)
    x_train, y_train = _read_split(name, paths[:n_train_files], emnist_split)
    x_test, y_test = _read_split(name, paths[n_train_files:], emnist_split)

    num_classes = {"emnist": EMNIST_NUM_CLASSES[emnist_split], "cifar100": 100}.get(name, 10)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if len(x) != len(y):
            raise ValueError(f"dataset.name={name}: {split} has {len(x)} images, {len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(
                f"dataset.name={name}: {split} labels span [{y.min()}, {y.max()}], "
                f"expected [0, {num_classes})"
            )
    normalize = normalize if normalize is not None else DEFAULT_NORMALIZE[name]
    return PooledData(
        x_train=_normalise(x_train, name, normalize),
        y_train=y_train.astype(np.int64),
        x_test=_normalise(x_test, name, normalize),
        y_test=y_test.astype(np.int64),
        num_classes=num_classes,
        input_shape=tuple(int(d) for d in x_train.shape[1:]),
        groups=None,
    )
