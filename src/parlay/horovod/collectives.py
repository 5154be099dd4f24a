"""The core of every Horovod-style operation: where it runs, its request, its autograd rule.

An operation runs either on a process set's :class:`~parlay.horovod.engine.Engine` (Horovod's
semantics: matched by name, asynchronous, join-aware) or, when the caller passes a plain torch
``process_group``, at once on that group (c10d's semantics: matched by call order) after the
same descriptor check. Gradient rules follow Horovod's: allreduce's
gradient is the allreduce of the gradient; allgather's and broadcast's are the averaged
gradient (sliced, or zero off the root). Alltoall and reducescatter are in
:mod:`parlay.horovod.scatter`.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from parlay.errors import ConfigError
from parlay.horovod import execute
from parlay.horovod.basics import HorovodInternalError
from parlay.horovod.engine import Engine, Handle, Meta, Request, decode, encode, exchange
from parlay.horovod.groups import Group
from parlay.horovod.process_sets import ProcessSet, global_process_set
from parlay.reduce_ops import ReduceOp, reduce_op

__all__ = ["target", "resolve_op", "submit", "AllreduceFn", "GroupedAllreduceFn",
           "AllgatherFn", "GroupedAllgatherFn", "BroadcastFn", "set_size", "set_rank_of",
           "fusion_bytes"]

_DEFAULT_FUSION = 64 * 1024 * 1024


def fusion_bytes() -> int:
    """Largest fused allreduce buffer: ``HOROVOD_FUSION_THRESHOLD`` bytes (default 64 MiB),
    read when an engine starts (once per process set and init), so a script may set it after
    import, as with Horovod. Ranks that disagree fuse with the set's first member's value.

    Raises:
        ConfigError: The variable is not a non-negative integer.
    """
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    try:
        value = int(raw) if raw else _DEFAULT_FUSION
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"HOROVOD_FUSION_THRESHOLD must be a byte count >= 0, got {raw!r}. "
                          "Hint: e.g. 67108864 for 64 MiB; 0 disables fusion.")
    return value or 1


class _Inline:
    """Runs each request at once on a caller-owned group."""

    def __init__(self, group: Any) -> None:
        self.group = Group.of_torch_group(group)

    def auto_name(self, kind: str) -> str:
        return f"{kind}.inline"

    def submit(self, req: Request) -> Handle:
        # each rank's fusion threshold travels last (decode ignores it): rank 0's decides
        msgs = exchange(self.group, encode(req.key, req.meta) + [fusion_bytes()])
        metas = {r: decode(m)[1] for r, m in enumerate(msgs)}
        with torch.no_grad():
            [(req, res, err)] = execute.run_ready(self.group, [(req.key, metas, req)], set(),
                                                  msgs[0][-1])
        req.complete(res, err)
        return Handle(self, req)


def target(process_set: ProcessSet | None, process_group: Any = None) -> Any:
    """The engine of ``process_set`` (default: the global set), or an inline runner for a
    caller's torch ``process_group``.

    Raises:
        ConfigError: Both were given, the set is not registered, or this rank is not in it.
    """
    if process_group is not None:
        if process_set is not None and process_set is not global_process_set:
            raise ConfigError("pass either process_set= (Horovod) or process_group= (a torch "
                              "group), not both.")
        return _Inline(process_group)
    pset = global_process_set if process_set is None else process_set
    if not isinstance(pset, ProcessSet):
        raise ConfigError(f"process_set must be a hvd.ProcessSet, got {type(pset).__name__}. "
                          "Hint: hvd.add_process_set([ranks]), or process_group= for a torch "
                          "group.")
    pset._check_member()
    if pset._engine is None:
        pset._engine = Engine(pset.engine_prefix(), pset.global_ranks(), fusion_bytes())
    return pset._engine


def set_size(process_set: ProcessSet | None, process_group: Any = None) -> int:
    """Number of ranks an operation runs over."""
    if process_group is not None:
        return dist.get_world_size(process_group)
    pset = global_process_set if process_set is None else process_set
    pset._check_member()
    return len(pset.global_ranks())


def set_rank_of(process_set: ProcessSet | None, process_group: Any = None) -> int:
    """This process's rank within the set/group."""
    if process_group is not None:
        return dist.get_rank(process_group)
    pset = global_process_set if process_set is None else process_set
    pset._check_member()
    return pset.global_ranks().index(dist.get_rank())


def resolve_op(average: bool | None, op: Any, default: ReduceOp = ReduceOp.Average) -> ReduceOp:
    """Horovod's ``average=`` (deprecated) / ``op=`` rule.

    Raises:
        ConfigError: Both given, or an unknown op.
    """
    if average is not None and op is not None:
        raise ConfigError("pass either average= (deprecated) or op=, not both.")
    if op is None:
        return default if average is None else (ReduceOp.Average if average else ReduceOp.Sum)
    return reduce_op(op)  # hvd.Average, ..., their numbers, or parlay's names ("sum", "avg")


