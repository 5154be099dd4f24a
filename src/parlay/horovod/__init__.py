"""``horovod.torch`` on parlay: replace ``import horovod.torch as hvd`` with
``import parlay.horovod as hvd`` and launch with ``parlay run -n N`` instead of
``horovodrun -np N``.

Everything runs on PyTorch's own distributed engine (c10d: gloo on CPU, NCCL on GPU). Process
sets are process groups; asynchronous operations return handles for ``poll``/``synchronize``;
operations are matched across ranks by name, as in Horovod (negotiated when a rank waits, with
descriptors sent as tensors), and ranks that disagree on shapes, dtypes or roots get
:class:`HorovodInternalError` rather than a hang. The names parlay also exports (``init``,
``rank``, ``DistributedOptimizer``, ``allreduce``, ``Compression``, ...) are the very same
objects as ``parlay.<name>``.

This package is a leaf: it builds on parlay's core (runtime, comm, dp, compress) and nothing in
the core imports it (an import contract in ``pyproject.toml`` holds that). ``parlay`` re-exports
its Horovod-only names (``parlay.allreduce``, ``parlay.DistributedOptimizer``, ``parlay.join``,
...) lazily, so only a script that uses one of them loads this package; a ``Trainer`` never
does, and so never negotiates or exports ``HOROVOD_*`` variables.
"""
from parlay.dp.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                 broadcast_parameters)
from parlay.dp.ops import Adasum, Average, Max, Min, Product, Sum
from parlay.horovod import elastic
from parlay.horovod.basics import (HorovodInternalError, HorovodUnsupportedError, ccl_built,
                                   cuda_built, ddl_built, gloo_built, gloo_enabled,
                                   is_homogeneous, mpi_built, mpi_enabled,
                                   mpi_threads_supported, nccl_built, rocm_built)
from parlay.horovod.compression import Compression
from parlay.horovod.functions import (allgather, allgather_async, allreduce, allreduce_async,
                                      broadcast, broadcast_async)
from parlay.horovod.ops import (allreduce_, allreduce_async_, alltoall, alltoall_async, barrier,
                                broadcast_, broadcast_async_, grouped_allgather,
                                grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                                grouped_allreduce_async, grouped_allreduce_async_,
                                grouped_reducescatter, grouped_reducescatter_async, join, poll,
                                reducescatter, reducescatter_async, sparse_allreduce_async,
                                synchronize)
from parlay.horovod.optimizer import DistributedOptimizer
from parlay.horovod.process_sets import (ProcessSet, add_process_set, global_process_set,
                                         remove_process_set)
from parlay.horovod.sync_batch_norm import SyncBatchNorm
from parlay.horovod.timeline import start_timeline, stop_timeline
from parlay.reduce_ops import ReduceOp
from parlay.runtime import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                            rank, shutdown, size)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "mpi_threads_supported",
    "is_homogeneous", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "HorovodInternalError", "HorovodUnsupportedError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "Compression", "DistributedOptimizer", "SyncBatchNorm", "elastic",
]
