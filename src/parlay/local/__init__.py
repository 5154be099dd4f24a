"""Local-update training: replicas take inner steps alone and meet every few steps through an
outer optimizer (:class:`~parlay.local.diloco.DiLoCoOptimizer`, the ``"diloco"`` mode)."""
from parlay.local.diloco import OUTER_DEFAULTS, DiLoCoOptimizer

__all__ = ["DiLoCoOptimizer", "OUTER_DEFAULTS"]
