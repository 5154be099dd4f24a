"""The rest of ``horovod.torch``'s operations: in-place and grouped variants, alltoall,
reducescatter, sparse allreduce, barrier, join, poll and synchronize.

Argument names, order and defaults are Horovod's; every operation also takes ``process_set``
and (keyword-only) ``process_group`` for a plain torch group. See
:mod:`parlay.horovod.functions` for the common ones (``allreduce``, ``allgather``,
``broadcast``, ...).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from parlay import runtime
from parlay.horovod import collectives as c
from parlay.horovod import joining, scatter
from parlay.horovod.basics import HorovodInternalError, HorovodUnsupportedError
from parlay.horovod.engine import Handle, Meta, Request
from parlay.horovod.functions import allgather_async, global_root, horovod_compressor
from parlay.horovod.process_sets import ProcessSet, global_process_set
from parlay.reduce_ops import ReduceOp

__all__ = ["allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
           "grouped_allgather", "grouped_allgather_async", "broadcast_", "broadcast_async_",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
           "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
           "synchronize"]

_GLOBAL = global_process_set


def _compressed(compression: Any, tensors: Sequence[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    comp = horovod_compressor(compression)
    if comp is None:
        return list(tensors), [None] * len(tensors)
    pairs = [comp.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _decompressed(compression: Any, tensors: Sequence[torch.Tensor], ctxs: list[Any]) -> list[Any]:
    if compression is None:
        return list(tensors)
    return [compression.decompress(t, x) for t, x in zip(tensors, ctxs)]


# ------------------------------------------------------------------------------ allreduce
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = _GLOBAL, *, process_group: Any = None) -> Handle:
    """Start an in-place allreduce of ``tensor`` (result written into it)."""
    return c.allreduce_async([tensor], True, name, c.resolve_op(average, op), prescale_factor,
                             postscale_factor, process_set, process_group, True)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = _GLOBAL, *, process_group: Any = None) -> torch.Tensor:
    """In-place allreduce of ``tensor``; returns it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, process_group=process_group).wait()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = _GLOBAL, *,
                            process_group: Any = None) -> Handle:
    """Start one fused allreduce of a list of tensors (inputs unchanged)."""
    return c.allreduce_async(list(tensors), False, name, c.resolve_op(average, op),
                             prescale_factor, postscale_factor, process_set, process_group, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = _GLOBAL, *,
                             process_group: Any = None) -> Handle:
    """Start one fused in-place allreduce of a list of tensors."""
    return c.allreduce_async(list(tensors), True, name, c.resolve_op(average, op),
                             prescale_factor, postscale_factor, process_set, process_group, False)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = None, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = _GLOBAL, *,
                      process_group: Any = None) -> list[torch.Tensor]:
    """Allreduce a list of tensors in one fused operation (differentiable)."""
    sent, ctxs = _compressed(compression, tensors)
    outs = c.GroupedAllreduceFn.apply(name, c.resolve_op(average, op), float(prescale_factor),
                                      float(postscale_factor), process_set, process_group, *sent)
    return _decompressed(compression, outs, ctxs)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = _GLOBAL, *,
                       process_group: Any = None) -> list[torch.Tensor]:
    """In-place fused allreduce of a list of tensors; returns them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, process_set,
                                    process_group=process_group).wait()


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: ProcessSet = _GLOBAL, *,
                           process_group: Any = None) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Returns:
        A function returning the reduced sparse tensor (uncoalesced: duplicates add up).
    """
    rop = c.resolve_op(None, op)
    if rop not in (ReduceOp.Average, ReduceOp.Sum):
        raise HorovodUnsupportedError("sparse_allreduce_async supports op=Average or Sum.")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    ih = allgather_async(t._indices().t().contiguous(),
                         name=None if name is None else f"{name}.indices",
                         process_set=process_set, process_group=process_group)
    vh = allgather_async(t._values().contiguous(),
                         name=None if name is None else f"{name}.values",
                         process_set=process_set, process_group=process_group)
    n = c.set_size(process_set, process_group)

    def result() -> torch.Tensor:
        values = vh.wait()
        indices = ih.wait()
        if rop == ReduceOp.Average:
            values = values / n
        return torch.sparse_coo_tensor(indices.t(), values, t.shape)
    return result


# ------------------------------------------------------------------------------ allgather
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = _GLOBAL, *,
                            process_group: Any = None) -> Handle:
    """Start allgathering a list of tensors in one message."""
    return c.submit("allgather", list(tensors), name, process_set, process_group,
                    finish=lambda res: res[0])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = _GLOBAL, *,
                      process_group: Any = None) -> list[torch.Tensor]:
    """Allgather a list of tensors in one message (differentiable)."""
    return list(c.GroupedAllgatherFn.apply(name, process_set, process_group, *tensors))


# ------------------------------------------------------------------------------ broadcast
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = _GLOBAL, *, process_group: Any = None) -> Handle:
    """Start broadcasting root's ``tensor`` into ``tensor`` on every rank."""
    return c.broadcast_async(tensor, global_root(root_rank, process_group), True, name,
                             process_set, process_group)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = _GLOBAL, *, process_group: Any = None) -> torch.Tensor:
    """In-place broadcast from ``root_rank`` (a global rank); returns ``tensor``."""
    return broadcast_async_(tensor, root_rank, name, process_set,
                            process_group=process_group).wait()


