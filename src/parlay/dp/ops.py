"""Reduction operations: the one table lives in :mod:`parlay.comm`; these are its names as
``parlay.dp`` (and ``parlay``) export them, numbered as Horovod numbers them."""
from __future__ import annotations

from parlay.reduce_ops import ReduceOp

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product"]

Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
