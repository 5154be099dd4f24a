"""Casting compressors: fp16 (with an overflow-safe dynamic scale) and bf16.

Both halve the bytes of an fp32 bucket and stay summable, so the wire reduction is one
allreduce in the narrow type (gloo and NCCL sum fp16/bf16 natively).

fp16 has a narrow range (largest finite 65504, smallest normal 6.1e-5), so the bucket is
multiplied by a power-of-two scale before the cast, like dynamic loss scaling (Micikevicius et
al. 2018) applied to communication. The scale is per bucket and is derived from the previous
*reduced* result, which is identical on every rank, so every rank always uses the same scale and
the fp16 sum stays decodable; no extra message is needed to agree on it. The target puts the
summed bucket's largest magnitude at 2**10, a factor 64 below the fp16 limit: room for partial
sums and for gradient spikes between steps (less headroom made MNIST training retry steps often;
see docs/benchmarks.md, "Design measurements"), while entries down to 2**-24 of the largest
still stay normal numbers. If a sum still overflows (first step, a gradient spike, or genuinely
non-finite gradients), every rank sees the ``inf`` in the same reduced tensor and the bucket is
re-sent in its own dtype in a second round, so an overflow never reaches the gradient; the scale
is then recomputed. Multiplying by a power of two is exact, so scaling adds no rounding error.
bf16 has fp32's exponent range and needs no scale.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parlay.compress.base import Compressor, Round, register, reusable
from parlay.compress.feedback import parse_options
from parlay.errors import ConfigError

__all__ = ["FP16", "BF16"]

_TARGET_EXP = 10  # scaled |max| of the reduced bucket aims at 2**10 (65504 ~ 2**16)
_MIN_EXP, _MAX_EXP = -24, 40


@dataclass
class CastCtx:
    """What decoding needs: the original dtype and the scale applied before the cast."""

    dtype: torch.dtype
    scale: float = 1.0
    key: str = ""
    fallback: bool = False
    source: torch.Tensor | None = None  # the bucket, kept only for an overflow retry

    def __getstate__(self) -> dict[str, Any]:
        # A receiver (parameter server) needs dtype and scale, never the sender's bucket.
        return {**self.__dict__, "source": None}


def _widen(t: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """``t`` as ``dtype``: into ``out`` when it fits (the bucket itself, see
    :func:`~parlay.compress.reduce_async`), else a new tensor."""
    if reusable(out, t.shape, dtype, t.device):
        return out.copy_(t)
    return t.to(dtype, copy=True)


class _Cast(Compressor):
    """What both casts share: one 16-bit allreduce, a per-element cast cost, their context."""

    summable = True
    decodes_into = True
    cost_fields = ("cast_s_per_elem",)
    wire_dtype: torch.dtype = torch.bfloat16

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4) -> list[Round]:
        return [Round("allreduce", numel * 2, half=True)]

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        return float(numel * costs.cast_s_per_elem)

    def shard_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return self.wire_dtype if dtype.is_floating_point else dtype

    def ctx_to_wire(self, ctx: Any) -> tuple[Any, ...]:
        return (ctx.dtype, ctx.scale, ctx.fallback)

    def ctx_from_wire(self, values: tuple[Any, ...]) -> Any:
        dtype, scale, fallback = values[:3]
        return CastCtx(dtype, scale, fallback=fallback)


class BF16(_Cast):
    """Cast to bfloat16 on the wire (relative error <= 2**-8 per element, before the sum)."""

    name = "bf16"
    wire_dtype = torch.bfloat16

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        if not flat.is_floating_point():
            return [flat.clone()], CastCtx(flat.dtype)
        return [flat.to(self.wire_dtype, copy=True)], CastCtx(flat.dtype)

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        return _widen(payload[0], ctx.dtype, out)

    def __repr__(self) -> str:
        return "BF16()"


class FP16(_Cast):
    """Cast to float16 with a shared power-of-two scale per bucket (see the module docstring).

    Args:
        init_scale: Scale of the first step of each bucket (a power of two; 1.0 is Horovod's
            plain cast). Later steps derive it from the reduced result.
        dynamic: Adapt the scale from each reduced result (False: keep ``init_scale``; an
            overflow still falls back to a full-precision round).
    """

    name = "fp16"
    wire_dtype = torch.float16

    def __init__(self, init_scale: float = 1.0, dynamic: bool = True) -> None:
        scale = float(init_scale)
        if not (math.isfinite(scale) and scale > 0 and math.frexp(scale)[0] == 0.5):
            raise ConfigError(f"fp16 init_scale must be a power of two (exact to scale and "
                              f"unscale), got {init_scale!r}. Hint: fp16:1 (a plain cast) or "
                              "fp16:1024.")
        self.init_scale = scale
        self.dynamic = bool(dynamic)
        self._scale: dict[str, float] = {}
        self.retries = 0  # overflow retries so far (a full-precision second round each)

    def scale(self, key: str) -> float:
        """The scale the next compress of bucket ``key`` will use."""
        return self._scale.get(key, self.init_scale)

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        if not flat.is_floating_point():
            return [flat.clone()], CastCtx(flat.dtype, key=key, source=flat)
        s = self.scale(key)
        scaled = flat * s if s != 1.0 else flat
        return [scaled.to(torch.float16, copy=True)], CastCtx(flat.dtype, s, key, source=flat)

    def next_round(self, reduced: list[torch.Tensor], ctx: Any) -> list[torch.Tensor] | None:
        if not isinstance(ctx, CastCtx) or ctx.source is None or not ctx.source.is_floating_point():
            return None
        red = reduced[0]
        if ctx.fallback:
            amax = red.abs().max().item() if red.numel() else 0.0
            if math.isfinite(amax):
                self._update(ctx.key, amax, 1.0)
            elif self.dynamic:  # the gradients themselves were not finite (a loss-scale
                self._scale[ctx.key] = ctx.scale  # overflow): not the scale's fault, keep it
            ctx.source = None
            return None
        amax = red.abs().max().float().item() if red.numel() else 0.0
        if math.isfinite(amax):
            self._update(ctx.key, amax, ctx.scale)
            ctx.source = None
            return None
        # Overflow (or non-finite gradients): every rank sees it in the same reduced tensor,
        # so all of them resend the bucket at full precision in the same round.
        self.retries += 1
        ctx.fallback = True
        if self.dynamic:
            self._scale[ctx.key] = max(2.0 ** _MIN_EXP, ctx.scale / 2 ** 8)
        return [ctx.source.clone()]

    def _update(self, key: str, amax_scaled: float, scale: float) -> None:
        if not self.dynamic or not math.isfinite(amax_scaled):
            return
        if amax_scaled <= 0:  # nothing survived the cast: every |scaled value| < 2**-25 (or
            # all zero), so 2**(TARGET+25) more brings the largest to the target at most
            self._scale[key] = min(2.0 ** _MAX_EXP, scale * 2.0 ** (_TARGET_EXP + 25))
            return
        amax = amax_scaled / scale
        exp = _TARGET_EXP - math.frexp(amax)[1]
        self._scale[key] = 2.0 ** min(_MAX_EXP, max(_MIN_EXP, exp))

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        t = payload[0]
        out = _widen(t, ctx.dtype, out)  # (an overflow's retry has been sent by now)
        if ctx.fallback or t.dtype != torch.float16:
            return out
        return out.mul_(1.0 / ctx.scale) if ctx.scale != 1.0 else out

    def state_dict(self) -> dict[str, Any]:
        return {"scale": dict(self._scale)} if self._scale else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = {str(k): float(v) for k, v in state.get("scale", {}).items()}

    def __repr__(self) -> str:
        scale = "" if self.init_scale == 1.0 else f"init_scale={self.init_scale:g}"
        return f"FP16({scale}{', ' if scale and not self.dynamic else ''}" \
            f"{'' if self.dynamic else 'dynamic=False'})"


def _make_fp16(*args: str) -> Compressor:
    o = parse_options(args, ["init_scale"], {"init_scale": float, "dynamic": bool}, "fp16")
    return FP16(**o)


register("fp16", _make_fp16)
register("bf16", BF16)
