"""Sparsifiers: top-k (largest magnitudes, over allgather) and random-k (shared seed, allreduce).

Both keep an error-feedback residual per bucket by default (:mod:`parlay.compress.feedback`):
the coordinates not sent this step are carried to the next, so nothing a rank produced is lost,
only delayed. Options (also in registry strings, e.g. ``"topk:0.01,momentum=0.9,warmup=500"``):

* ``ratio``: density, the fraction of coordinates sent; ``k = max(1, floor(ratio * numel))``.
* ``error_feedback`` (``ef``): keep residuals (default on).
* ``momentum``: DGC momentum correction (Lin et al. 2018); use with optimizer momentum off.
  ``masking`` (default on): DGC's momentum factor masking.
* ``sample`` (top-k only, default 0: exact): DGC's sampled threshold, e.g.
  ``"topk:0.01,sample=0.01"``: the threshold is estimated from that fraction of the bucket and
  at most ``k`` coordinates above it are sent (a few fewer some steps; the payload keeps ``k``
  slots, zero-padded). Exact top-k already prefilters with a sampled threshold, so this saves
  little CPU over it; the exact path stays the default.
* ``warmup_steps`` (``warmup``) and ``warmup_start``: DGC density warm-up, the density decays
  exponentially from ``warmup_start`` to ``ratio`` over the first ``warmup_steps`` steps of
  each bucket. Wire bytes are measured, so the warm-up's cost shows in ``comm_stats()``.

Top-k's payload is ``[values, indices]`` (int32 indices while ``numel < 2**31``, so 8 bytes per
fp32 coordinate), or with ``compact=1`` one ``uint8`` tensor of 4 bytes per coordinate (bfloat16
values, 16-bit offsets within 65536-coordinate blocks, an int32 count per block); ranks choose
different coordinates, so payloads are allgathered and summed locally. Random-k's payload is
``[values]`` only: the indices come from a generator seeded with ``(seed, key, step)``, and the
per-bucket step counter advances once per ``compress`` call, which every rank makes in the same
order, so all ranks pick the same coordinates and one allreduce of the values is the exact sum.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parlay.compress.base import Compressor, Round, register, reusable
from parlay.compress.feedback import Residuals, finite, parse_options, seed_for, warmup_density
from parlay.compress.sparsewire import compact_bytes, pack_compact, unpack_compact
from parlay.compress.topsel import exact_topk, magnitude_topk
from parlay.errors import ConfigError

__all__ = ["TopK", "RandomK", "SparseCtx", "random_indices", "exact_topk", "magnitude_topk"]

_INT32_LIMIT = 2 ** 31


@dataclass(frozen=True)
class SparseCtx:
    """What decoding needs: bucket size and dtype, ``k``, and random-k's index seed."""

    numel: int
    dtype: torch.dtype
    k: int
    seed: int = -1


