"""How a snapshot is stored: the state's structure as JSON plus a flat list of tensors, written
atomically, read back without unpickling anything but tensors.

:func:`encode` turns a state (dicts, lists, tuples, tensors, numbers, strings, None) into a
JSON-able skeleton whose tensors are replaced by their index in a flat list; :func:`decode`
reverses it. Tensors go to a ``torch.save`` file read with ``weights_only=True``; the skeleton
goes to a JSON commit record.
"""
from __future__ import annotations

import hashlib
import mmap
from pathlib import Path
from typing import Any, BinaryIO
from collections.abc import Callable

import torch

from parlay import checkpoint
from parlay.errors import CheckpointError

__all__ = ["encode", "decode", "layout", "write_atomic", "map_shared"]


_PLAIN = frozenset({type(None), bool, int, float, str})


def encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able structure of ``obj``; its tensors are appended to ``tensors`` (referenced,
    not copied) and replaced by their index.

    Raises:
        CheckpointError: ``obj`` holds something else than the types above, or a sparse
            tensor.
    """
    cls = type(obj)  # exact types first: a snapshot walks the whole state every step
    if cls in _PLAIN:
        return obj
    if cls is dict or isinstance(obj, dict):
        return {"D": [[k if type(k) in _PLAIN else encode(k, tensors), encode(v, tensors)]
                      for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise CheckpointError(f"snapshots hold dense tensors; the state has a {obj.layout} "
                                  "one. Hint: snapshot_every=0 for this model.")
        tensors.append(obj.detach())
        return {"T": len(tensors) - 1}
    if isinstance(obj, (list, tuple)):
        return {"L" if isinstance(obj, list) else "U": [encode(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):  # subclasses (IntEnum...)
        return obj
    raise CheckpointError(f"a snapshot holds tensors, numbers, strings, None, lists, tuples and "
                          f"dicts; the state has a {cls.__name__}. Hint: store it as a "
                          "tensor or a plain value in state_dict().")


def decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    """The state :func:`encode` described, with its tensors from ``tensors``.

    Raises:
        ValueError, KeyError, IndexError, TypeError, RecursionError: ``node`` is malformed.
    """
    if not isinstance(node, dict):
        return node
    (tag, value), = node.items()
    if tag == "T":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"tensor index {value!r}")
        return tensors[value]
    if tag == "D":
        return {decode(k, tensors): decode(v, tensors) for k, v in value}
    if tag not in ("L", "U") or not isinstance(value, list):
        raise ValueError(f"node {tag!r}")
    items = [decode(v, tensors) for v in value]
    return items if tag == "L" else tuple(items)


def layout(tensors: list[torch.Tensor]) -> str:
    """A short digest of the tensors' dtypes and shapes (what a data slot must match)."""
    sig = repr([(str(t.dtype), tuple(t.shape)) for t in tensors])
    return hashlib.sha1(sig.encode()).hexdigest()[:16]


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """:func:`parlay.statefile.write_atomic` for host memory (no ``fsync``).

    Raises:
        CheckpointError: The file could not be written (the temporary file is removed).
    """
    checkpoint.write_atomic(path, write, "snapshot file", f"free space in {path.parent}, "
                            "or set PARLAY_SNAPSHOT_DIR to a folder with room for a copy of the "
                            "training state, or snapshot_every=0.", durable=False)


#: Marks a data file of :func:`map_shared` (bumped when its layout changes incompatibly).
DATA_VERSION = 1


def map_shared(path: Path, tensors: list[torch.Tensor], lay: str) -> list[torch.Tensor]:
    """Writable CPU views, mapped ``MAP_SHARED``, of the data file ``path`` holding tensors of
    the dtypes and shapes of ``tensors`` (layout ``lay``): a copy into them is a write to the
    file. The file is (re)written, atomically, from ``tensors`` when it is missing, unreadable
    or of another layout.

    Raises:
        CheckpointError: The file could not be written.
    """
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        try:
            data = torch.load(path, mmap=True, weights_only=True)
            ok = isinstance(data, dict) and data.get("layout") == lay
        except Exception:  # noqa: BLE001 - missing or unreadable: write it afresh
            ok = False
        if not ok:
            fresh = {"parlay_snapshot_data": DATA_VERSION, "layout": lay,
                     "tensors": [t.to("cpu", copy=True) for t in tensors]}
            write_atomic(path, lambda f: torch.save(fresh, f))
            data = torch.load(path, mmap=True, weights_only=True)
    return data["tensors"]
