"""The one reduce-op table: how the ranks' contributions combine, by name or by number.

:mod:`parlay.comm` exports these (``comm.ReduceOp``, ``comm.reduce_op``, ...) and reduces with
them; ``parlay.Average`` / ``parlay.Sum`` and Horovod's ``hvd.Average``, ... are the members of
:class:`ReduceOp`, and every layer maps an op onto c10d through :func:`c10d_op`.
"""
from __future__ import annotations

import enum
import operator
from typing import Any, SupportsIndex

import torch.distributed as dist

from parlay.errors import ConfigError

__all__ = ["ReduceOp", "REDUCE_OPS", "reduce_op", "c10d_op"]


class ReduceOp(enum.IntEnum):
    """How contributions of the ranks combine (numbered as Horovod numbers them, so ported
    scripts that pass ``hvd.Average`` or a bare ``0`` keep working)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


#: Every name parlay accepts for a reduction. ``"avg"`` divides the sum by the group size;
#: Adasum has no c10d op (parlay.horovod computes it from an allgather).
REDUCE_OPS: dict[str, ReduceOp] = {
    "sum": ReduceOp.Sum, "avg": ReduceOp.Average, "average": ReduceOp.Average,
    "min": ReduceOp.Min, "max": ReduceOp.Max, "product": ReduceOp.Product,
    "adasum": ReduceOp.Adasum,
}
_C10D_OPS = {ReduceOp.Average: dist.ReduceOp.SUM, ReduceOp.Sum: dist.ReduceOp.SUM,
             ReduceOp.Min: dist.ReduceOp.MIN, ReduceOp.Max: dist.ReduceOp.MAX,
             ReduceOp.Product: dist.ReduceOp.PRODUCT}


def reduce_op(op: object) -> ReduceOp:
    """The :class:`ReduceOp` named by ``op``: a name of :data:`REDUCE_OPS` (any case), a
    ``ReduceOp`` or its number (an ``int``, a NumPy integer: anything ``operator.index``
    takes, but not a bool). Every layer that accepts an op converts it here.

    Raises:
        ConfigError: Anything else.
    """
    if isinstance(op, str):
        found = REDUCE_OPS.get(op.lower())
        if found is not None:
            return found
    elif isinstance(op, SupportsIndex) and not isinstance(op, bool):
        number = operator.index(op)
        if number in ReduceOp._value2member_map_:
            return ReduceOp(number)
    raise ConfigError(f"reduction op must be one of {sorted(REDUCE_OPS)} or a ReduceOp "
                      f"(e.g. parlay.Average), got {op!r}.")


def c10d_op(op: object) -> Any:
    """The ``torch.distributed.ReduceOp`` that carries ``op`` (Average travels as SUM).

    Raises:
        ConfigError: An unknown op, or Adasum (no c10d equivalent).
    """
    rop = reduce_op(op)
    if rop not in _C10D_OPS:
        raise ConfigError(f"{rop.name} has no torch.distributed reduction. Hint: Adasum runs "
                          "through parlay.horovod (hvd.allreduce(op=hvd.Adasum)).")
    return _C10D_OPS[rop]
