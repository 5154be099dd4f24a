"""How the :class:`~parlay.trainer.Trainer` trains a model across processes, one mode per
strategy. Owned by the Trainer: the mode packages (:mod:`parlay.dp`, :mod:`parlay.ps`,
:mod:`parlay.pipeline`) know nothing of it.

- :mod:`~parlay.strategies.base`: the :class:`Strategy` protocol, :class:`StepResult` and the
  registry of modes (:func:`get_strategy`, :func:`register_strategy`).
- :mod:`~parlay.strategies.template`: what every mode shares: precision (autocast), the one
  fp16 :class:`~parlay.strategies.template.LossScaler`, gradient clipping, optimizer
  construction and the order of a data-parallel step (average, check, unscale, clip, step).
- ``allreduce.py``, ``ps.py``, ``hybrid.py``, ``diloco.py``: thin adapters over
  :mod:`parlay.dp`, :mod:`parlay.ps`, :mod:`parlay.pipeline` and :mod:`parlay.local`,
  imported when their mode is first asked for (the hybrid mode pulls in
  ``torch.distributed.pipelining``, seconds on a loaded machine).
"""
from parlay.strategies.base import _REGISTRY as _REGISTRY  # the shared table (test_registry)
from parlay.strategies.base import (StepResult, Strategy, available_strategies, get_strategy,
                                    register_strategy)

__all__ = ["Strategy", "StepResult", "register_strategy", "get_strategy", "available_strategies"]


def _load_builtin(only: str | None = None) -> None:
    """Import the built-in mode ``only`` (every one for another name or None): importing an
    adapter registers it. Only the mode asked for is imported: the hybrid mode pulls in
    ``torch.distributed.pipelining``, which takes seconds on a loaded machine."""
    every = only not in ("allreduce", "ps", "hybrid", "diloco")
    if every or only == "allreduce":
        import parlay.strategies.allreduce  # noqa: F401
    if every or only == "ps":
        import parlay.strategies.ps  # noqa: F401
    if every or only == "hybrid":
        import parlay.strategies.hybrid  # noqa: F401
    if every or only == "diloco":
        import parlay.strategies.diloco  # noqa: F401


_REGISTRY.load = _load_builtin
