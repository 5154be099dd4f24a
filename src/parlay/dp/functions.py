"""Collective helpers for data-parallel scripts: broadcast state, reduce and gather tensors.

Signatures follow Horovod's (``root_rank``, ``average=``/``op=``, ``name=``) so ported scripts
run unchanged; every function also takes ``process_group`` (a torch process group).
"""
from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping

import torch

from parlay import comm
from parlay.dp.ops import ReduceOp
from parlay.errors import ConfigError

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object", "allreduce", "allreduce_async", "allgather", "allgather_async",
           "broadcast", "broadcast_async", "coalesced_broadcast"]


def _check_root(root_rank: int, group: Any) -> None:
    world = comm.group_size(group)
    if not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ConfigError(f"root_rank must be an int in [0, {world}), got {root_rank!r}.")


def coalesced_broadcast(tensors: list[torch.Tensor], root_rank: int = 0,
                        process_group: Any = None) -> None:
    """Broadcast tensors in place, fusing those of one dtype and device into one message."""
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


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, process_group: Any = None) -> None:
    """Overwrite every rank's tensors with root's, in place.

    Args:
        params: ``model.state_dict()`` (parameters and buffers) or ``model.named_parameters()``.
        root_rank: Rank whose values win.
        process_group: Group (default: the world).

    Raises:
        ConfigError: ``params`` is neither a mapping nor (name, tensor) pairs.
    """
    _check_root(root_rank, process_group)
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        try:
            items = sorted(list(params), key=lambda kv: str(kv[0]))
        except (TypeError, ValueError, IndexError):
            raise ConfigError("broadcast_parameters expects model.state_dict() or "
                              "model.named_parameters().") from None
    tensors = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ConfigError("broadcast_parameters expects (name, tensor) pairs; "
                              f"got {type(item).__name__}.")
        if isinstance(item[1], torch.Tensor):
            tensors.append(item[1])
        elif item[1] is not None:
            raise ConfigError(f"broadcast_parameters: {item[0]!r} is a "
                              f"{type(item[1]).__name__}, not a tensor.")
    coalesced_broadcast(tensors, root_rank, process_group)


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


def _fill_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__parlay_tensor__":
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill_tensors(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group: Any = None) -> None:
    """Make every rank's optimizer state (buffers, step counts, hyper-parameters) root's.

    Works for every ``torch.optim`` optimizer: the structure of root's ``state_dict()`` travels
    as a small object and its tensors as fused broadcasts, then each rank loads it.
    """
    _check_root(root_rank, process_group)
    me = comm.group_rank(process_group)
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(optimizer.state_dict(), tensors) if me == root_rank else None
    skeleton = comm.broadcast_object(skeleton, src=root_rank, group=process_group)
    if me != root_rank:
        tensors = []
        metas: list[tuple[int, tuple[int, ...], str]] = []

        def collect(o: Any) -> None:
            if isinstance(o, tuple) and len(o) == 4 and o[0] == "__parlay_tensor__":
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
        tensors = [t.detach().clone() if t.device.type == "cpu" else t.detach()
                   for t in tensors]
    # step counters of some optimizers live on CPU even for CUDA params: broadcast per device.
    coalesced_broadcast(tensors, root_rank, process_group)
    if me != root_rank:
        optimizer.load_state_dict(_fill_tensors(skeleton, tensors))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_group: Any = None) -> Any:
    """Broadcast any picklable object from ``root_rank``; returns it on every rank."""
    _check_root(root_rank, process_group)
    return comm.broadcast_object(obj, src=root_rank, group=process_group)


def allgather_object(obj: Any, name: str | None = None, process_group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank, ordered by rank."""
    return comm.allgather_object(obj, group=process_group)


def _resolve_op(average: bool | None, op: Any) -> ReduceOp:
    if average is not None and op is not None:
        raise ConfigError("pass either average= (deprecated) or op=, not both.")
    if op is None:
        return ReduceOp.Average if average is None or average else ReduceOp.Sum
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        raise ConfigError(f"op must be one of parlay.Average, Sum, Min, Max, Product; "
                          f"got {op!r}.") from None


_C10D = {ReduceOp.Average: "sum", ReduceOp.Sum: "sum", ReduceOp.Min: "min",
         ReduceOp.Max: "max", ReduceOp.Product: "product"}


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, process_group: Any = None) -> comm.Handle:
    """Start an allreduce of a copy of ``tensor``; ``handle.wait()`` returns the result."""
    rop = _resolve_op(average, op)
    if rop == ReduceOp.Adasum:
        raise ConfigError("op=Adasum is not supported; use parlay.Average.")
    out = tensor.detach().clone()
    h = comm.allreduce(out, _C10D[rop], group=process_group, async_op=True)
    world = comm.group_size(process_group)

    def finish() -> torch.Tensor:
        res = h.wait()
        if rop == ReduceOp.Average:
            if res.dtype.is_floating_point or res.is_complex():
                res.div_(world)
            else:
                res.floor_divide_(world)
        return res
    return comm.Handle(None, "allreduce", finish)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              op: Any = None, process_group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return the result (the input is not modified).

    Args:
        tensor: Input tensor.
        average: Deprecated Horovod flag; prefer ``op``.
        name: Ignored (kept for Horovod compatibility).
        op: ``parlay.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        process_group: Group (default: the world).
    """
    return allreduce_async(tensor, average, name, op, process_group).wait()


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_group: Any = None) -> comm.Handle:
    """Start a concatenation of every rank's ``tensor`` along dim 0 (sizes may differ)."""
    return comm.allgather(tensor, group=process_group, async_op=True)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; first-dimension sizes may differ."""
    return allgather_async(tensor, name, process_group).wait()


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_group: Any = None) -> comm.Handle:
    """Start a broadcast of a copy of ``tensor`` from ``root_rank``."""
    _check_root(root_rank, process_group)
    out = tensor.detach().clone()
    return comm.broadcast(out, src=root_rank, group=process_group, async_op=True)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_group: Any = None) -> torch.Tensor:
    """Return root's ``tensor`` on every rank (the input is not modified)."""
    return broadcast_async(tensor, root_rank, name, process_group).wait()
