"""MNIST from the four original IDX gzip files: find, download, verify, cache, load.

Where the files are looked for, in order: the ``root`` argument, the ``PARLAY_DATA_DIR``
environment variable, the user's cache directory (``$XDG_CACHE_HOME/parlay/mnist``, by default
``~/.cache/parlay/mnist``), then (when no ``root`` is given) the copy bundled with parlay
(``parlay/data/mnist_files``, MD5-checked like any other), so a fresh clone trains with no
network. Only when all of these lack a file is it downloaded (``download=True``) from the known
mirrors into the folder, with a progress bar, through a temporary file that is renamed only
after its MD5 matched the published one, so concurrent ranks and interrupted downloads never
leave a half file behind.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import struct
import sys
import tempfile
import urllib.error
import urllib.request
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from parlay.errors import ConfigError, ParlayError

__all__ = ["MNIST", "mnist", "default_root", "bundled_root", "FILES", "MIRRORS", "MEAN", "STD"]

#: File name -> published MD5.
FILES: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
_SPLITS = {True: ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
           False: ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}

#: Mirrors tried in order (each serves the four files under these names).
MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

#: Mean and standard deviation of the training pixels (scaled to [0, 1]).
MEAN, STD = 0.1307, 0.3081


class MNIST(TensorDataset):
    """MNIST as tensors: ``images`` float32 ``(N, 1, 28, 28)`` normalised by :data:`MEAN` and
    :data:`STD`, ``labels`` int64 ``(N,)``. Indexing returns ``(image, label)``.

    Attributes:
        images: The normalised images.
        labels: The digit labels 0..9.
        root: Folder the files were read from.
        train: Whether this is the 60,000-image training split.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, root: Path, train: bool) -> None:
        super().__init__(images, labels)
        self.images, self.labels, self.root, self.train = images, labels, root, train

    def __repr__(self) -> str:
        split = "train" if self.train else "test"
        return f"MNIST({split}, {len(self)} images, root={str(self.root)!r})"


def default_root() -> Path:
    """``PARLAY_DATA_DIR`` if set, else ``$XDG_CACHE_HOME/parlay/mnist`` (``~/.cache/...``)."""
    env = os.environ.get("PARLAY_DATA_DIR")
    return Path(env).expanduser() if env else _cache_root()


def _cache_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "parlay" / "mnist"


