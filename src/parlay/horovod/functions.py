"""Horovod's tensor collectives: ``allreduce``, ``allgather``, ``broadcast`` and their
``_async`` forms, with ``horovod.torch``'s semantics (``parlay.allreduce is
parlay.horovod.allreduce``: ``parlay`` re-exports these lazily, for Horovod users).

Same argument names and order as Horovod, defaults (``op=Average``), autograd rules and
asynchronous handles (``hvd.poll`` / ``hvd.synchronize``, or ``handle.wait()``). They run on a
*process set* (default: every rank), matched across ranks by name (:mod:`parlay.horovod.engine`:
an operation runs once every rank submitted it and some rank waits); ranks that disagree on
shape, dtype or root get :class:`~parlay.horovod.HorovodInternalError` instead of a hang.

Every function also takes ``process_group=``: a plain torch group, on which the operation runs
at once, matched by call order as c10d does (no names, no join). There,
as before, ``root_rank`` counts within that group; everywhere else it is a global rank.

The core never calls these: its own collectives are :mod:`parlay.comm`'s, straight on c10d
(the negotiation costs a round trip per wait, which Horovod's name matching needs and the core
does not).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parlay.errors import ConfigError
from parlay.horovod import collectives as c

__all__ = ["allreduce", "allreduce_async", "allgather", "allgather_async", "broadcast",
           "broadcast_async", "horovod_compressor", "global_root"]


def global_root(root_rank: int, process_group: Any) -> int:
    """``root_rank`` as a global rank (it counts within ``process_group`` when one is given)."""
    if process_group is None:
        return root_rank
    world = dist.get_world_size(process_group)
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or not 0 <= root_rank < world:
        raise ConfigError(f"root_rank must be an int in [0, {world}), got {root_rank!r}.")
    return dist.get_global_rank(process_group, root_rank)


def horovod_compressor(compression: Any) -> Any:
    """Check that ``compression`` follows Horovod's calling convention (``None`` passes).

    Raises:
        ConfigError: A parlay bucket compressor, or anything without compress/decompress.
    """
    if compression is None:
        return None
    from parlay.compress.base import Compressor

    parlay_style = isinstance(compression, Compressor) or (
        isinstance(compression, type) and issubclass(compression, Compressor))
    if (parlay_style and not getattr(compression, "_horovod_style", False)) or not (
            callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ConfigError("compression must be a Horovod-style compressor with "
                          "compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx), e.g. "
                          f"hvd.Compression.fp16; got {compression!r}.")
    return compression


# ------------------------------------------------------------------------------ tensors
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None, *, process_group: Any = None) -> Any:
    """Start averaging (or summing, ...) ``tensor`` over the process set; not modified.

    Args:
        tensor: Tensor to reduce.
        average: Deprecated Horovod flag; prefer ``op``.
        name: Name matching this operation across ranks (default: auto-numbered).
        op: ``Average`` (default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after it.
        process_set: Ranks to reduce over (default: the global process set).
        process_group: A torch group instead (inline, matched by call order).

    Returns:
        A handle: ``hvd.synchronize(handle)`` or ``handle.wait()`` returns the result.
    """
    return c.allreduce_async([tensor], False, name, c.resolve_op(average, op), prescale_factor,
                             postscale_factor, process_set, process_group, True)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None, *,
              process_group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return the result (input unchanged).

    Differentiable: the gradient is the same reduction of the output's gradient.

    Args:
        tensor: Tensor to reduce.
        average: Deprecated Horovod flag; prefer ``op``.
        name: Name matching this operation across ranks.
        compression: A Horovod-style compressor (``hvd.Compression.fp16``); default none.
        op: ``Average`` (default), ``Sum``, ``Adasum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after it.
        process_set: Ranks to reduce over (default: all).
        process_group: A torch group instead (inline, matched by call order).

    Raises:
        HorovodInternalError: Ranks disagree on shape, dtype or op, or a peer was lost.
    """
    c.check_tensors("allreduce", [tensor])
    rop = c.resolve_op(average, op)
    comp = horovod_compressor(compression)
    sent, ctx = comp.compress(tensor) if comp is not None else (tensor, None)
    out = c.AllreduceFn.apply(sent, name, rop, float(prescale_factor), float(postscale_factor),
                              process_set, process_group)
    return comp.decompress(out, ctx) if comp is not None else out


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None, *,
                    process_group: Any = None) -> Any:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    return c.submit("allgather", [tensor], name, process_set, process_group,
                    finish=lambda res: res[0][0])


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None, *,
              process_group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; only the first dimension may differ.

    Differentiable: the gradient is this rank's slice of the averaged output gradient.

    Raises:
        HorovodInternalError: Ranks disagree on dtype or trailing shape, or a peer was lost.
    """
    c.check_tensors("allgather", [tensor])
    return c.AllgatherFn.apply(tensor, name, process_set, process_group)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None, *, process_group: Any = None) -> Any:
    """Start broadcasting root's ``tensor`` into a new tensor (the input is not modified)."""
    return c.broadcast_async(tensor, global_root(root_rank, process_group), False, name,
                             process_set, process_group)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (input unchanged).

    Differentiable: the root gets the averaged gradient, other ranks zero.

    Raises:
        HorovodInternalError: Ranks disagree on shape, dtype or root, or a peer was lost.
    """
    c.check_tensors("broadcast", [tensor])
    return c.BroadcastFn.apply(tensor, global_root(root_rank, process_group), name,
                               process_set, process_group)
