"""Data-parallel mode: bucketed, overlapped gradient allreduce."""
from parlay.dp.buckets import Bucket, BucketPlan, ParamInfo
from parlay.dp.functions import (allgather, allgather_async, allgather_object, allreduce,
                                 allreduce_async, broadcast, broadcast_async, broadcast_object,
                                 broadcast_optimizer_state, broadcast_parameters)
from parlay.dp.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from parlay.dp.optimizer import DistributedOptimizer

__all__ = ["Bucket", "BucketPlan", "ParamInfo", "DistributedOptimizer", "ReduceOp", "Average",
           "Sum", "Adasum", "Min", "Max", "Product", "allgather", "allgather_async",
           "allgather_object", "allreduce", "allreduce_async", "broadcast", "broadcast_async",
           "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]
