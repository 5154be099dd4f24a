"""Atomic state files: written whole or not at all, read back verified.

A file is written to a temporary name, flushed and ``fsync``-ed, then ``os.replace``-d into
place, so a crash leaves either the old file or the new one, never half of one. A dict saved by
:func:`save_atomic` carries the CRC-32 of everything else in it, checked by :func:`verify`, and
files are read with ``torch.load(weights_only=True)``: a file cannot execute code. Failures say
what the file is (empty, truncated, not a torch archive, a full disk) and what to do.
Checkpoints (:mod:`parlay.checkpoint`) and parameter-server shards are written this way.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import zipfile
from pathlib import Path
from typing import Any, BinaryIO
from collections.abc import Callable

import torch

from parlay.errors import CheckpointError
from parlay.integrity import state_crc

__all__ = ["save_atomic", "write_atomic", "remove_temporaries", "read_atomic", "verify",
           "CRC_KEY"]

log = logging.getLogger("parlay")

#: Key of the CRC-32 of everything else in a file that :func:`save_atomic` writes.
CRC_KEY = "parlay_crc32"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # e.g. platforms that cannot open directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], object], what: str, hint: str, *,
                 durable: bool = True) -> None:
    """Have ``write`` fill a temporary file next to ``path``, then rename it to ``path``: a
    reader sees the old file or the whole new one, and a process killed in between leaves only
    a temporary file (its owner removes it when it opens the folder again). ``durable``: the
    file and its folder are ``fsync``-ed too (a disk's, not host memory's, crash safety).

    Raises:
        CheckpointError: The file could not be written: "could not write ``what`` ``path``",
            the cause and ``hint`` (the previous file, if any, is intact).
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            _fsync_dir(path.parent)
    except Exception as e:  # noqa: BLE001 - disk errors and unpicklable state alike
        tmp.unlink(missing_ok=True)
        cause = (f"no space left on device (the file system of {path.parent} is full)"
                 if _no_space(e) else str(e))
        raise CheckpointError(f"could not write {what} {path}: {cause}. Hint: {hint}") from e


def remove_temporaries(directory: str | os.PathLike[str], names: str) -> None:
    """Remove the temporary files :func:`write_atomic` left in ``directory`` for the files
    matching the glob ``names`` (a process killed while writing); their owner calls this when
    it opens the folder again."""
    for stale in Path(directory).glob(f".{names}.tmp*"):
        stale.unlink(missing_ok=True)


def _no_space(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception it was raised from is ``ENOSPC`` (torch's writer reports
    a full disk as ``unexpected pos ...``, with the ``OSError`` as its context)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return False


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` atomically: temp file, flush, fsync, rename. A dict is
    saved with the CRC-32 of its contents under :data:`CRC_KEY`, which :func:`verify`
    checks.

    Raises:
        CheckpointError: The file could not be written (the previous file, if any, is intact).
    """
    if isinstance(obj, dict):
        obj = {**obj, CRC_KEY: state_crc(obj)}
    write_atomic(Path(path), lambda f: torch.save(obj, f), "checkpoint",
                 f"check free disk space and write permission of {Path(path).parent}, and that "
                 "the state holds only tensors and plain Python values.")


_RETRY = ("e.g. the disk filled up or a copy was cut short; delete it and the previous "
          "checkpoint is used.")


def read_atomic(path: Path, what: str = "checkpoint", retry: str = _RETRY) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, every failure a
    :class:`CheckpointError` that says what the file is (``what``) and what happens next
    (``retry``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError...
        raise CheckpointError(_unreadable(path, e, what, retry)) from e


def verify(obj: Any, path: Path, what: str = "checkpoint", retry: str = _RETRY, *,
           required: bool = False) -> Any:
    """``obj`` (read from ``path``) without its checksum, once the checksum matches.

    A dict without one was written before files carried checksums: it is returned with a
    warning, or refused when ``required``.

    Raises:
        CheckpointError: The contents changed after the file was written (a flipped bit or
            byte on disk or in a copy), or ``required`` and the checksum is missing.
    """
    if not isinstance(obj, dict):
        return obj
    if CRC_KEY not in obj:
        if required:
            raise CheckpointError(f"{what} {path} carries no checksum: it is corrupt or was "
                                  f"not written by parlay. It is not used. Hint: {retry}")
        log.warning("%s %s predates checksums: it is loaded unverified", what, path)
        return obj
    crc = obj.pop(CRC_KEY)
    if crc != state_crc(obj):
        raise CheckpointError(f"{what} {path} fails its checksum: its contents changed after it "
                              "was written (a flipped bit or byte, on disk or in a copy). It is "
                              f"not used. Hint: {retry}")
    return obj


def _is_zip(path: Path) -> bool:
    """``zipfile.is_zipfile``, which itself raises on some corrupt archives (a flipped byte in
    the zip64 end record: "zipfiles that span multiple disks are not supported")."""
    try:
        return zipfile.is_zipfile(path)
    except zipfile.BadZipFile:
        return False


def _unreadable(path: Path, err: BaseException, what: str, retry: str) -> str:
    """Why ``torch.load`` failed on ``path``, told apart by what the file is (torch's own
    message for a non-archive speaks of weights_only, which would mislead)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    cause = f" ({type(err).__name__}: {text.splitlines()[0]})" if text else ""
    size = path.stat().st_size if path.exists() else 0
    if size == 0:
        state = "empty (0 bytes): it is truncated or corrupt"
    elif not _is_zip(path):
        state = (f"not a valid {what} file ({size} bytes that are not a torch.save archive): it is "
                 "truncated or corrupt")
    elif "weights_only" in text or "Unsupported global" in text:
        return (f"{what} {path} holds objects that weights_only loading refuses{cause}. "
                "Hint: parlay writes only tensors and plain values; a file holding other "
                "objects was not written by parlay (unpickling it could run code), so it is "
                "not loaded.")
    else:
        state = f"unreadable: it is truncated or corrupt{cause}"
    return f"{what} {path} is {state}. Hint: {retry}"
