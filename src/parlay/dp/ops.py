"""Reduction operations, numbered as Horovod numbers them so ported scripts keep working."""
from __future__ import annotations

import enum

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product"]


class ReduceOp(enum.IntEnum):
    """How contributions of the ranks combine."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
