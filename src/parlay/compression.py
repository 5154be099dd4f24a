"""Gradient compression, the user-facing names.

Pass a name with options or an object wherever parlay reduces gradients::

    opt = parlay.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      compression="topk:0.01")            # or an object:
    opt = parlay.DistributedOptimizer(opt, compression=parlay.compression.TopK(ratio=0.01))
    opt = parlay.DistributedOptimizer(opt, compression=parlay.Compression.fp16)  # Horovod style

=====================  ===========================================================  ==========
name                   what crosses the wire                                        reduction
=====================  ===========================================================  ==========
``none``               the fp32 bucket                                              allreduce
``fp16`` / ``bf16``    the bucket cast to 16 bits (fp16 with an overflow-safe scale) allreduce
``topk:R``             the ``R * n`` largest-magnitude values + int32 indices       allgather
``randomk:R``          ``R * n`` values at indices from a seed shared by all ranks   allreduce
``powersgd:r``         rank-r factors P and Q (two rounds), 1-D tensors dense        allreduce
=====================  ===========================================================  ==========

Sparsifiers and PowerSGD keep an error-feedback residual per bucket by default (what was not
sent is added to the next gradient; ``sent + residual == produced`` exactly), and the residuals
are part of ``DistributedOptimizer.state_dict()`` under ``"parlay_compression"``. Residuals are
per rank: checkpoint each rank's optimizer state if a resumed run must continue bit for bit.
Options go after the colon: ``"topk:0.01,momentum=0.9,warmup=500"`` (DGC momentum correction
and density warm-up, Lin et al. 2018), ``"randomk:0.01,seed=3"``, ``"powersgd:4,ef=0"``.
An unknown name raises :class:`~parlay.errors.ConfigError` listing the valid ones.

Error feedback delays what it does not send, and delayed coordinates arrive in bursts. Top-k
sends the large coordinates first, so its bursts stay small; random-k at low density does not:
with heavy-ball momentum 0.9 it diverged on MNIST at 1% (``benchmarks/compression.py``), while
plain SGD trains. The theory agrees (Stich et al. 2018; Karimireddy et al. 2019: the step size
must shrink with the density). Use random-k without optimizer momentum or with a smaller
learning rate, or prefer top-k / PowerSGD.

Compression pays only where bandwidth is scarce: on a fast interconnect the encode/decode time
can exceed the transfer it saves (``benchmarks/compression.py`` measures both).
"""
from __future__ import annotations

from parlay.compress import (BF16, FP16, CommStats, Compressor, ErrorFeedback, NoneCompressor,
                             PowerSGD, RandomK, TopK, available, get_compressor, reduce_async,
                             register)
from parlay.compress.namespace import Compression

__all__ = ["Compressor", "NoneCompressor", "FP16", "BF16", "TopK", "RandomK", "PowerSGD",
           "ErrorFeedback", "Compression", "get_compressor", "available", "register",
           "reduce_async", "CommStats"]

