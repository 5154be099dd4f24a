"""``hvd.Compression``: Horovod's compressors that are also parlay compressors.

Horovod calls ``Compression.fp16.compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx)`` on the *class*. parlay's optimizer instantiates a compressor class
and calls ``compress(flat, key)`` on the *instance* (:class:`parlay.compress.Compressor`). The
classes here answer both: class-level access gives Horovod's functions, instances behave as
parlay's ``none`` / ``fp16`` (fp16 with its overflow-safe scale). The namespace extends
:class:`parlay.compression.Compression`, so ``bf16``, ``topk``, ... are there too.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from parlay.compress.base import NoneCompressor as _None
from parlay.compress.cast import FP16 as _FP16
from parlay.compression import Compression as _ParlayCompression

__all__ = ["Compression", "NoneCompressor", "FP16Compressor"]


class _ClassOrInstance:
    """On the class: a Horovod-style function; on an instance: the parlay method."""

    def __init__(self, horovod_fn: Callable[..., Any]) -> None:
        self.horovod_fn = horovod_fn
        self.name = ""
        self.owner: type = object

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self.horovod_fn
        return getattr(super(self.owner, obj), self.name)


def _none_compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    return tensor, None


def _none_decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    return tensor


def _fp16_compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if tensor.dtype.is_floating_point:
        return tensor.to(torch.float16), tensor.dtype
    return tensor, tensor.dtype


def _fp16_decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class NoneCompressor(_None):
    """No compression (Horovod's ``Compression.none``)."""

    _horovod_style = True
    compress = _ClassOrInstance(_none_compress)
    decompress = _ClassOrInstance(_none_decompress)


class FP16Compressor(_FP16):
    """Floating tensors travel as float16 (Horovod's ``Compression.fp16``); in the optimizer,
    parlay's fp16 with a shared power-of-two scale that avoids overflow."""

    _horovod_style = True
    compress = _ClassOrInstance(_fp16_compress)
    decompress = _ClassOrInstance(_fp16_decompress)


class Compression(_ParlayCompression):
    """Compressors by name: ``none`` and ``fp16`` as in Horovod, plus parlay's ``bf16``,
    ``topk``, ``randomk`` and ``powersgd`` (optimizer only)."""

    none = NoneCompressor
    fp16 = FP16Compressor
