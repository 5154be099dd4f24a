"""parlay: take a PyTorch model from one CPU or GPU to a cluster.

Three communication modes behind one :class:`Trainer`: data parallel (``allreduce``),
parameter server (``ps``) and hybrid pipeline x data parallel (``hybrid``).
"""
from parlay import comm, compress
from parlay.dp import (Adasum, Average, Max, Min, Product, Sum, allgather_object,
                       broadcast_object, broadcast_optimizer_state, broadcast_parameters)
from parlay.env import ClusterEnv, TaskSpec, detect
from parlay.taskspec import TaskSpecDef, create_task_spec_def
from parlay.errors import (
    CheckpointError,
    CommError,
    ConfigError,
    NonFiniteError,
    ParlayError,
    ReplicaDivergence,
)
from parlay.runtime import (backend, cluster, cross_rank, cross_size, device, init,
                            is_chief, is_initialized, local_rank, local_size, rank, role,
                            shutdown, size)
from parlay.reduce_ops import ReduceOp

__version__ = "0.1.0"

# Horovod's names: the very objects of parlay.horovod (parlay.allreduce is
# parlay.horovod.allreduce), with Horovod's semantics (matched across ranks by name, negotiated
# in the calling thread when a rank waits). Only scripts that use them load parlay.horovod; the
# core never does (its collectives are parlay.comm's, on c10d).
_HOROVOD = ("DistributedOptimizer", "allreduce", "allreduce_async", "allgather",
            "allgather_async", "broadcast", "broadcast_async", "join", "barrier", "poll",
            "synchronize", "nccl_built", "gloo_built", "mpi_built", "mpi_enabled")
_LAZY = ("Trainer", "DistributedSession", "ShardPlan", "DiLoCoOptimizer", "compression",
         "Compression", "data", "pipeline", "horovod", "testing", *_HOROVOD)


def __getattr__(name: str) -> object:
    """Heavier parts load on first use (``parlay.Trainer``), which keeps ``import parlay`` fast
    and lets each mode live in its own package. The imports are statements (at function
    level), so the import contracts see these edges."""
    value = _load(name)
    globals()[name] = value
    return value


def _load(name: str) -> object:
    # "import parlay.x as m", not "from parlay import x": the latter asks this module for x
    # first, which would call __getattr__ again.
    if name == "Trainer":
        import parlay.trainer as trainer
        return trainer.Trainer
    if name in ("DistributedSession", "ShardPlan"):
        import parlay.ps as ps
        return getattr(ps, name)
    if name == "DiLoCoOptimizer":
        import parlay.local as local
        return local.DiLoCoOptimizer
    if name in ("compression", "Compression"):
        import parlay.compression as compression
        return compression if name == "compression" else compression.Compression
    if name == "horovod" or name in _HOROVOD:
        import parlay.horovod as horovod
        return horovod if name == "horovod" else getattr(horovod, name)
    if name == "data":
        import parlay.data as data
        return data
    if name == "pipeline":
        import parlay.pipeline as pipeline
        return pipeline
    if name == "testing":
        import parlay.testing as testing
        return testing
    raise AttributeError(f"module 'parlay' has no attribute {name!r}")


__all__ = [
    "__version__", "comm", "compress", "ClusterEnv", "TaskSpec", "TaskSpecDef",
    "create_task_spec_def", "detect",
    "ParlayError", "ConfigError", "CommError", "CheckpointError", "NonFiniteError",
    "ReplicaDivergence",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_chief", "role", "device", "backend", "cluster",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allgather_object",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", *_LAZY,
]
