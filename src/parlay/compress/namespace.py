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

from typing import Any

import torch

from parlay.compress.auto import AutoCompressor
from parlay.compress.base import ClassOrInstance, NoneCompressor
from parlay.compress.cast import BF16, FP16
from parlay.compress.powersgd import PowerSGD
from parlay.compress.quant import Int8
from parlay.compress.sparse import RandomK, TopK

__all__ = ["Compression", "NoneCompressor", "FP16Compressor"]


def _fp16_compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if tensor.dtype.is_floating_point:
        return tensor.to(torch.float16), tensor.dtype
    return tensor, tensor.dtype


def _fp16_decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class FP16Compressor(FP16):
    """Floating tensors travel as float16 (Horovod's ``Compression.fp16``); as an instance,
    parlay's fp16 with a shared power-of-two scale that avoids overflow."""

    _horovod_style = True
    compress = ClassOrInstance(_fp16_compress, FP16.compress)
    decompress = ClassOrInstance(_fp16_decompress, FP16.decompress)


class Compression:
    """Compressors by name: ``none`` and ``fp16`` (as in Horovod), ``bf16``, ``topk``,
    ``randomk``, ``powersgd``, ``int8`` and ``auto`` (the last six in ``DistributedOptimizer``
    only)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16
    topk = TopK
    randomk = RandomK
    powersgd = PowerSGD
    int8 = Int8
    auto = AutoCompressor