def check_tensors(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ConfigError(f"{kind} needs at least one tensor.")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{kind} expects torch tensors, got {type(t).__name__}.")
        if t.is_sparse:
            raise ConfigError(f"{kind} takes dense tensors. Hint: use sparse_allreduce_async "
                              "for sparse ones, or tensor.to_dense().")
    if len({t.device.type for t in tensors}) > 1:
        raise HorovodInternalError(f"{kind}: tensors of one operation must all be on the CPU "
                                   "or all on the GPU.", op=kind)


def submit(kind: str, tensors: Sequence[torch.Tensor], name: str | None,
           process_set: ProcessSet | None, process_group: Any, *,
           outputs: list[torch.Tensor] | None = None, op: ReduceOp = ReduceOp.Sum,
           root: int = -1, prescale: float = 1.0, postscale: float = 1.0,
           splits: tuple[int, ...] | None = None, finish: Any = None) -> Handle:
    """Build the request for one operation and hand it to its engine (or run it inline)."""
    check_tensors(kind, tensors)
    runner = target(process_set, process_group)
    key = f"{kind}.{name}" if name is not None else runner.auto_name(kind)
    meta = Meta(kind, tuple(str(t.dtype) for t in tensors), tuple(tuple(t.shape) for t in tensors),
                tensors[0].device.type, int(op), root, float(prescale), float(postscale), splits)
    req = Request(key, meta, inputs=list(tensors), outputs=outputs, finish=finish)
    return runner.submit(req)


def _first(res: Any) -> Any:
    return res[0]


# ------------------------------------------------------------------------------ allreduce
def allreduce_async(tensors: Sequence[torch.Tensor], inplace: bool, name: str | None,
                    op: ReduceOp, prescale: float, postscale: float,
                    process_set: ProcessSet | None, process_group: Any,
                    single: bool) -> Handle:
    """Start an allreduce of ``tensors`` (into themselves when ``inplace``)."""
    outs = list(tensors) if inplace else [t.detach().clone() for t in tensors]
    return submit("allreduce", list(tensors), name, process_set, process_group, outputs=outs,
                  op=op, prescale=prescale, postscale=postscale,
                  finish=_first if single else list)


class AllreduceFn(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce (same op and scaling) of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, pset: Any, pg: Any) -> torch.Tensor:
        ctx.args = (op, pre, post, pset, pg)
        return allreduce_async([tensor.detach()], False, name, op, pre, post, pset, pg,
                               True).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, pset, pg = ctx.args
        g = allreduce_async([grad.contiguous()], False, None, op, pre, post, pset, pg,
                            True).wait()
        return g, None, None, None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    """Grouped allreduce (one fused operation) with the allreduce gradient rule."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, pset: Any,
                pg: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, pset, pg)
        return tuple(allreduce_async([t.detach() for t in tensors], False, name, op, pre, post,
                                     pset, pg, False).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, pset, pg = ctx.args
        gs = allreduce_async([g.contiguous() for g in grads], False, None, op, pre, post, pset,
                             pg, False).wait()
        return (None,) * 6 + tuple(gs)


# ------------------------------------------------------------------------------ allgather
def _average_slices(grads: Sequence[torch.Tensor], dims: list[int], pset: Any, pg: Any,
                    me: int) -> list[torch.Tensor]:
    reduced = allreduce_async([g.contiguous() for g in grads], False, None, ReduceOp.Average,
                              1.0, 1.0, pset, pg, False).wait()
    start = sum(dims[:me])
    return [r.narrow(0, start, dims[me]) for r in reduced]


class AllgatherFn(torch.autograd.Function):
    """Allgather whose gradient is this rank's slice of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, pset: Any,
                pg: Any) -> torch.Tensor:
        out, dims = submit("allgather", [tensor.detach()], name, pset, pg).wait()
        ctx.save = (dims, pset, pg, set_rank_of(pset, pg), tensor.dim() == 0)
        return out[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dims, pset, pg, me, scalar = ctx.save
        [g] = _average_slices([grad], [d[0] for d in dims], pset, pg, me)
        return (g.reshape(()) if scalar else g), None, None, None


class GroupedAllgatherFn(torch.autograd.Function):
    """Grouped allgather (one message) with the allgather gradient rule."""

    @staticmethod
    def forward(ctx: Any, name: str | None, pset: Any, pg: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, dims = submit("allgather", [t.detach() for t in tensors], name, pset, pg).wait()
        ctx.save = (dims, pset, pg, set_rank_of(pset, pg))
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        dims, pset, pg, me = ctx.save
        res = []
        for i, g in enumerate(grads):
            [s] = _average_slices([g], [d[i] for d in dims], pset, pg, me)
            res.append(s)
        return (None, None, None, *res)


# ------------------------------------------------------------------------------ broadcast
def broadcast_async(tensor: torch.Tensor, root_rank: int, inplace: bool, name: str | None,
                    process_set: ProcessSet | None, process_group: Any) -> Handle:
    """Start a broadcast from global rank ``root_rank`` (into ``tensor`` when ``inplace``)."""
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise ConfigError(f"root_rank must be an int (a global rank), got {root_rank!r}.")
    out = tensor if inplace else tensor.detach().clone()
    return submit("broadcast", [tensor], name, process_set, process_group, outputs=[out],
                  root=root_rank, finish=_first)


class BroadcastFn(torch.autograd.Function):
    """Broadcast whose gradient is the averaged gradient on the root and zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, pset: Any,
                pg: Any) -> torch.Tensor:
        ctx.save = (root_rank, pset, pg)
        return broadcast_async(tensor.detach(), root_rank, False, name, pset, pg).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        root, pset, pg = ctx.save
        g = allreduce_async([grad.contiguous()], False, None, ReduceOp.Average, 1.0, 1.0, pset,
                            pg, True).wait()
        if dist.get_rank() != root:
            g.zero_()
        return g, None, None, None, None
