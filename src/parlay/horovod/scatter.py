"""Alltoall and reducescatter: Horovod's local checks and their autograd rules.

Alltoall's gradient is the reverse alltoall (with the received splits); reducescatter's is the
allgather of the (size-scaled, for Sum) gradient. Both run through
:func:`parlay.horovod.collectives.submit`, like every Horovod-style operation.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from parlay.errors import ConfigError
from parlay.horovod.basics import HorovodUnsupportedError
from parlay.horovod.collectives import _first, set_size, submit
from parlay.reduce_ops import ReduceOp

__all__ = ["alltoall_splits", "AlltoallFn", "reducescatter_check", "ReducescatterFn",
           "GroupedReducescatterFn"]


# ------------------------------------------------------------------------------ alltoall
def alltoall_splits(tensor: torch.Tensor, splits: Any, size: int) -> tuple[int, ...] | None:
    """Validate ``splits`` (rows sent to each rank) locally, as Horovod does.

    Raises:
        ConfigError: Not integers, wrong length, negative, or more rows than the tensor has;
            or, without splits, a first dimension that does not divide by the set size.
    """
    d0 = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if d0 % size:
            raise ConfigError(f"alltoall without splits divides the first dimension equally: "
                              f"{d0} rows do not divide by {size} ranks. Hint: pass splits=.")
        return None
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise ConfigError(f"alltoall splits must hold 32-bit integers, got {splits.dtype}.")
        vals = [int(v) for v in splits.reshape(-1).tolist()]
    else:
        try:
            vals = [int(v) for v in splits]
        except (TypeError, ValueError):
            raise ConfigError(f"alltoall splits must be integers, got {splits!r}.") from None
    if len(vals) != size or any(v < 0 for v in vals):
        raise ConfigError(f"alltoall splits must be {size} non-negative counts (one per rank), "
                          f"got {vals}.")
    if sum(vals) > d0:
        raise ConfigError(f"alltoall splits send {sum(vals)} rows but the tensor has {d0}.")
    return tuple(vals)


class AlltoallFn(torch.autograd.Function):
    """Alltoall whose gradient is the alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: tuple[int, ...] | None,
                name: str | None, pset: Any, pg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, recv = submit("alltoall", [tensor.detach()], name, pset, pg, splits=splits).wait()
        ctx.save = (tuple(recv), pset, pg)
        recv_t = torch.tensor(recv, dtype=torch.int32)
        ctx.mark_non_differentiable(recv_t)
        return out, recv_t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        recv, pset, pg = ctx.save
        g, _r = submit("alltoall", [grad.contiguous()], None, pset, pg, splits=recv).wait()
        return g, None, None, None, None


# ------------------------------------------------------------------------------ reducescatter
def reducescatter_check(tensors: Sequence[torch.Tensor], op: ReduceOp) -> None:
    """Horovod's local checks: no scalars, no Adasum.

    Raises:
        HorovodUnsupportedError: Adasum requested.
        ConfigError: A 0-dimensional tensor.
    """
    if op == ReduceOp.Adasum:
        raise HorovodUnsupportedError("reducescatter does not support op=Adasum. Hint: use "
                                      "op=hvd.Average or hvd.Sum (allreduce supports Adasum).")
    if any(t.dim() == 0 for t in tensors):
        raise ConfigError("reducescatter needs tensors with at least one dimension (it splits "
                          "the first); got a scalar.")


def _rs_grad(g: torch.Tensor, op: ReduceOp, pre: float, post: float, size: int) -> torch.Tensor:
    g = g.contiguous()
    if op == ReduceOp.Sum:
        g = g * size
    return g * (pre * post) if pre * post != 1.0 else g


class ReducescatterFn(torch.autograd.Function):
    """Reducescatter whose gradient is the allgather of the (scaled) gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, pset: Any, pg: Any) -> torch.Tensor:
        ctx.save = (op, pre, post, pset, pg)
        return submit("reducescatter", [tensor.detach()], name, pset, pg, op=op, prescale=pre,
                      postscale=post, finish=_first).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, pset, pg = ctx.save
        g = _rs_grad(grad, op, pre, post, set_size(pset, pg))
        out, _ = submit("allgather", [g], None, pset, pg).wait()
        return out[0], None, None, None, None, None, None


class GroupedReducescatterFn(torch.autograd.Function):
    """Grouped reducescatter with the reducescatter gradient rule."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, pset: Any,
                pg: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save = (op, pre, post, pset, pg)
        return tuple(submit("reducescatter", [t.detach() for t in tensors], name, pset, pg,
                            op=op, prescale=pre, postscale=post).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, pset, pg = ctx.save
        n = set_size(pset, pg)
        out, _ = submit("allgather", [_rs_grad(g, op, pre, post, n) for g in grads], None,
                        pset, pg).wait()
        return (None,) * 6 + tuple(out)
