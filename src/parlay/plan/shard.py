"""Sharded data parallel's levels priced (``DistributedOptimizer(shard=...)``, ZeRO 1-3).

For ``N`` data-parallel ranks (one flat ring), ``S`` the parameters' bytes, ``P = G = S`` the
parameters and gradients a rank holds, ``K`` optimizer state elements per parameter
element (:func:`state_per_param` measures it):

========== ===================================== ==================== ===================
level      wire per rank per step (ring)          memory per rank      transient included
========== ===================================== ==================== ===================
none (DDP) allreduce ``2(N-1)/N S``                ``P + G + KP``
optimizer  reduce-scatter + all-gather: as DDP    ``P + G + KP/N``
gradients  reduce-scatter + all-gather: as DDP    ``P + (G + KP)/N``
parameters all-gather x2 + reduce-scatter: 1.5x   ``(P + G + KP)/N``   4 x the largest unit
           (less for few units, below)
========== ===================================== ==================== ===================

An element-wise 16-bit compressor (``fp16``, ``bf16``) halves the reduce-scatter (the
gradients) only; parameters are all-gathered in their own dtype. The ``"parameters"``
transient is the units gathered (the one in use and those prefetched) and the full gradient
buckets awaiting their reduce-scatter (two at most), 4 units at their measured peak; a unit is
a module (``--layers``: ``S / layers``; a profiled script: its largest parameter tensor) or
else a 25 MiB bucket. Activations, buffers and the framework's
own memory are not counted. Backward's first two units are still gathered from forward, so
``"parameters"`` all-gathers ``(U-2)/U`` of the model again in backward (``U`` units): 1.25x DDP
for 4 units, towards 1.5x for many.

Step time reuses the flat ring's pricing (:func:`parlay.plan.modes.allreduce_terms`): the
reduce-scatter and the all-gather each cost half an allreduce of their bytes and, like DDP's
buckets, hide behind backward; ``"parameters"``' extra all-gather in forward is prefetched one
unit ahead, so it hides behind forward the same way.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any

from parlay.errors import ConfigError
from parlay.plan.model import (DEFAULT_BUCKET_BYTES, ClusterSpec, Costs, Workload, compressor_of,
                               link_bytes, rounds_s)
from parlay.plan.modes import FORWARD_SHARE, allreduce_terms, exposed

__all__ = ["LEVELS", "ShardLevel", "state_per_param", "shard_levels", "recommend_shard"]

LEVELS = ("none", "optimizer", "gradients", "parameters")


@dataclass(frozen=True)
class ShardLevel:
    """One level: bytes a rank holds and sends per step, and the step's terms (seconds);
    ``memory_bytes`` is ``fixed + shared / N`` on ``N > 1`` ranks (``fixed``: the bytes every
    rank holds whatever ``N``, the transient included; 1 rank has no transient)."""

    level: str
    memory_bytes: float
    wire_bytes: float
    terms: dict[str, float]
    fixed: float = 0.0
    shared: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())


def state_per_param(spec: str) -> float:
    """Optimizer state elements per parameter element (``K``), measured: the ``torch.optim``
    class ``spec`` names (``"adam"``, ``"sgd:momentum=0.9"``) steps a 256 x 256 matrix once and
    its state tensors with ``dim > 0`` are counted (Adam's scalar ``step`` is not; Adafactor's
    factored row and column statistics are ``2/256`` of the matrix).

    Raises:
        ConfigError: An unknown optimizer or options it refuses.
    """
    import torch

    name, _, opts = str(spec).strip().partition(":")
    classes = {k.lower(): v for k, v in vars(torch.optim).items()
               if isinstance(v, type) and issubclass(v, torch.optim.Optimizer)
               and v is not torch.optim.Optimizer}
    hint = "Hint: --optimizer adam (or sgd, sgd:momentum=0.9, adamw, adagrad, rmsprop)."
    if name.lower() not in classes:
        raise ConfigError(f"--optimizer: unknown {name!r}; torch.optim has "
                          f"{', '.join(sorted(classes))}. {hint}")
    kwargs: dict[str, Any] = {}
    for kv in (kv.strip() for kv in opts.split(",") if kv.strip()):
        key, _, value = kv.partition("=")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise ConfigError(f"--optimizer {spec!r}: {kv!r} is not name=value with a number, "
                              f"True or False as the value. {hint}") from None
    try:  # a matrix, where the parameters are: factored state (adafactor) is priced right
        p = torch.nn.Parameter(torch.zeros(256, 256))
        p.grad = torch.ones(256, 256)
        opt = classes[name.lower()]([p], **kwargs)
        opt.step()
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise ConfigError(f"--optimizer {spec!r}: {e}. {hint}") from None
    return sum(t.numel() for t in opt.state[p].values()
               if torch.is_tensor(t) and t.dim() > 0) / p.numel()


def _unit_bytes(w: Workload) -> float:
    if w.shapes:
        return max(math.prod(s) for s in w.shapes) * w.bytes_per_element
    if w.layers:
        return w.grad_bytes / w.layers
    return min(w.grad_bytes, DEFAULT_BUCKET_BYTES)


def shard_levels(w: Workload, c: ClusterSpec, k: float, compressor: str = "none",
                 costs: Costs | None = None) -> list[ShardLevel]:
    """Every level of :data:`LEVELS` for ``w`` on ``c.world`` ranks with ``k`` optimizer state
    elements per parameter element (see the module docstring for what is counted).

    Raises:
        ConfigError: A compressor that is not element-wise (sharding cannot reduce-scatter it).
    """
    import torch

    costs = costs or Costs()
    comp = compressor_of(compressor)
    if comp.shard_dtype(torch.float32) is None:
        raise ConfigError(f"sharded levels reduce-scatter element by element; {comp!r} is not "
                          "element-wise. Hint: --compressors none (or fp16, bf16).")
    n, s = c.world, w.grad_bytes
    link = c.inter if c.nodes > 1 else c.local
    units = max(1, math.ceil(s / _unit_bytes(w)))
    buckets = max(1, math.ceil(s / DEFAULT_BUCKET_BYTES))
    backward, forward = w.compute_s * (1 - FORWARD_SHARE), w.compute_s * FORWARD_SHARE

    def ring_s(spec: str, msgs: int) -> float:  # one allreduce of the gradients, priced
        return rounds_s(compressor_of(spec).wire_rounds(int(w.params), w.layout,
                                                        w.bytes_per_element),
                        n, link, costs, messages=msgs, rested_s=w.compute_s)

    ddp = allreduce_terms(w, c, compressor, costs)
    rs_b, ag_b = link_bytes(comp, w.params, n, w.layout) / 2, link_bytes("none", w.params, n) / 2
    rs_s, ag_s = ring_s(compressor, buckets) / 2, ring_s("none", buckets) / 2
    p = g = s
    split = {"none": (p + g + k * p, 0.0), "optimizer": (p + g, g + k * p),  # + its gradient
             "gradients": (p, g + k * p), "parameters": (4 * _unit_bytes(w), p + g + k * p)}
    mem = {lv: (f if n > 1 or lv != "parameters" else 0.0) + sh / n  # 1 rank: no transient
           for lv, (f, sh) in split.items()}
    out = [ShardLevel("none", mem["none"], 2 * rs_b, ddp, *split["none"])]
    again = max(0, units - 2) / units  # "parameters": backward re-gathers all but two units
    for level in LEVELS[1:]:
        terms = dict(ddp)
        ag = again if level == "parameters" else 1.0
        terms["comm"] = exposed(rs_s + ag * ag_s, backward, buckets, c.overlap)
        wire = rs_b + ag * ag_b
        if level == "parameters":
            terms["comm-forward"] = exposed(ring_s("none", units) / 2, forward, units, c.overlap)
            wire += ag_b
        out.append(ShardLevel(level, mem[level], wire, terms, *split[level]))
    return out


def recommend_shard(levels: list[ShardLevel], memory_per_rank: float, world: int) -> str:
    """The lowest level whose memory fits ``memory_per_rank``, or the line saying none does
    (with the ranks ``"parameters"`` would need)."""
    from parlay.plan.units import format_bytes

    fit = next((lv for lv in levels if lv.memory_bytes <= memory_per_rank), None)
    if fit is not None and fit.level == "none":
        return f"shard: none needed, DDP fits ({format_bytes(fit.memory_bytes)} per rank)"
    if fit is not None:
        return (f"shard: {fit.level!r} ({format_bytes(fit.memory_bytes)} per rank; DDP needs "
                f"{format_bytes(levels[0].memory_bytes)}): DistributedOptimizer(..., "
                f"shard={fit.level!r})")
    last = levels[-1]
    # fixed + shared / N <= limit: the fewest ranks that would make a level fit
    need = min((max(2, math.ceil(lv.shared / (memory_per_rank - lv.fixed))) for lv in levels
                if lv.shared and memory_per_rank > lv.fixed), default=None)
    more = f"{need} ranks or more" if need else "more memory per rank (one unit is too big)"
    return (f"shard: error: nothing fits {format_bytes(memory_per_rank)} per rank: even "
            f"'parameters' needs {format_bytes(last.memory_bytes)} on {world} ranks. Hint: "
            f"{more}.")


def shard_doc(levels: list[ShardLevel], k: float, memory_per_rank: float | None,
              world: int) -> dict[str, Any]:
    """The levels as ``parlay plan --json`` gives them."""
    fits = {lv.level: memory_per_rank is None or lv.memory_bytes <= memory_per_rank
            for lv in levels}
    return {"ranks": world, "state_per_param": k, "memory_per_rank": memory_per_rank,
            "recommendation": None if memory_per_rank is None else
            next((lv.level for lv in levels if fits[lv.level]), None),
            "levels": [{"level": lv.level, "memory_bytes": lv.memory_bytes,
                        "wire_bytes": lv.wire_bytes, "step_s": lv.step_s, "terms": lv.terms,
                        "fits": fits[lv.level] if memory_per_rank is not None else None}
                       for lv in levels]}
