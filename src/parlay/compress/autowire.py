"""How an ``auto`` payload names the candidate that encoded it, in and across processes.

A parameter server decodes a worker's push from the context's plain values (no pickles, see
:mod:`parlay.ps.wire`), so :class:`AutoCtx` carries, next to the candidate's own (local)
context, a fixed-length tuple of plain values from which any one-round candidate's context is
rebuilt on the receiving side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parlay.compress.base import Compressor
from parlay.compress.cast import CastCtx
from parlay.compress.sparse import SparseCtx

__all__ = ["AutoCtx", "wire_values", "rebuild_ctx"]


@dataclass
class AutoCtx:
    """Which candidate encoded a payload (``choice``: index into the candidates) and the
    candidate's own context. ``wire`` holds the plain values a receiver in another process (a
    parameter server) needs to rebuild the context; a copy never carries the sender's ``inner``
    (see :meth:`__copy__`), so a receiver always decodes from ``wire``."""

    choice: int
    inner: Any = None
    wire: tuple = ()

    def __getstate__(self) -> dict[str, Any]:
        return {"choice": self.choice, "wire": self.wire}

    def __copy__(self) -> "AutoCtx":
        return AutoCtx(self.choice, None, self.wire)


def wire_values(inner: Any, flat: torch.Tensor) -> tuple:
    """Fixed-length plain values that rebuild a one-round candidate's context elsewhere."""
    return (flat.numel(), flat.dtype, int(getattr(inner, "k", 0)),
            int(getattr(inner, "seed", -1)), float(getattr(inner, "scale", 1.0)),
            bool(getattr(inner, "fallback", False)))


def rebuild_ctx(cand: Compressor, wire: tuple) -> Any:
    """The context ``cand`` needs to decode, from :func:`wire_values` (none: ``None``)."""
    numel, dtype, k, seed, scale, fallback = wire
    if cand.name in ("fp16", "bf16"):
        return CastCtx(dtype, scale, fallback=fallback)
    if cand.name in ("topk", "randomk"):
        return SparseCtx(numel, dtype, k, seed)
    return None
