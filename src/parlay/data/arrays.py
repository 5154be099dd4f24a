"""TensorLayer-shaped data helpers: MNIST as six arrays, and arrays to a dataset in one call.

TensorLayer's ``tl.files.load_mnist_dataset(shape=(-1, 784))`` returned
``X_train, y_train, X_val, y_val, X_test, y_test`` (50,000 / 10,000 / 10,000: the last 10,000
training images are the validation split), pixels as float32 in ``[0, 1]``. Code written
against it runs unchanged on :func:`load_mnist_dataset`; :func:`from_arrays` turns any pair of
arrays into the map-style dataset the :class:`~parlay.Trainer` takes.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from parlay.data.mnist import MEAN, STD, mnist
from parlay.errors import ConfigError

__all__ = ["load_mnist_dataset", "from_arrays"]

_VAL = 10_000


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise ConfigError(f"shape must be a sequence of ints such as (-1, 784) or "
                          f"(-1, 28, 28, 1), got {shape!r}.") from None
    known = [d for d in dims if d != -1]
    if dims[:1] != (-1,) or dims.count(-1) != 1 or any(d < 1 for d in known) \
            or int(np.prod(known)) != 784:
        raise ConfigError(f"shape {dims} cannot hold 28x28 images: use one -1 first (the image "
                          "count) and dimensions multiplying to 784, e.g. (-1, 784), "
                          "(-1, 28, 28, 1) or (-1, 1, 28, 28).")
    return dims


def load_mnist_dataset(shape: Sequence[int] = (-1, 784), path: str | os.PathLike[str] | None = None,
                       download: bool = True) -> tuple[np.ndarray, ...]:
    """MNIST as TensorLayer returned it: ``X_train, y_train, X_val, y_val, X_test, y_test``.

    Args:
        shape: Shape of each image array, ``-1`` (first) standing for the image count (e.g.
            ``(-1, 784)`` for an MLP, ``(-1, 1, 28, 28)`` for a PyTorch CNN).
        path: Folder of the four IDX files (default: as :func:`parlay.data.mnist`, i.e.
            ``PARLAY_DATA_DIR``, the cache, the copy bundled with parlay, then a download).
        download: Fetch missing files.

    Returns:
        Six NumPy arrays: images float32 in ``[0, 1]`` (50,000 / 10,000 / 10,000 of them) and
        labels int64 (PyTorch's class-index type; TensorLayer used int32).

    Raises:
        ConfigError: A shape that cannot hold 28x28 images, or the files cannot be found.
    """
    dims = _check_shape(shape)
    out: list[np.ndarray] = []
    for train in (True, False):
        ds = mnist(path, train=train, download=download)
        # parlay.data.mnist normalises; TensorLayer's arrays are plain pixels / 255.
        x = (ds.images * STD + MEAN).clamp_(0.0, 1.0).numpy().astype(np.float32)
        x = x.reshape(dims)
        y = ds.labels.numpy().astype(np.int64)
        if train:
            out += [x[:-_VAL], y[:-_VAL], x[-_VAL:], y[-_VAL:]]
        else:
            out += [x, y]
    return tuple(out)


def _as_tensor(name: str, a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    try:
        arr = np.asarray(a)
        if arr.dtype.kind not in "biufc":  # strings, objects: torch cannot take them
            raise TypeError(f"dtype {arr.dtype}")
        return torch.as_tensor(arr)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"from_arrays' {name} must be numbers of one shape per sample (an "
                          f"array, tensor or rectangular nested list), got {type(a).__name__} "
                          f"({e}). Hint: map labels to class indices (e.g. np.unique(y, "
                          "return_inverse=True)[1]) and pad or crop samples to one shape.") from e


def from_arrays(inputs: Any, targets: Any, *,
                dtype: torch.dtype | None = torch.float32) -> TensorDataset:
    """A training dataset of ``(input, target)`` pairs from two arrays, in one call.

    Args:
        inputs: A NumPy array, tensor or nested list with one sample per row.
        targets: Same length; integer targets become int64 (class indices for
            ``nn.CrossEntropyLoss``), floating ones keep their values as float32.
        dtype: Type for floating (or uint8 pixel) ``inputs``; None keeps theirs. Other
            integer inputs (e.g. token ids for an embedding) are kept as they are.

    Returns:
        A ``TensorDataset`` usable as the Trainer's ``training_dataset``.

    Raises:
        ConfigError: The two arrays differ in length, are empty, or are not numbers of one
            shape (string labels, ragged lists).
    """
    if inputs is None or targets is None:
        raise ConfigError("from_arrays needs inputs and targets (arrays or tensors), got None.")
    x, y = _as_tensor("inputs", inputs), _as_tensor("targets", targets)
    if x.ndim == 0 or y.ndim == 0 or len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"from_arrays needs two non-empty arrays of the same length, got "
                          f"{tuple(x.shape)} inputs and {tuple(y.shape)} targets.")
    if dtype is not None and (x.is_floating_point() or x.dtype == torch.uint8):
        x = x.to(dtype)  # pixels become floats; integer token ids stay integers
    y = y.long() if not y.is_floating_point() else y.float()
    return TensorDataset(x.contiguous(), y.contiguous())
