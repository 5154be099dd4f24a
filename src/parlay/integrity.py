"""Checksums of training state: what snapshots, checkpoints and replica checks verify.

One function family, so every check computes the same value the same way: a CRC-32 of the
tensors' raw bytes in order (``zlib.crc32``, which releases the GIL and runs faster than a
memory copy), chained with the state's structure and plain values for whole states. A CRC
detects every single-bit and single-byte error and every burst up to 32 bits; it is a guard
against corruption, not against an adversary (files are read with ``weights_only=True`` for
that).
"""
from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["tensor_crc", "state_crc", "file_crcs"]


def _bytes(t: torch.Tensor) -> Any:
    flat = t.detach().reshape(-1)
    if not flat.is_cpu:
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy()  # a buffer zlib reads in place


def tensor_crc(tensors: Iterable[torch.Tensor], value: int = 0) -> int:
    """CRC-32 of the tensors' bytes, in order, continuing from ``value`` (a CUDA tensor is
    copied to the host first). Dtypes and shapes are not part of it: pair it with a layout."""
    for t in tensors:
        if t.numel():
            value = zlib.crc32(_bytes(t), value)
    return value


def state_crc(state: Any) -> int:
    """CRC-32 of a nested state (dicts, lists, tuples of tensors and plain values): its
    structure, its plain values, each tensor's dtype and shape, then the tensors' bytes. Equal
    for a state and its ``torch.save``/``torch.load`` round trip."""
    leaves, spec = pytree.tree_flatten(state, is_leaf=lambda x: isinstance(x, torch.Size))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    head = repr([(str(x.dtype), tuple(x.shape)) if isinstance(x, torch.Tensor) else x
                 for x in leaves]) + str(spec)
    return tensor_crc(tensors, zlib.crc32(head.encode()))


def file_crcs(folder: Path, names: list[str], rank: int = 0, size: int = 1) -> list[int]:
    """CRC-32 of one rank's share of the files ``names`` in ``folder``: every ``size``-th from
    ``rank`` (-1: unreadable, -2: another rank's share)."""
    out = [-2] * len(names)
    for i in range(rank, len(names), size):
        out[i] = -1
        with contextlib.suppress(OSError), open(folder / names[i], "rb") as f:
            out[i] = functools.reduce(lambda c, b: zlib.crc32(b, c),
                                      iter(lambda: f.read(1 << 24), b""), 0)
    return out
