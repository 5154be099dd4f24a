"""Data-parallel mode: bucketed, overlapped gradient allreduce, and state broadcasts.

Everything here runs straight on c10d through :mod:`parlay.comm`; nothing imports
:mod:`parlay.horovod` (which builds on this package, never the other way round).
"""
from parlay.dp.buckets import Bucket, BucketPlan, ParamInfo
from parlay.dp.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                 broadcast_parameters)
from parlay.dp.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from parlay.dp.optimizer import DistributedOptimizer

__all__ = ["Bucket", "BucketPlan", "ParamInfo", "DistributedOptimizer", "ReduceOp", "Average",
           "Sum", "Adasum", "Min", "Max", "Product", "allgather_object", "broadcast_object",
           "broadcast_optimizer_state", "broadcast_parameters"]
