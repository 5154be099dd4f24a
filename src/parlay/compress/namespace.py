"""``Compression``: the one namespace of compressors by attribute (``Compression.fp16``).

``parlay.Compression``, ``parlay.compression.Compression`` and ``parlay.horovod.Compression``
are this class. Each attribute is a compressor *class*; the optimizer instantiates it, so two
optimizers never share per-bucket state. ``none`` and ``fp16`` also answer Horovod's calling
convention: on the class, ``Compression.fp16.compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx)`` are Horovod's functions (a plain cast); on an instance they are
parlay's bucket methods (:class:`~parlay.compress.Compressor`: ``compress(flat, key)``; fp16
with its overflow-safe scale).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from parlay.compress.auto import AutoCompressor
from parlay.compress.base import NoneCompressor as _None
from parlay.compress.cast import BF16, FP16
from parlay.compress.powersgd import PowerSGD
from parlay.compress.sparse import RandomK, TopK

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
    """No compression (Horovod's ``Compression.none``; parlay's ``none`` as an instance)."""

    _horovod_style = True
    compress = _ClassOrInstance(_none_compress)
    decompress = _ClassOrInstance(_none_decompress)


class FP16Compressor(FP16):
    """Floating tensors travel as float16 (Horovod's ``Compression.fp16``); as an instance,
    parlay's fp16 with a shared power-of-two scale that avoids overflow."""

    _horovod_style = True
    compress = _ClassOrInstance(_fp16_compress)
    decompress = _ClassOrInstance(_fp16_decompress)


class Compression:
    """Compressors by name: ``none`` and ``fp16`` (as in Horovod), ``bf16``, ``topk``,
    ``randomk``, ``powersgd`` and ``auto`` (the last five in ``DistributedOptimizer`` only)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16
    topk = TopK
    randomk = RandomK
    powersgd = PowerSGD
    auto = AutoCompressor
