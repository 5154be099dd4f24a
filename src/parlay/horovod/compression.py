"""``hvd.Compression``: parlay's one compression namespace under Horovod's module name.

``hvd.Compression is parlay.Compression``: its ``none`` and ``fp16`` answer Horovod's calling
convention on the class (``Compression.fp16.compress(tensor) -> (tensor, ctx)``) and parlay's
bucket protocol as instances; see :mod:`parlay.compress.namespace`.
"""
from typing import Any

from parlay.compress.namespace import Compression, FP16Compressor, NoneCompressor

__all__ = ["Compressor", "Compression", "NoneCompressor", "FP16Compressor"]


class Compressor:
    """Horovod's base of custom compressors: subclass it with static ``compress(tensor) ->
    (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``, and pass the class."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """The tensor to send, and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The received (summed) tensor, decoded."""
        raise NotImplementedError
