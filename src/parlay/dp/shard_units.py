"""What ``shard=`` shards: the levels, their checks, the units, and clipping across chunks.

A *unit* is what one rank's chunk is cut from: a bucket of the flat engine's (at most
``bucket_cap_mb``, never mixing parameter groups) or, with ``shard="parameters"``, the
parameters one module's forward reads (:func:`plan_units`). :mod:`parlay.dp.shard` runs them.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from parlay import comm
from parlay.compress.base import Compressor
from parlay.dp.buckets import Bucket, BucketPlan, ParamInfo
from parlay.errors import ConfigError

__all__ = ["LEVELS", "check_level", "plan_units", "unit_params", "clip_chunks_"]

#: The shard levels, ZeRO-1 to ZeRO-3.
LEVELS = ("optimizer", "gradients", "parameters")


def check_level(shard: Any, compressor: Compressor, optimizer: torch.optim.Optimizer) -> str | None:
    """Validate ``shard=`` against the compressor and optimizer it is combined with.

    Raises:
        ConfigError: An unknown level, a compressor that is not an element-wise cast, or an
            optimizer that needs sparse gradients or whole vectors (L-BFGS).
    """
    if shard is None or shard is False:
        return None
    if shard not in LEVELS:
        raise ConfigError(f"shard must be one of {LEVELS} or None, got {shard!r}. Hint: "
                          "'optimizer' shards the optimizer state (ZeRO-1), 'gradients' also "
                          "the gradients (ZeRO-2), 'parameters' also the parameters (ZeRO-3).")
    if compressor.shard_dtype(torch.float32) is None:
        raise ConfigError(f"shard={shard!r} reduce-scatters gradients chunk by chunk, which "
                          f"needs an element-wise compression; {compressor!r} is not one. "
                          "Hint: use compression=None, 'fp16' or 'bf16' with shard=.")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ConfigError(f"shard={shard!r} steps flat chunks of dense gradients; SparseAdam "
                          "needs sparse ones. Hint: use Adam, or shard=None.")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(f"shard={shard!r} steps each rank's chunks on their own; L-BFGS needs "
                          "norms and dot products over every parameter. Hint: shard=None.")
    return str(shard)


def plan_units(named: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
               cap_bytes: int, model: nn.Module | None = None) -> BucketPlan:
    """The units: buckets of at most ``cap_bytes`` per parameter group (with ``model``: one
    per module and parameter group), in backward order (last registered first).

    Raises:
        ConfigError: With ``model``, a parameter the model does not hold.
    """
    group = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
    keys: list[tuple[int, int]] = [(group[id(p)], 0) for _, p in named]
    if model is not None:
        owner = {id(p): m for m, (_, ps) in enumerate(unit_params(model)) for p in ps}
        missing = [n for n, p in named if id(p) not in owner]
        if missing:
            raise ConfigError(f"shard='parameters': {missing[:3]} are optimized but not held "
                              "by the model passed as model=. Hint: pass the module whose "
                              "parameters the optimizer steps.")
        keys = [(group[id(p)], owner[id(p)]) for _, p in named]
        cap_bytes = 1 << 62  # a module's parameters of one group are one unit
    infos = [ParamInfo(n, p.numel(), p.dtype, str(p.device)) for n, p in named]
    units: list[list[int]] = []
    for key in dict.fromkeys(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        sub = BucketPlan.build([infos[i] for i in idx], cap_bytes)
        units += [[idx[m] for m in b.members] for b in sub.buckets]
    units.sort(key=lambda members: -max(members))
    buckets, where = [], {}
    for b, members in enumerate(units):
        offsets, off = [], 0
        for slot, i in enumerate(members):
            offsets.append(off)
            off += infos[i].numel
            where[i] = (b, slot)
        first = infos[members[0]]
        buckets.append(Bucket(b, tuple(members), tuple(offsets), off, first.dtype, first.device))
    return BucketPlan(tuple(buckets), where)


def unit_params(model: nn.Module, *, shared: bool = False
                ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Each module with the parameters its forward gathers: its own, and for
    ``nn.MultiheadAttention`` its ``out_proj``'s too (its forward reads them directly).

    A parameter held by several modules (a head tied to an embedding's weight) belongs to the
    first one's unit; with ``shared`` it is also listed under every other module holding it,
    as each of their forwards reads it."""
    seen: set[int] = set()
    out = []
    for module in model.modules():
        mine = [p for p in module.parameters(recurse=isinstance(module, nn.MultiheadAttention))
                if shared or id(p) not in seen]
        seen.update(map(id, mine))
        if mine:
            out.append((module, mine))
    return out


def clip_chunks_(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                 group: Any) -> torch.Tensor:
    """Clip gradient chunks, which together over ``group`` make the whole gradient, to a
    global ``max_norm``; returns the norm before clipping (as
    ``torch.nn.utils.clip_grad_norm_``, whose clip coefficient it applies)."""
    p = float(norm_type)
    if not p > 0:  # -inf (the smallest |g|) and 0 (the non-zero count) see the chunks' padding
        raise ConfigError(f"clip_grad_norm_ with shard= takes a norm_type > 0 or inf, got "
                          f"{norm_type}. Hint: norm_type=2 (the default) or float('inf').")
    if math.isinf(p):
        total = torch.stack([g.abs().max() if g.numel() else g.new_zeros(())  # an empty unit
                             for g in grads]).max().reshape(1)
        comm.allreduce(total, "max", group=group)
    else:
        total = torch.stack([g.double().norm(p) ** p for g in grads]).sum().reshape(1)
        comm.allreduce(total, "sum", group=group)
        total = total ** (1.0 / p)
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return total.reshape(()).to(grads[0].dtype)
