"""Collectives for data-parallel scripts, with Horovod's semantics; shared by ``parlay`` and
``parlay.horovod`` (``parlay.allreduce is parlay.horovod.allreduce``).

Tensor collectives (``allreduce``, ``allgather``, ``broadcast`` and their ``_async`` forms)
follow ``horovod.torch``: same argument names and order, defaults (``op=Average``), autograd
rules and asynchronous handles (``hvd.poll`` / ``hvd.synchronize``, or ``handle.wait()``).
They run on a *process set* (default: every rank), matched across ranks by name, on a
background negotiation engine (:mod:`parlay.horovod.engine`); ranks that disagree on shape,
dtype or root get :class:`~parlay.horovod.HorovodInternalError` instead of a hang.

Every function also takes ``process_group=``: a plain torch group, on which the operation runs
inline in the calling thread, matched by call order as c10d does (no names, no join). There,
as before, ``root_rank`` counts within that group; everywhere else it is a global rank.

State helpers (``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
``allgather_object``) run directly on the set's (or the given) group in the calling thread.
"""
from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from parlay import comm
from parlay.errors import ConfigError

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object", "allreduce", "allreduce_async", "allgather", "allgather_async",
           "broadcast", "broadcast_async", "coalesced_broadcast"]


def _c() -> Any:
    # Deferred: parlay.horovod re-exports this module's functions, so it imports it first.
    from parlay.horovod import collectives

    return collectives


def _check_group_root(root_rank: int, group: Any) -> None:
    world = comm.group_size(group)
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or not 0 <= root_rank < world:
        raise ConfigError(f"root_rank must be an int in [0, {world}), got {root_rank!r}.")


def _group_and_root(root_rank: int, process_set: Any, process_group: Any) -> tuple[Any, int]:
    """The torch group to use directly and the root's rank within it."""
    if process_group is not None:
        if process_set is not None and process_set.process_set_id != 0:
            raise ConfigError("pass either process_set= (Horovod) or process_group= (a torch "
                              "group), not both.")
        _check_group_root(root_rank, process_group)
        return process_group, root_rank
    from parlay.horovod.process_sets import global_process_set

    ps = global_process_set if process_set is None else process_set
    group = ps.group()
    members = ps.global_ranks()
    if root_rank not in members:
        raise ConfigError(f"root_rank must be a global rank in the process set {members}, "
                          f"got {root_rank!r}.")
    return group, members.index(root_rank)


def _global_root(root_rank: int, process_group: Any) -> int:
    if process_group is None:
        return root_rank
    _check_group_root(root_rank, process_group)
    return dist.get_global_rank(process_group, root_rank)


def _compressor(compression: Any) -> Any:
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
    c = _c()
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
    c = _c()
    rop = c.resolve_op(average, op)
    comp = _compressor(compression)
    sent, ctx = comp.compress(tensor) if comp is not None else (tensor, None)
    out = c.AllreduceFn.apply(sent, name, rop, float(prescale_factor), float(postscale_factor),
                              process_set, process_group)
    return comp.decompress(out, ctx) if comp is not None else out


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None, *,
                    process_group: Any = None) -> Any:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    return _c().submit("allgather", [tensor], name, process_set, process_group,
                       finish=lambda res: res[0][0])


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None, *,
              process_group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; only the first dimension may differ.

    Differentiable: the gradient is this rank's slice of the averaged output gradient.

    Raises:
        HorovodInternalError: Ranks disagree on dtype or trailing shape, or a peer was lost.
    """
    return _c().AllgatherFn.apply(tensor, name, process_set, process_group)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None, *, process_group: Any = None) -> Any:
    """Start broadcasting root's ``tensor`` into a new tensor (the input is not modified)."""
    return _c().broadcast_async(tensor, _global_root(root_rank, process_group), False, name,
                                process_set, process_group)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None, *, process_group: Any = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (input unchanged).

    Differentiable: the root gets the averaged gradient, other ranks zero.

    Raises:
        HorovodInternalError: Ranks disagree on shape, dtype or root, or a peer was lost.
    """
    return _c().BroadcastFn.apply(tensor, _global_root(root_rank, process_group), name,
                                  process_set, process_group)


# ------------------------------------------------------------------------------ state
def coalesced_broadcast(tensors: list[torch.Tensor], root_rank: int = 0,
                        process_group: Any = None) -> None:
    """Broadcast tensors in place from group rank ``root_rank``, one message per dtype/device."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = collections.defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        comm.broadcast(flat, src=root_rank, group=process_group)
        off = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[off: off + n].view_as(t))
                off += n


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any],
                         root_rank: int = 0, process_set: Any = None, *,
                         process_group: Any = None) -> None:
    """Overwrite every rank's tensors with root's, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``.
        root_rank: Rank whose values win (global; within ``process_group`` if given).
        process_set: Ranks to broadcast among (default: all).
        process_group: A torch group instead.

    Raises:
        ConfigError: ``params`` holds something other than tensors.
    """
    group, root = _group_and_root(root_rank, process_set, process_group)
    if isinstance(params, Mapping):
        items: list[Any] = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        try:
            items = list(params)
        except TypeError:
            raise ConfigError("broadcast_parameters expects model.state_dict(), "
                              "model.named_parameters() or model.parameters(); got "
                              f"{type(params).__name__}.") from None
        items = [it if isinstance(it, tuple) else (None, it) for it in items]
        if all(isinstance(n, str) for n, _ in items):
            items.sort(key=lambda kv: kv[0])
    tensors = []
    for item in items:
        if len(item) != 2:
            raise ConfigError("broadcast_parameters expects (name, tensor) pairs or tensors.")
        if isinstance(item[1], torch.Tensor):
            tensors.append(item[1])
        elif item[1] is not None:
            raise ConfigError(f"broadcast_parameters: {item[0]!r} is a "
                              f"{type(item[1]).__name__}, not a tensor.")
    coalesced_broadcast(tensors, root, group)


