"""Parameter-server mode: sharded parameters, sync / async / bounded-staleness consistency.

Ranks ``0..K-1`` are parameter servers (``parlay run --ps K``), the others workers. Servers hold
a :class:`ShardPlan`'s shard of the parameters and apply any ``torch.optim`` optimizer to it;
workers compute gradients and keep no optimizer state. All traffic is torch.distributed
point-to-point over a gloo group of CPU tensors.
"""
from parlay.ps.consistency import (Consistency, Update, available_consistency, get_consistency,
                                   max_lead, register_consistency)
from parlay.ps.plan import DEFAULT_SPLIT_BYTES, PLACEMENTS, Piece, ShardPlan
from parlay.ps.session import DistributedSession

__all__ = ["DistributedSession", "ShardPlan", "Piece", "PLACEMENTS", "DEFAULT_SPLIT_BYTES",
           "Consistency", "Update", "get_consistency", "register_consistency",
           "available_consistency", "max_lead"]