def random_indices(numel: int, k: int, seed: int) -> torch.Tensor:
    """``k`` distinct indices in ``[0, numel)``, uniformly at random, sorted; a pure function
    of its arguments (CPU generator), so every process computes the same ones."""
    g = torch.Generator().manual_seed(int(seed))
    if k * 4 >= numel:
        return torch.randperm(numel, generator=g)[:k].sort().values
    # Sparse case: the first k distinct values of an i.i.d. uniform stream form a uniform
    # k-subset; drawing ~k candidates is far cheaper than permuting all numel indices.
    chosen = torch.empty(0, dtype=torch.long)
    while chosen.numel() < k:
        need = k - chosen.numel()
        stream = torch.cat([chosen, torch.randint(numel, (need + need // 8 + 16,), generator=g)])
        uniq, inv = torch.unique(stream, return_inverse=True)
        first = torch.full((uniq.numel(),), stream.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inv, torch.arange(stream.numel()), reduce="amin")
        chosen = stream[first.sort().values]  # distinct, in order of first appearance
    return chosen[:k].sort().values


class _Sparsifier(Compressor):
    """Shared machinery: density schedule, per-bucket step counter, error feedback."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, momentum: float = 0.0,
                 warmup_steps: int = 0, warmup_start: float = 0.25, masking: bool = True) -> None:
        if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise ConfigError(f"{self.name} ratio must be in (0, 1] (the fraction of "
                              f"coordinates sent), got {ratio!r}. Hint: 0.01 sends 1%.")
        if int(warmup_steps) < 0 or not 0.0 < float(warmup_start) <= 1.0:
            raise ConfigError(f"{self.name} warm-up needs warmup_steps >= 0 and warmup_start in "
                              f"(0, 1], got {warmup_steps!r} and {warmup_start!r}.")
        if momentum and not error_feedback:
            raise ConfigError("momentum correction needs error feedback (it lives in the "
                              "residual). Hint: keep error_feedback=True.")
        self.ratio = float(ratio)
        self.warmup_steps = int(warmup_steps)
        self.warmup_start = float(warmup_start)
        self.memory: Residuals | None = Residuals(momentum, masking) if error_feedback else None
        self._steps: dict[str, int] = {}

    @property
    def error_feedback(self) -> bool:
        """Whether this compressor keeps residuals itself."""
        return self.memory is not None

    def density(self, key: str) -> float:
        """Density the next compress of bucket ``key`` will use (after warm-up: ``ratio``)."""
        return warmup_density(self._steps.get(key, 0), self.ratio, self.warmup_steps,
                              self.warmup_start)

    @staticmethod
    def k_for(numel: int, density: float) -> int:
        """Number of coordinates sent for a bucket of ``numel`` at ``density``."""
        return min(numel, max(1, int(density * numel)))

    def _indices(self, x: torch.Tensor, k: int, key: str, step: int) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def ctx_to_wire(self, ctx: Any) -> tuple[Any, ...]:
        return (ctx.numel, ctx.dtype, ctx.k, ctx.seed)

    def ctx_from_wire(self, values: tuple[Any, ...]) -> Any:
        return SparseCtx(*values[:4])

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        step = self._steps.get(key, 0)
        k = self.k_for(flat.numel(), self.density(key))
        self._steps[key] = step + 1
        x = self.memory.correct(key, flat) if self.memory is not None else flat
        idx, seed = self._indices(x, k, key, step)
        # A non-finite coordinate the selection passed over (a threshold drops NaN, random-k
        # may not draw it) still reaches the sum, where the non-finite checks see it.
        values = torch.where(finite(x), x.index_select(0, idx), float("nan"))
        sent = self._rounded(values)  # what the receivers will add (values, or values rounded)
        if self.memory is not None:
            mask = None
            if self.memory.momentum and self.memory.masking:
                mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
                mask.index_fill_(0, idx, True)
            # x is ours (never the caller's bucket): what was not sent is exactly the residual
            if sent is values:
                x.index_fill_(0, idx, 0)
            else:
                x.index_copy_(0, idx, values - sent)
            self.memory.keep(key, x, mask)
        ctx = SparseCtx(flat.numel(), flat.dtype, k, seed)
        return self._payload(values, idx, flat.numel(), k), ctx

    def _payload(self, values: torch.Tensor, idx: torch.Tensor, numel: int,
                 k: int | None = None) -> list[torch.Tensor]:
        raise NotImplementedError

    def _rounded(self, values: torch.Tensor) -> torch.Tensor:
        """The values as the receivers will get them (``values`` itself when sent exactly)."""
        return values

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"steps": dict(self._steps)}
        if self.memory is not None:
            sd.update(self.memory.state_dict())
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = state.get("steps", {})
        if not isinstance(steps, dict):
            raise ConfigError(f"{self.name} state 'steps' should be a dict, got "
                              f"{type(steps).__name__}.")
        self._steps = {str(k): int(v) for k, v in steps.items()}
        if self.memory is not None:
            self.memory.load_state_dict(state)

    def __repr__(self) -> str:
        extra = "" if self.memory is not None else ", error_feedback=False"
        if self.memory is not None and self.memory.momentum:
            extra += f", momentum={self.memory.momentum}"
        if self.memory is not None and not self.memory.masking:
            extra += ", masking=False"
        if self.warmup_steps:
            extra += f", warmup_steps={self.warmup_steps}"
        if self.warmup_start != 0.25:  # every option off its default: ranks compare reprs
            extra += f", warmup_start={self.warmup_start}"
        return f"{type(self).__name__}(ratio={self.ratio}{extra})"


class TopK(_Sparsifier):
    """Send the ``k`` largest-magnitude coordinates (exactly ``k``), as values + indices.

    Not summable: payloads are allgathered and every rank adds them into a dense bucket.

    Args:
        ratio: Fraction of coordinates sent.
        sample: 0 (default): exact top-k. A fraction in (0, 1] (e.g. 0.01): DGC's sampled
            threshold (:func:`magnitude_topk`): at most ``k`` coordinates, the largest among
            those above a threshold estimated from that fraction of the bucket, so a step may
            send a few fewer than ``k`` (the payload is padded with zeros to keep its size).
            Unsent coordinates stay in the residual either way. Buckets under 65536 elements
            (or denser than 1/32) are always exact.
        compact: Half the bytes (default off): 4 per coordinate instead of 8. The values
            travel as bfloat16 and the indices as 16-bit offsets within blocks of 65536
            coordinates (plus one int32 count per block), in one ``uint8`` payload. Needs error
            feedback: what rounding to bfloat16 takes off a value stays in the residual and is
            sent later, so nothing is lost, only delayed (as with the coordinates not sent).
        **kwargs: ``error_feedback``, ``momentum``, ``warmup_steps``, ``warmup_start``,
            ``masking``.

    Raises:
        ConfigError: ``sample`` outside ``[0, 1]``; ``compact`` without error feedback.
    """

    name = "topk"
    summable = False
    shared_ctx = True
    decodes_into = True
    cost_fields = ("topk_s_per_elem", "scatter_s_per_elem")

    def __init__(self, ratio: float = 0.01, sample: float = 0.0, compact: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(ratio, **kwargs)
        if isinstance(sample, bool) or not 0.0 <= float(sample) <= 1.0:
            raise ConfigError(f"topk sample must be a fraction in [0, 1] (0: exact top-k), got "
                              f"{sample!r}. Hint: 'topk:0.01,sample=0.01' as in DGC.")
        if compact and self.memory is None:
            raise ConfigError("topk compact=1 rounds the values it sends to bfloat16 and needs "
                              "error feedback to carry what rounding takes off. Hint: keep "
                              "ef=1, or drop compact.")
        self.sample = float(sample)
        self.compact = bool(compact)

    def _indices(self, x: torch.Tensor, k: int, key: str, step: int) -> tuple[torch.Tensor, int]:
        return magnitude_topk(x, k, self.sample, seed=step), -1

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4) -> list[Round]:
        k = self.k_for(numel, self.ratio)
        if self.compact:
            return [Round("allgather", compact_bytes(numel, k))]
        return [Round("allgather", k * (bytes_per_element + (4 if numel < _INT32_LIMIT else 8)))]

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        k = max(1.0, self.ratio * numel)  # every rank's k values are added into the bucket
        return float(numel * costs.topk_s_per_elem + world * k * costs.scatter_s_per_elem)

    def _rounded(self, values: torch.Tensor) -> torch.Tensor:
        if not self.compact:
            return values
        return values.to(torch.bfloat16).to(values.dtype)

    def _payload(self, values: torch.Tensor, idx: torch.Tensor, numel: int,
                 k: int | None = None) -> list[torch.Tensor]:
        if self.compact:
            return [pack_compact(values, idx, numel, values.numel() if k is None else k)]
        idx = idx.to(torch.int32 if numel < _INT32_LIMIT else torch.int64)
        if k is not None and values.numel() < k:  # sampled: every payload needs k slots
            pad = k - values.numel()
            values = torch.cat([values, values.new_zeros(pad)])
            idx = torch.cat([idx, idx.new_zeros(pad)])  # adds 0 to coordinate 0: no change
        return [values, idx]

    def __repr__(self) -> str:
        r = super().__repr__()
        r = r[:-1] + f", sample={self.sample})" if self.sample else r
        return r[:-1] + ", compact=True)" if self.compact else r

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        return self.aggregate([payload], ctx, out)

    def aggregate(self, payloads: list[list[torch.Tensor]], ctx: Any,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of every rank's payload; into ``out`` (returned) when it fits, see
        :func:`~parlay.compress.reduce_async`."""
        device = payloads[0][0].device
        # memory already touched: zeroing it is far cheaper than a fresh torch.zeros
        out = out.zero_() if reusable(out, (ctx.numel,), ctx.dtype, device) else \
            torch.zeros(ctx.numel, dtype=ctx.dtype, device=device)
        for payload in payloads:  # rank order: the same summation order on every rank
            # indices are distinct within a payload (padding adds 0.0): order-independent
            values, idx = (unpack_compact(payload[0], ctx.numel, ctx.k) if len(payload) == 1
                           else payload)  # one tensor: the compact wire; two: values, indices
            out.scatter_add_(0, idx.long(), values.to(ctx.dtype))
        return out


class RandomK(_Sparsifier):
    """Send ``k`` coordinates chosen at random with a seed shared by all ranks (allreduce).

    Args:
        ratio: Fraction of coordinates sent.
        seed: Base seed; indices depend on ``(seed, bucket key, step)`` only.
        **kwargs: ``error_feedback``, ``momentum``, ``warmup_steps``, ``warmup_start``,
            ``masking``.
    """

    name = "randomk"
    summable = True
    decodes_into = True
    cost_fields = ("randomk_s_per_elem",)

    def __init__(self, ratio: float = 0.01, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(ratio, **kwargs)
        self.seed = int(seed)
        self._cache: OrderedDict[tuple[int, int, int, str], torch.Tensor] = OrderedDict()

    def indices(self, numel: int, k: int, seed: int, device: Any = "cpu") -> torch.Tensor:
        """The coordinates for ``(numel, k, seed)`` (cached; identical on every rank)."""
        ck = (numel, k, seed, str(device))
        idx = self._cache.get(ck)
        if idx is None:
            idx = random_indices(numel, k, seed).to(device)
            self._cache[ck] = idx
            while len(self._cache) > 16:
                self._cache.popitem(last=False)
        return idx

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4) -> list[Round]:
        return [Round("allreduce", self.k_for(numel, self.ratio) * bytes_per_element)]

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        return float(numel * costs.randomk_s_per_elem)

    def _indices(self, x: torch.Tensor, k: int, key: str, step: int) -> tuple[torch.Tensor, int]:
        seed = seed_for(self.seed, key, step)
        return self.indices(x.numel(), k, seed, x.device), seed

    def _payload(self, values: torch.Tensor, idx: torch.Tensor, numel: int,
                 k: int | None = None) -> list[torch.Tensor]:
        return [values]

    def __repr__(self) -> str:
        r = super().__repr__()
        return r[:-1] + f", seed={self.seed})" if self.seed else r

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The summed values at their coordinates; into ``out`` (returned) when it fits (the
        bucket itself, see :func:`~parlay.compress.reduce_async`: no fresh bucket-sized
        allocation and copy per step)."""
        values = payload[0]
        out = out.zero_() if reusable(out, (ctx.numel,), ctx.dtype, values.device) else \
            torch.zeros(ctx.numel, dtype=ctx.dtype, device=values.device)
        return out.index_add_(0, self.indices(ctx.numel, ctx.k, ctx.seed, values.device),
                              values.to(ctx.dtype))


_TYPES: dict[str, type] = {"ratio": float, "ef": bool, "momentum": float, "warmup": int,
                           "warmup_start": float, "masking": bool}


def _factory(cls: type[_Sparsifier], extra: dict[str, type]) -> Callable[..., Compressor]:
    def make(*args: str) -> Compressor:
        o = parse_options(args, ["ratio"], {**_TYPES, **extra}, cls.name)
        kw: dict[str, Any] = {"ratio": o.pop("ratio", 0.01),
                              "error_feedback": o.pop("ef", True),
                              "momentum": o.pop("momentum", 0.0),
                              "warmup_steps": o.pop("warmup", 0),
                              "warmup_start": o.pop("warmup_start", 0.25),
                              "masking": o.pop("masking", True)}
        return cls(**kw, **o)
    return make


register("topk", _factory(TopK, {"sample": float, "compact": bool}))
register("randomk", _factory(RandomK, {"seed": int}))
