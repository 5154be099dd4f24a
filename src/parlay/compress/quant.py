"""int8 with a shared scale: a summable compressor at a quarter of fp32's bytes.

Every rank quantises its bucket to int8 with one scale that all ranks share, so the int8
payloads sum exactly on the wire: one allreduce of a byte per element, half fp16's bytes.
The scale comes from a first, tiny round in which every rank gives its bucket's largest
magnitude ``a_r`` and a 1; the sums are ``A = sum(a_r)`` and the group size ``n``. With
``scale = A / (127 - ceil(n / 2))`` each rounded value has ``|q_r| <= a_r / scale + 1/2``, so
no sum can leave int8's range and none wraps. A rank's share of the 255 levels follows its
magnitude: with similar ranks, about ``254 / n`` each (63 on 4 ranks). The rounding error is
fed back into the next bucket of the same key (error feedback, on by default), which is what
keeps so few levels unbiased over steps (1-bit SGD, Seide et al. 2014; SparseLoCo, arXiv
2508.15706, quantises DiLoCo's pseudo-gradients the same way). Groups above 128 ranks, and
non-finite buckets, are sent in their own dtype instead, so the result is exact (or shows the
non-finite value to the caller's policy).

The scale round makes it a two-round compressor like PowerSGD: collectives only
(:func:`~parlay.compress.reduce_async`), not parameter-server pushes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parlay.compress.base import Compressor, Round, register, reusable
from parlay.compress.feedback import Residuals, parse_options
from parlay.errors import ConfigError

__all__ = ["Int8"]

_MAX_GROUP = 128  # above it fewer than 63 levels are left: send full precision instead


@dataclass
class QuantCtx:
    """One bucket's reduction: the (error-corrected) bucket until it is quantised, the
    shared scale once known, and whether it went in full precision instead."""

    dtype: torch.dtype
    key: str
    source: torch.Tensor | None
    scale: float = 0.0
    quantised: bool = False
    fallback: bool = False


class Int8(Compressor):
    """Shared-scale int8 quantisation with error feedback (see the module docstring).

    Args:
        error_feedback: Keep each bucket's rounding error and add it to its next bucket.
    """

    name = "int8"
    summable = True
    point_to_point = False
    decodes_into = True
    rounds = 2
    cost_fields = ("cast_s_per_elem",)

    def __init__(self, error_feedback: bool = True) -> None:
        self.memory: Residuals | None = Residuals() if error_feedback else None

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        src = self.memory.correct(key, flat) if self.memory is not None and \
            flat.is_floating_point() else flat
        one = torch.ones((), dtype=torch.float64, device=src.device)
        amax = src.abs().max().double() if src.numel() else one - 1
        return [torch.stack([amax, one])], QuantCtx(flat.dtype, key, src)

    def next_round(self, reduced: list[torch.Tensor], ctx: Any) -> list[torch.Tensor] | None:
        if ctx.quantised or ctx.fallback:
            return None
        src, ctx.source = ctx.source, None
        assert src is not None
        total, n = float(reduced[0][0]), int(round(float(reduced[0][1])))
        if not math.isfinite(total) or n > _MAX_GROUP or not src.is_floating_point():
            ctx.fallback = True
            if self.memory is not None and src.is_floating_point():
                self.memory.clear(ctx.key)  # sent exactly: nothing is owed
            return [src.clone()]
        ctx.quantised = True
        ctx.scale = total / (127 - math.ceil(n / 2))
        q = (src / ctx.scale).round_() if ctx.scale > 0 else torch.zeros_like(src)
        q = q.to(torch.int8)
        if self.memory is not None:
            self.memory.keep(ctx.key, src - q.to(src.dtype) * ctx.scale)
        return [q]

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        if not (ctx.quantised or ctx.fallback):
            raise ConfigError("int8 needs its two collective rounds (the shared scale, then the "
                              "values): reduce it with parlay.compress.reduce_async, not with "
                              "compress/decompress alone (e.g. parameter-server pushes). Hint: "
                              "use 'fp16', 'bf16' or 'topk' there.")
        t = payload[0]
        out = out.copy_(t) if reusable(out, t.shape, ctx.dtype, t.device) else t.to(ctx.dtype)
        return out.mul_(ctx.scale) if ctx.quantised else out

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4, *, world: int = 2) -> list[Round]:
        """The scale round, then a byte an element, or the bucket as it is above 128 ranks."""
        per = bytes_per_element if world > _MAX_GROUP else 1
        return [Round("allreduce", 16), Round("allreduce", numel * per)]

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        return 0.0 if world > _MAX_GROUP else float(numel * costs.cast_s_per_elem)

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()} if self.memory is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.memory is not None:
            self.memory.load_state_dict(state.get("memory", {}))

    def __repr__(self) -> str:
        return "Int8()" if self.memory is not None else "Int8(ef=False)"


def _make_int8(*args: str) -> Compressor:
    return Int8(error_feedback=parse_options(args, [], {"ef": bool}, "int8").get("ef", True))


register("int8", _make_int8)
