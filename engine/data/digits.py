"""scikit-learn's bundled 8x8 handwritten digits: real image data that runs offline.

``sklearn.datasets.load_digits`` ships 1,797 grey-scale 8x8 images (pixel values
0..16, 10 classes) inside the scikit-learn wheel, so tests and the CPU-scale presets
of ``experiments/`` can train on real images without a download. The torchvision and
LEAF loaders stay the path for full-size data.

* **Public test split.** A fixed fraction (:data:`DIGITS_TEST_FRACTION`) of the images,
  chosen by a permutation with the fixed seed :data:`DIGITS_SPLIT_SEED` (the same for
  every run, whatever ``seed``), is the global test set and is never given to a
  client. The remaining images are the pool :func:`engine.data.build_dataset`
  partitions (IID or Dirichlet), so the global test accuracy is measured on data no
  client owns (public evaluation).
* **Preprocessing** (``dataset.normalize``): pixels are scaled to [0, 1] by the fixed
  maximum 16; ``standardize`` (the default) then subtracts :data:`DIGITS_MEAN` and
  divides by :data:`DIGITS_STD`. These are constants written in this file (the role
  MNIST's published 0.1307 / 0.3081 play), never statistics of a run's clients, so one
  client's data cannot change another's inputs. ``unit_interval`` stops at [0, 1].

scikit-learn is in the ``dev`` extra; it is imported only when this source is used,
with an error naming the extra when it is missing.
"""

from __future__ import annotations

import numpy as np

from engine.data.sources import PooledData

#: Share of the 1,797 images held out as the public test set (never given to clients).
DIGITS_TEST_FRACTION = 0.2
#: Seed of the fixed permutation choosing the public test images (independent of ``seed``).
DIGITS_SPLIT_SEED = 20260101
#: Fixed standardisation constants of the [0, 1]-scaled pixels (mean and standard
#: deviation of the bundled set's pixels, computed once and written down; a test checks
#: them against the data to 1e-3). Public constants, like MNIST's 0.1307 / 0.3081.
DIGITS_MEAN = 0.3053
DIGITS_STD = 0.3760
DIGITS_NUM_CLASSES = 10
DIGITS_SHAPE = (1, 8, 8)


def _load_sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "dataset.name=digits needs scikit-learn (pip install 'dpfl[dev]' or "
            "pip install scikit-learn)"
        ) from err
    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def digits_split(n: int, test_fraction: float = DIGITS_TEST_FRACTION) -> np.ndarray:
    """Boolean mask of the public test images among ``n`` (fixed, seed-independent)."""
    perm = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(n)
    mask = np.zeros(n, dtype=bool)
    mask[perm[: int(round(test_fraction * n))]] = True
    return mask


def normalize_digits(images: np.ndarray, normalize: str = "standardize") -> np.ndarray:
    """0..16 pixels -> float32 ``(n, 1, 8, 8)`` in [0, 1], standardised with the fixed
    constants when ``normalize == "standardize"``."""
    if normalize not in ("standardize", "unit_interval"):
        raise ValueError(f"dataset.normalize={normalize!r}: expected standardize or unit_interval")
    x = (np.asarray(images, dtype=np.float32) / np.float32(16.0)).reshape(-1, *DIGITS_SHAPE)
    if normalize == "standardize":
        x = (x - np.float32(DIGITS_MEAN)) / np.float32(DIGITS_STD)
    return x.astype(np.float32)


def load_digits_source(normalize: str | None = None) -> PooledData:
    """The digits pool (clients' images) and its public test split as :class:`PooledData`.

    Args:
        normalize: ``dataset.normalize``; ``None`` means ``standardize``.

    Raises:
        ImportError: scikit-learn is not installed (names the ``dev`` extra).
    """
    images, labels = _load_sklearn_digits()
    x = normalize_digits(images, normalize or "standardize")
    test = digits_split(len(labels))
    return PooledData(
        x_train=x[~test],
        y_train=labels[~test],
        x_test=x[test],
        y_test=labels[test],
        num_classes=DIGITS_NUM_CLASSES,
        input_shape=DIGITS_SHAPE,
        groups=None,
    )
