"""Horovod's basics on parlay's runtime: build flags, the error type, and per-init state.

``init``/``shutdown``/``rank``/... are parlay's own (:mod:`parlay.runtime`); this module hooks
into them (:func:`parlay.runtime.on_init` / :func:`~parlay.runtime.on_shutdown`) to keep the
state Horovod scripts expect: ``HOROVOD_RANK``-style environment variables (as ``horovodrun``
exports them), a timeline started from ``HOROVOD_TIMELINE``, and, at shutdown, pending
operations failed and process sets forgotten before the groups are destroyed.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from parlay import runtime
from parlay.errors import CommError, ConfigError
from parlay.horovod import process_sets, timeline

__all__ = ["HorovodInternalError", "HorovodUnsupportedError", "mpi_built", "mpi_enabled",
           "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "mpi_threads_supported", "is_homogeneous"]


class HorovodInternalError(CommError):
    """A collective failed: ranks disagreed on shapes, dtypes, root or op, a peer was lost, or
    the operation timed out. Raised on every rank that took part (a ``RuntimeError``)."""

    def __reduce__(self):  # keep the type (and op/rank/peer) across process boundaries
        return (_rebuild, (type(self), str(self), self.op, self.rank, self.peer))


def _rebuild(cls: type, message: str, op: str | None, rank: int | None,
             peer: int | None) -> CommError:
    return cls(message, op=op, rank=rank, peer=peer)


class HorovodUnsupportedError(ConfigError, NotImplementedError):
    """An operation/argument combination parlay does not support (both a ``ValueError`` and a
    ``NotImplementedError``, i.e. also a ``RuntimeError``, so Horovod-era handlers catch it)."""


def mpi_built() -> bool:
    """Whether this PyTorch can use MPI (parlay runs over torch's own backends)."""
    return bool(dist.is_available() and dist.is_mpi_available())


def mpi_enabled() -> bool:
    """Whether the running job communicates over MPI (only with ``parlay.init(backend="mpi")``)."""
    return runtime.is_initialized() and runtime.backend() == "mpi"


def gloo_built() -> bool:
    """Whether gloo is available (CPU collectives)."""
    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether the running job uses gloo (for CPU tensors)."""
    return runtime.is_initialized() and "gloo" in runtime.backend()


def nccl_built() -> int:
    """NCCL version as Horovod reports it (e.g. 2708 or 21803), 0 without NCCL."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 1000 + minor * 100 + patch if (major, minor) < (2, 9) else \
        major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    """IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """Whether this PyTorch was built with CUDA."""
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """Whether this PyTorch was built for ROCm."""
    return torch.version.hip is not None


def mpi_threads_supported() -> bool:
    """MPI multi-threading is irrelevant here: collectives run on torch's backends."""
    return False


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes (parlay's launcher ensures it)."""
    c = runtime.cluster()
    return c.world_size == c.local_world_size * c.num_nodes


# ---------------------------------------------------------------- per-init state
_exported: dict[str, str] = {}


def _on_init() -> None:
    # Process sets of the previous init need no reset here: they compare their generation
    # with runtime.generation(), which every init() advances.
    c = runtime.cluster()
    if c.source != "single":
        # horovodrun exports these to every rank; scripts (and Horovod's own tests) read them.
        values = {"HOROVOD_RANK": c.rank, "HOROVOD_SIZE": c.world_size,
                  "HOROVOD_LOCAL_RANK": c.local_rank, "HOROVOD_LOCAL_SIZE": c.local_world_size,
                  "HOROVOD_CROSS_RANK": c.node_rank, "HOROVOD_CROSS_SIZE": c.num_nodes}
        for k, v in values.items():
            if k not in os.environ or _exported.get(k) == os.environ[k]:
                os.environ[k] = _exported[k] = str(v)
    path = os.environ.get("HOROVOD_TIMELINE", "")
    if path and path.upper() != "DYNAMIC":
        timeline.start_timeline(path, mark_cycles=os.environ.get(
            "HOROVOD_TIMELINE_MARK_CYCLES", "0") not in ("", "0"))


def _on_shutdown() -> None:
    try:
        process_sets.stop_all()
    finally:
        timeline.stop_timeline()
    # The HOROVOD_* variables stay, as horovodrun's do for the life of the process.


runtime.on_shutdown(_on_shutdown)
runtime.on_init(_on_init)
