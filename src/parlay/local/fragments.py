"""The pieces of :class:`~parlay.local.diloco.DiLoCoOptimizer`'s rounds: the fragments the
parameters are split into, an exchange under way, and the outer optimizer's arguments."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from parlay import comm
from parlay.errors import ConfigError

__all__ = ["OUTER_DEFAULTS", "Fragment"]

#: The outer optimizer of the DiLoCo paper: Nesterov SGD, lr 0.7, momentum 0.9.
OUTER_DEFAULTS: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@dataclass
class _InFlight:
    """A fragment's exchange under way: its handle, the local weights it left from, and the
    inner step at which it is merged."""

    handle: comm.Handle
    sent_from: list[torch.Tensor]
    due: int
    rounds_left: int = 0  # further rounds not yet started (see DiLoCoOptimizer.step)


@dataclass
class Fragment:
    """A group of parameters synced together, ``offset`` steps into every round."""

    index: int
    names: list[str]
    params: list[torch.Tensor]
    outer: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    offset: int
    flight: _InFlight | None = field(default=None, repr=False)
    sent_at: int = 0  # the inner step its last exchange started at


def _outer_args(cls: Any, args: Any) -> dict[str, Any]:
    """The outer optimizer's arguments, checked (it is built once per fragment)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) \
            or issubclass(cls, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        raise ConfigError(f"outer_optimizer must be a torch.optim.Optimizer class stepped "
                          f"without a closure on dense gradients (e.g. torch.optim.SGD), got "
                          f"{cls!r}.")
    if args is not None and not isinstance(args, dict):
        raise ConfigError(f"outer_optimizer_args must be a dict of keyword arguments, got "
                          f"{args!r}. Hint: {{'lr': 0.7, 'momentum': 0.9, 'nesterov': True}}.")
    out = dict(OUTER_DEFAULTS if args is None and cls is torch.optim.SGD else args or {})
    lr = out.get("lr")  # torch's defaults (SGD 1e-3) are no outer learning rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise ConfigError(f"outer_optimizer_args needs a finite 'lr' > 0, got {out}. Hint: "
                          "e.g. {'lr': 0.7, 'momentum': 0.9, 'nesterov': True} (the default "
                          "for SGD), or {'lr': 1.0} for plain averaging.")
    return out


def _split(named: list[tuple[str, torch.Tensor]], parts: int) -> list[list[int]]:
    """``parts`` contiguous, non-empty groups of about equal size, in registration order.

    Raises:
        ConfigError: Fewer parameters than ``parts``.
    """
    if len(named) < parts:
        raise ConfigError(f"fragments={parts} needs at least as many parameter tensors (with "
                          "a sharded inner optimizer: units; at shard='optimizer'/'gradients' "
                          f"25 MB buckets); there are {len(named)}. Hint: fragments={len(named)}"
                          " or fewer, or shard='parameters' (a unit per module).")
    total = max(1, sum(p.numel() for _, p in named))
    groups: list[list[int]] = [[] for _ in range(parts)]
    seen, g = 0, 0
    for i, (_, p) in enumerate(named):
        want = min(parts - 1, int((seen + p.numel() / 2) * parts / total))
        # never skip a group, and leave one tensor at least for each group still to come
        g = min(max(g, want, parts - (len(named) - i)), g + 1 if groups[g] else g)
        groups[g].append(i)
        seen += p.numel()
    return groups