def bundled_root() -> Path:
    """The folder of the MNIST files shipped inside the parlay package."""
    return Path(__file__).resolve().parent / "mnist_files"


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(name: str, folder: Path, mirrors: Sequence[str], md5: str | None) -> list[str]:
    """Fetch ``name`` into ``folder``; returns the errors of the mirrors that failed."""
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    errors: list[str] = []
    new = [p for p in (folder, *folder.parents) if not p.exists()]  # removed again on failure
    for base in mirrors:
        url, tmp = base.rstrip("/") + "/" + name, ""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder)
            req = urllib.request.Request(url, headers={"User-Agent": "parlay"})
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(req, timeout=30) as r:
                total = int(r.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc=name, leave=False,
                          disable=not sys.stderr.isatty()) as bar:
                    for chunk in iter(lambda: r.read(1 << 16), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            got = _md5(Path(tmp))
            if md5 is not None and got != md5:
                errors.append(f"{url}: MD5 {got} != published {md5}")
                continue
            os.replace(tmp, folder / name)
            return errors
        except (urllib.error.URLError, OSError, ValueError) as e:
            errors.append(f"{url}: {getattr(e, 'reason', e)}")
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
    for p in new:  # deepest first; only folders left empty
        try:
            p.rmdir()
        except OSError:
            break
    return errors


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ParlayError(f"{path} is not a readable gzip file ({e}). Hint: delete it and "
                          "download it again.") from e
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ParlayError(f"{path}: file too short for an IDX header ({len(data)} bytes).")
    got_magic, *dims = struct.unpack(f">{1 + ndim}I", data[:header])
    if got_magic != magic:
        raise ParlayError(f"{path}: expected IDX magic {magic}, got {got_magic}. Hint: the "
                          "image and label files may be swapped or the file is not MNIST.")
    count = int(np.prod(dims))
    if len(data) - header != count:
        raise ParlayError(f"{path}: header announces {dims} = {count} bytes of data, file has "
                          f"{len(data) - header}. Hint: the file is truncated; delete it.")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def mnist(root: str | os.PathLike[str] | None = None, train: bool = True,
          download: bool = True, *, verify: bool | Mapping[str, str] = True,
          mirrors: Sequence[str] = MIRRORS, bundled: bool = True) -> MNIST:
    """Load an MNIST split, downloading and verifying the files when needed.

    Args:
        root: Folder of the four ``*-ubyte.gz`` files (default ``PARLAY_DATA_DIR``, else the cache).
        train: The 60,000-image training split (else the 10,000-image test split).
        download: Fetch missing files from ``mirrors``.
        verify: Check MD5s: ``True`` (the published ones), ``False``, or ``{file name: md5}``.
        mirrors: Base URLs to try in order.
        bundled: With no ``root``, read the copy shipped with parlay when ``PARLAY_DATA_DIR``
            (or the cache) lacks the files, before downloading.

    Returns:
        An :class:`MNIST` dataset of normalised float32 images and int64 labels.
    Raises:
        ConfigError: The files are missing and could not be downloaded (the message says where
            to put them), or an MD5 does not match.
        ParlayError: A file is not a valid IDX gzip file.
    """
    folder = Path(root).expanduser() if root is not None else default_root()
    sums: Mapping[str, str] = FILES if verify is True else ({} if verify is False else verify)
    if not isinstance(train, bool):
        raise ConfigError(f"train must be True (the 60,000 training images) or False (the "
                          f"10,000 test images), got {train!r}.")
    if root is not None and folder.exists() and not folder.is_dir():
        raise ConfigError(f"root={str(root)!r} is a file, not a folder. Hint: pass the folder "
                          f"that holds the four MNIST files, e.g. root={str(folder.parent)!r}.")
    names = _SPLITS[train]
    missing = [n for n in names if not (folder / n).is_file()]
    # Without root=: PARLAY_DATA_DIR, then the cache, then the bundled copy, then a download.
    cache = _cache_root()
    others = ([cache] if folder != cache else []) + ([bundled_root()] if bundled else [])
    for other in others if missing and root is None else []:
        if all((other / n).is_file() for n in names):
            if folder != cache:
                warnings.warn(f"PARLAY_DATA_DIR={str(folder)!r} (parlay demo: --data) lacks "
                              f"{', '.join(missing)}: MNIST is read from {other} instead.",
                              stacklevel=2)
            folder, missing = other, []
            break
    failures: list[str] = []
    if missing and download:
        for n in missing:
            errs = _download(n, folder, mirrors, sums.get(n))
            failures += errs
            if not (folder / n).is_file():
                break  # offline: do not wait on every mirror for every file
        missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        tried = ("\n  download attempts:\n    " + "\n    ".join(failures)) if failures else (
            "\n  download=False, so nothing was downloaded." if not download else "")
        raise ConfigError(
            f"MNIST file(s) {', '.join(missing)} not found in {folder}.{tried}\n"
            f"  Hint: put the four MNIST files ({', '.join(FILES)}) in a folder and pass it as "
            "root=... (parlay demo: --data DIR) or set PARLAY_DATA_DIR=DIR; with internet "
            f"access they are downloaded into {folder}.")
    for n in names:
        want = sums.get(n)
        if want is not None:
            got = _md5(folder / n)
            if got != want:
                raise ConfigError(
                    f"{folder / n}: expected MD5 {want}, got {got}. Hint: the file is corrupt "
                    "or not the original MNIST file; delete it to download it again (parlay "
                    "demo: or pass --data DIR with the original files), or pass verify=False "
                    "to parlay.data.mnist for your own IDX files.")
    img = _read_idx(folder / names[0], 2051, 3)
    lbl = _read_idx(folder / names[1], 2049, 1)
    if img.shape[0] != lbl.shape[0]:
        raise ParlayError(f"{folder}: {img.shape[0]} images but {lbl.shape[0]} labels.")
    images = torch.from_numpy(img.copy()).unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
    labels = torch.from_numpy(lbl.astype(np.int64))
    return MNIST(images.contiguous(), labels, folder, bool(train))