def _strip_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return ("__parlay_tensor__", len(out) - 1, tuple(obj.shape), str(obj.dtype).split(".")[-1])
    if isinstance(obj, dict):
        return {k: _strip_tensors(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_tensors(v, out) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_strip_tensors(v, out) for v in obj)
    return obj


def _is_slot(o: Any) -> bool:
    return isinstance(o, tuple) and len(o) == 4 and o[0] == "__parlay_tensor__"


def _fill_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if _is_slot(obj):
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill_tensors(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Any = None, process_set: Any = None, *,
                              process_group: Any = None) -> None:
    """Make every rank's optimizer state (buffers, step counts, hyper-parameters) root's.

    Works for every ``torch.optim`` optimizer, including ones newer than Horovod (and
    L-BFGS): the structure of root's ``state_dict()`` travels as a small object and its tensors
    as fused broadcasts, then each rank loads it, so hyper-parameters keep root's types.

    Args:
        optimizer: The optimizer (or a DistributedOptimizer).
        root_rank: Rank whose state wins (global; within ``process_group`` if given).
        model: Accepted for Horovod compatibility; not needed.
        process_set: Ranks to broadcast among (default: all).
        process_group: A torch group instead.
    """
    group, root = _group_and_root(root_rank, process_set, process_group)
    me = comm.group_rank(group)
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(optimizer.state_dict(), tensors) if me == root else None
    skeleton = comm.broadcast_object(skeleton, src=root, group=group)
    if me != root:
        metas: list[tuple[int, tuple[int, ...], str]] = []

        def collect(o: Any) -> None:
            if _is_slot(o):
                metas.append((o[1], o[2], o[3]))
            elif isinstance(o, dict):
                for v in o.values():
                    collect(v)
            elif isinstance(o, (list, tuple)):
                for v in o:
                    collect(v)
        collect(skeleton)
        metas.sort()
        dev = next((p.device for g in optimizer.param_groups for p in g["params"]),
                   torch.device("cpu"))
        tensors = [torch.empty(shape, dtype=getattr(torch, dt), device=dev)
                   for _, shape, dt in metas]
    else:
        tensors = [t.detach().clone() for t in tensors]
    coalesced_broadcast(tensors, root, group)
    if me != root:
        optimizer.load_state_dict(_fill_tensors(skeleton, tensors))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None, *, process_group: Any = None) -> Any:
    """Broadcast any picklable object from ``root_rank``; returns it on every rank."""
    group, root = _group_and_root(root_rank, process_set, process_group)
    return comm.broadcast_object(obj, src=root, group=group)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None, *,
                     process_group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank of the set, ordered by rank."""
    if process_group is None:
        from parlay.horovod.process_sets import global_process_set

        process_group = (global_process_set if process_set is None else process_set).group()
    return comm.allgather_object(obj, group=process_group)
