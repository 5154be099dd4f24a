"""Write tiny MNIST-format IDX gzip files for tests (real format, synthetic content)."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def write_idx_images(path: Path, images: np.ndarray) -> None:
    n, h, w = images.shape
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">IIII", 0x00000803, n, h, w))
        f.write(images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">II", 0x00000801, len(labels)))
        f.write(labels.astype(np.uint8).tobytes())


def write_fake_mnist(root: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> None:
    """Learnable fake digits: label k lights up row block k of a 28x28 image."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, 10, size=n)
        images = rng.integers(0, 40, size=(n, 28, 28))
        for i, k in enumerate(labels):
            images[i, 2 * k + 4: 2 * k + 6, 4:24] = 255
        img_name, lbl_name = FILES[split]
        write_idx_images(Path(root) / img_name, images)
        write_idx_labels(Path(root) / lbl_name, labels)
