"""``hvd.Compression``: parlay's one compression namespace under Horovod's module name.

``hvd.Compression is parlay.Compression``: its ``none`` and ``fp16`` answer Horovod's calling
convention on the class (``Compression.fp16.compress(tensor) -> (tensor, ctx)``) and parlay's
bucket protocol as instances; see :mod:`parlay.compress.namespace`.
"""
from parlay.compress.namespace import Compression, FP16Compressor, NoneCompressor

__all__ = ["Compression", "NoneCompressor", "FP16Compressor"]
