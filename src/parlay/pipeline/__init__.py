"""Pipeline parallelism, alone or as hybrid pipeline x data parallel.

The public API is small::

    from parlay.pipeline import Pipeline
    pipe = Pipeline(model, loss_fn, stages=2, chunks=4, schedule="1f1b",
                    balance=None, activation_dtype=None)
    opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    out = pipe.step(x, y); opt.step()

plus the pure :func:`partition` (how layers are split), :func:`theoretical_bubble` and the
schedule registry. In the Trainer the same machinery is ``mode="hybrid"``
(:mod:`parlay.strategies.hybrid`). Schedules are PyTorch's ``torch.distributed.pipelining``.
"""
from parlay.pipeline.hybrid import HybridMesh, build_mesh
from parlay.pipeline.partition import Partition, balance_by_cost, partition
from parlay.pipeline.pipe import Pipeline, StepOutput
from parlay.pipeline.schedule import (
                                      available_schedules,
                                      get_schedule,
                                      register_schedule,
                                      theoretical_bubble,
)

__all__ = ["Pipeline", "StepOutput", "Partition", "partition", "balance_by_cost", "HybridMesh",
           "build_mesh", "theoretical_bubble", "available_schedules", "get_schedule",
           "register_schedule"]
