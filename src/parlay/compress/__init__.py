"""Gradient compression: the Compressor protocol, its registry and error feedback.

Importing this package registers every built-in compressor: ``none``, ``fp16``, ``bf16``,
``topk``, ``randomk``, ``powersgd``, ``int8`` and ``auto`` (see :mod:`parlay.compression` for
the user-facing facade and :mod:`parlay.compress.base` for the API contract other modes rely on).
"""
from parlay.compress.base import (CommStats, Compressor, NoneCompressor, Round, available,
                                  get_compressor, register)
from parlay.compress.reduce import reduce_async
from parlay.compress.cast import BF16, FP16
from parlay.compress.feedback import ErrorFeedback, Residuals
from parlay.compress.namespace import Compression
from parlay.compress.powersgd import PowerSGD
from parlay.compress.quant import Int8
from parlay.compress.sparse import RandomK, TopK
from parlay.compress.auto import AutoCompressor  # noqa: E402 - after the candidates it builds

__all__ = ["CommStats", "Compressor", "NoneCompressor", "Round", "available", "get_compressor",
           "reduce_async", "register", "FP16", "BF16", "TopK", "RandomK", "PowerSGD", "Int8",
           "ErrorFeedback", "Residuals", "Compression", "AutoCompressor"]
