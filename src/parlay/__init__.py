"""parlay: take a PyTorch model from one CPU or GPU to a cluster.

Three communication modes behind one :class:`Trainer`: data parallel (``allreduce``),
parameter server (``ps``) and hybrid pipeline x data parallel (``hybrid``).
"""
from parlay import comm, compress
from parlay.dp import (Adasum, Average, Max, Min, Product, Sum, allgather_object,
                       broadcast_object, broadcast_optimizer_state, broadcast_parameters)
from parlay.env import ClusterEnv, TaskSpec, detect
from parlay.taskspec import TaskSpecDef, create_task_spec_def
from parlay.errors import CheckpointError, CommError, ConfigError, NonFiniteError, ParlayError
from parlay.runtime import (backend, cluster, cross_rank, cross_size, device, init,
                            is_chief, is_initialized, local_rank, local_size, rank, role,
                            shutdown, size)
from parlay.reduce_ops import ReduceOp

__version__ = "0.1.0"

# Heavier parts load on first use (``parlay.Trainer``), which keeps ``import parlay`` fast and
# lets each mode live in its own package.
_LAZY = {
    "Trainer": "parlay.trainer",
    "DistributedSession": "parlay.ps",
    "ShardPlan": "parlay.ps",
    "compression": "parlay.compression",
    "Compression": "parlay.compression",
    # Horovod's names: the very objects of parlay.horovod (parlay.allreduce is
    # parlay.horovod.allreduce), with Horovod's semantics (matched across ranks by name,
    # negotiated in the calling thread when a rank waits). Resolved here, on first use, so
    # that only scripts using them load parlay.horovod; the core never does (its collectives
    # are parlay.comm's, on c10d).
    "DistributedOptimizer": "parlay.horovod",
    "allreduce": "parlay.horovod",
    "allreduce_async": "parlay.horovod",
    "allgather": "parlay.horovod",
    "allgather_async": "parlay.horovod",
    "broadcast": "parlay.horovod",
    "broadcast_async": "parlay.horovod",
    "join": "parlay.horovod",
    "barrier": "parlay.horovod",
    "poll": "parlay.horovod",
    "synchronize": "parlay.horovod",
    "nccl_built": "parlay.horovod",
    "gloo_built": "parlay.horovod",
    "mpi_built": "parlay.horovod",
    "mpi_enabled": "parlay.horovod",
    "data": "parlay.data",
    "pipeline": "parlay.pipeline",
    "horovod": "parlay.horovod",
    "testing": "parlay.testing",
}


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY:
        # The one place outside parlay/horovod/ that may load parlay.horovod (the import
        # contract "horovod is a leaf" sees no import here: the module name is data).
        mod = importlib.import_module(_LAZY[name])
        value = mod if mod.__name__ == f"parlay.{name}" else getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'parlay' has no attribute {name!r}")


__all__ = [
    "__version__", "comm", "compress", "ClusterEnv", "TaskSpec", "TaskSpecDef",
    "create_task_spec_def", "detect",
    "ParlayError", "ConfigError", "CommError", "CheckpointError", "NonFiniteError",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_chief", "role", "device", "backend", "cluster",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allgather_object",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", *_LAZY,
]