# ------------------------------------------------------------------------------ alltoall
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = _GLOBAL, *, process_group: Any = None) -> Handle:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    sp = scatter.alltoall_splits(tensor, splits, c.set_size(process_set, process_group))

    def finish(res: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, recv = res
        like = splits if isinstance(splits, torch.Tensor) else None
        recv_t = torch.tensor(recv, dtype=torch.int32 if like is None else like.dtype,
                              device="cpu" if like is None else like.device)
        return out, recv_t
    return c.submit("alltoall", [tensor], name, process_set, process_group, splits=sp,
                    finish=finish)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = _GLOBAL, *, process_group: Any = None) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i`` and gather what each rank sent here.

    Args:
        tensor: Rows to distribute along dim 0.
        splits: Rows for each rank (int32 tensor or list); default: equal parts.
        name: Operation name.
        process_set: Ranks taking part (default: all).
        process_group: A torch group instead.

    Returns:
        The gathered tensor; with ``splits`` given, ``(tensor, received_splits)``.

    Raises:
        ValueError: Bad ``splits``, or no splits and a first dimension that does not divide.
        HorovodInternalError: Ranks disagree on dtype or trailing shape.
    """
    sp = scatter.alltoall_splits(tensor, splits, c.set_size(process_set, process_group))
    out, recv = scatter.AlltoallFn.apply(tensor, sp, name, process_set, process_group)
    if splits is None:
        return out
    if isinstance(splits, torch.Tensor):
        recv = recv.to(dtype=splits.dtype, device=splits.device)
    return out, recv


# ------------------------------------------------------------------------------ reducescatter
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.Average,
                        process_set: ProcessSet = _GLOBAL, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, process_group: Any = None) -> Handle:
    """Start reducing ``tensor`` over the set and keeping this rank's rows of the result."""
    rop = c.resolve_op(None, op)
    scatter.reducescatter_check([tensor], rop)
    return c.submit("reducescatter", [tensor], name, process_set, process_group, op=rop,
                    prescale=prescale_factor, postscale=postscale_factor,
                    finish=lambda res: res[0])


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                  op: Any = ReduceOp.Average, process_set: ProcessSet = _GLOBAL,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                  process_group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over the set; rank ``i`` keeps the ``i``-th block of rows (blocks as
    even as possible, lower ranks first). Differentiable.

    Raises:
        HorovodUnsupportedError: ``op=Adasum``.
        ValueError: A scalar tensor.
        HorovodInternalError: Ranks disagree on shape or dtype.
    """
    rop = c.resolve_op(None, op)
    scatter.reducescatter_check([tensor], rop)
    [sent], [ctx] = _compressed(compression, [tensor])
    out = scatter.ReducescatterFn.apply(sent, name, rop, float(prescale_factor),
                                  float(postscale_factor), process_set, process_group)
    return _decompressed(compression, [out], [ctx])[0]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = ReduceOp.Average, process_set: ProcessSet = _GLOBAL,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                                process_group: Any = None) -> Handle:
    """Start a reducescatter of a list of tensors as one operation."""
    rop = c.resolve_op(None, op)
    scatter.reducescatter_check(tensors, rop)
    return c.submit("reducescatter", list(tensors), name, process_set, process_group, op=rop,
                    prescale=prescale_factor, postscale=postscale_factor)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = None, op: Any = ReduceOp.Average,
                          process_set: ProcessSet = _GLOBAL, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, *,
                          process_group: Any = None) -> list[torch.Tensor]:
    """Reducescatter a list of tensors as one operation (differentiable)."""
    rop = c.resolve_op(None, op)
    scatter.reducescatter_check(tensors, rop)
    sent, ctxs = _compressed(compression, tensors)
    outs = scatter.GroupedReducescatterFn.apply(name, rop, float(prescale_factor),
                                          float(postscale_factor), process_set, process_group,
                                          *sent)
    return _decompressed(compression, outs, ctxs)


# ------------------------------------------------------------------------------ control
def barrier(process_set: ProcessSet = _GLOBAL) -> None:
    """Block until every rank of the set reached the barrier (negotiated like any operation:
    operations every rank started before it run first, the others stay pending)."""
    runner = c.target(process_set)
    runner.submit(Request(runner.auto_name("barrier"), Meta("barrier"))).wait()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data: until every rank joined, it takes part in the
    other ranks' allreduces with zeros (averages still divide by the full size).

    Allgather, broadcast, alltoall and reducescatter fail on the other ranks while a rank has
    joined. Covers operations of the global process set started through these functions and
    the gradient reductions of every ``DistributedOptimizer`` on the global set (see
    :mod:`parlay.horovod.joining`; the joined rank's own weights stay as they were, as in
    Horovod). A joined rank waits at most the collective timeout (``PARLAY_TIMEOUT``) for the
    other ranks' next operation.

    Args:
        device: Accepted for Horovod compatibility (zeros are made on the tensors' device).

    Returns:
        The global rank that joined last (the same on every rank).
    """
    return joining.mirrored_join(c.target(global_process_set), runtime.timeout().total_seconds())


def poll(handle: Any) -> bool:
    """Whether an asynchronous operation finished (``synchronize`` will not block).

    It does not wait for the other ranks to negotiate: each call starts a negotiation round or
    takes in one every rank has answered (then it runs the operations all ranks agreed on), so
    a loop on ``poll`` makes progress.
    """
    if isinstance(handle, Handle):
        return handle.poll()
    if hasattr(handle, "is_completed"):
        return bool(handle.is_completed())
    if callable(handle):
        return True
    raise HorovodInternalError(f"poll expects a handle from an *_async operation, got "
                               f"{type(handle).__name__}.")


def synchronize(handle: Any) -> Any:
    """Wait for an asynchronous operation and return its result.

    Raises:
        HorovodInternalError: The operation failed (on every rank that took part).
    """
    if handle is None:
        return None
    if hasattr(handle, "wait"):
        return handle.wait()
    if callable(handle):
        return handle()
    raise HorovodInternalError(f"synchronize expects a handle from an *_async operation, got "
                               f"{type(handle).__name__}.")
