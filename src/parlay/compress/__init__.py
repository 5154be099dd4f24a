"""Gradient compression: the Compressor protocol, its registry and error feedback."""
from parlay.compress.base import (CommStats, Compressor, NoneCompressor, available,
                                  get_compressor, reduce_async, register)

__all__ = ["CommStats", "Compressor", "NoneCompressor", "available", "get_compressor",
           "reduce_async", "register"]
