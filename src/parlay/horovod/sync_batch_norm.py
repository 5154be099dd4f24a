"""SyncBatchNorm: batch normalisation with statistics over every rank's batch (CPU and GPU).

In training, each rank computes its per-channel count, mean and sum of squared deviations;
one allgather combines them exactly (Chan et al.'s parallel variance), so the normalisation
equals BatchNorm over the concatenated batch. Backward allreduces the two per-channel sums the
input gradient needs. Weight and bias gradients stay local, as in torch's and Horovod's
SyncBatchNorm (the DistributedOptimizer averages them). In eval mode, or in a world of one,
it is plain BatchNorm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from parlay.errors import ConfigError
from parlay.horovod import collectives as c
from parlay.reduce_ops import ReduceOp

__all__ = ["SyncBatchNorm"]


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, bias: Any, running_mean: Any,
                running_var: Any, eps: float, momentum: float, pset: Any) -> torch.Tensor:
        ch = x.shape[1]
        xc = x.transpose(0, 1).reshape(ch, -1)
        work = xc.double()
        n = torch.tensor([float(xc.shape[1])], dtype=torch.float64, device=x.device)
        mean = work.mean(1) if xc.shape[1] else work.new_zeros(ch)
        m2 = ((work - mean[:, None]) ** 2).sum(1)
        out, _ = c.submit("allgather", [torch.cat([n, mean, m2]).reshape(1, -1)], None, pset,
                          None).wait()
        rows = out[0]
        counts, means, m2s = rows[:, 0], rows[:, 1: 1 + ch], rows[:, 1 + ch:]
        total = counts.sum()
        if total <= 1:
            raise ConfigError(f"SyncBatchNorm needs more than one value per channel over all "
                              f"ranks, got {int(total)}.")
        gmean = (counts[:, None] * means).sum(0) / total
        gm2 = (m2s + counts[:, None] * (means - gmean) ** 2).sum(0)
        var = gm2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(gmean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((gm2 / (total - 1)).to(running_var.dtype),
                                                    alpha=momentum)
        xhat = (work - gmean[:, None]) * invstd[:, None]
        y = xhat if weight is None else xhat * weight.double()[:, None] + bias.double()[:, None]
        ctx.save_for_backward(xhat.to(x.dtype), invstd.to(x.dtype), weight)
        ctx.meta = (total.item(), pset, x.shape)
        return y.to(x.dtype).reshape(ch, x.shape[0], *x.shape[2:]).transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        total, pset, shape = ctx.meta
        ch = shape[1]
        dyc = dy.transpose(0, 1).reshape(ch, -1)
        local = torch.cat([dyc.sum(1), (dyc * xhat).sum(1)])
        summed = c.allreduce_async([local], False, None, ReduceOp.Sum, 1.0, 1.0, pset, None,
                                   True).wait()
        sum_dy, sum_dy_xhat = summed[:ch], summed[ch:]
        w = weight if weight is not None else torch.ones_like(invstd)
        dx = (w * invstd)[:, None] / total * (total * dyc - sum_dy[:, None]
                                              - xhat * sum_dy_xhat[:, None])
        dx = dx.reshape(ch, shape[0], *shape[2:]).transpose(0, 1)
        dw = (dyc * xhat).sum(1) if weight is not None else None
        db = dyc.sum(1) if weight is not None else None
        return dx, dw, db, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the whole process set's batch.

    Args:
        num_features: Channels (dim 1 of the input).
        eps: Added to the variance.
        momentum: Running-statistics factor (``None``: cumulative average).
        affine: Learnable weight and bias.
        track_running_stats: Keep running mean and variance.
        process_set: Ranks whose batches are normalised together (default: all).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        if not self.training or c.set_size(self.process_set) == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, self.training or not self.track_running_stats,
                                factor, self.eps)
        return _SyncBN.apply(input, self.weight, self.bias,
                             self.running_mean if self.track_running_stats else None,
                             self.running_var if self.track_running_stats else None,
                             self.eps, factor, self.process_set)
