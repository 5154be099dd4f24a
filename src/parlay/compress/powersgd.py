"""PowerSGD: rank-r gradient compression by one step of power iteration (Vogels et al. 2019).

Each matrix ``M`` (a rank's error-corrected gradient, ``rows x cols``) is sent as two thin
factors over two allreduce rounds::

    P = M Q                       # Q: cols x r, identical on every rank (shared seed / warm start)
    P = allreduce_sum(P)          # round 1 (dense leftovers ride along, see below)
    P^ = orthonormalise(P)        # reduced QR (Householder: stays orthonormal if P is deficient)
    Q_w = M^T P^                  # this rank's share
    Q = allreduce_sum(Q_w)        # round 2
    result = P^ Q^T = sum_w P^ Q_w^T

so each rank contributes exactly ``P^ Q_w^T`` to the sum, and error feedback keeps
``M - P^ Q_w^T`` (on by default; Vogels et al. find it essential). The summed ``Q`` is reused as
the next step's starting ``Q`` (warm start), which makes one power iteration per step track the
top singular subspace over time. An exactly rank-<=r matrix is reproduced without loss.

Which matrices: when the bucket's layout is known (:meth:`set_layout`, called by the
data-parallel optimizer), every tensor with ``ndim >= 2`` becomes ``shape[0] x rest``, as in the
paper; 1-D tensors (biases, norms) and tensors where rank r would not save at least
``min_compression`` times are sent dense in round 1, unchanged. Without a layout (a caller that
only has a flat bucket) the whole bucket is viewed as one near-square ``ceil(sqrt(n))``-row matrix,
zero-padded (PyTorch's "batched" variant: cheaper, usually less accurate); a bucket too small for
that to pay is sent dense. PowerSGD needs its two collective rounds, so it only works through
:func:`parlay.compress.reduce_async` (``point_to_point = False``): not for parameter-server pushes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from parlay.compress.base import Compressor, Round, register, reusable
from parlay.compress.feedback import Residuals, parse_options, seed_for
from parlay.errors import ConfigError

__all__ = ["PowerSGD"]

# Row blocks for the rank-r products. BLAS runs a product with an inner or outer dimension of
# r (4) far below its peak; in blocks whose output stays in cache the same FLOPs take less time
# (figures in docs/benchmarks.md, "Design measurements").
_ROWS_OUT = 16     # decode and residual update: a 16 x cols output block
_ROWS_IN = 512     # P = M Q: 512 rows of M per product


def _mqt(mat: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """``(M Q)^T`` as an ``r x rows`` tensor, from ``qt = Q^T`` (``r x cols``, contiguous)."""
    out = mat.new_empty(qt.shape[0], mat.shape[0])
    for i in range(0, mat.shape[0], _ROWS_IN):
        torch.mm(qt, mat[i: i + _ROWS_IN].t(), out=out[:, i: i + _ROWS_IN])
    return out


def _outer_into(out: torch.Tensor, p: torch.Tensor, qt: torch.Tensor, sub: bool) -> None:
    """``out = p @ qt`` (or ``out -= p @ qt`` with ``sub``), by row blocks."""
    for i in range(0, out.shape[0], _ROWS_OUT):
        if sub:
            out[i: i + _ROWS_OUT].addmm_(p[i: i + _ROWS_OUT], qt, alpha=-1)
        else:
            torch.mm(p[i: i + _ROWS_OUT], qt, out=out[i: i + _ROWS_OUT])


@dataclass(frozen=True)
class _Mat:
    offset: int  # first bucket element
    numel: int   # bucket elements covered (rows * cols, or fewer when zero-padded)
    rows: int
    cols: int


@dataclass(frozen=True)
class _Plan:
    numel: int
    mats: tuple[_Mat, ...]
    dense: tuple[tuple[int, int], ...]  # (offset, numel) ranges sent uncompressed


@dataclass
class _Ctx:
    key: str
    plan: _Plan
    dtype: torch.dtype
    m: torch.Tensor                       # corrected bucket in compute dtype
    stage: str = "P"                      # "P" -> "Q" -> "done"
    mats: list[torch.Tensor] = field(default_factory=list)
    phat: list[torch.Tensor] = field(default_factory=list)
    dense: torch.Tensor | None = None


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start.

    Args:
        rank: Rank ``r`` of the approximation (4 is a good start for MLPs and CNNs).
        error_feedback: Keep ``M - P^ Q_w^T`` per bucket and add it to the next gradient.
        warm_start: Reuse the last summed ``Q`` (else a fresh shared random ``Q`` each step).
        min_compression: Compress a matrix only if rank r saves at least this factor.
        seed: Seed of the initial ``Q`` (shared by all ranks).

    Raises:
        ConfigError: ``rank < 1`` or ``min_compression < 1``.
    """

    name = "powersgd"
    summable = True
    point_to_point = False
    decodes_into = True
    rounds = 2
    cost_fields = ("powersgd_s_per_elem", "powersgd_s_per_elem_rank")
    homogeneous = True  # linear in the bucket: P, Q and the residual scale with it

    def __init__(self, rank: int = 4, error_feedback: bool = True, warm_start: bool = True,
                 min_compression: float = 2.0, seed: int = 0) -> None:
        if isinstance(rank, bool) or int(rank) != rank or int(rank) < 1:
            raise ConfigError(f"PowerSGD rank must be an integer >= 1, got {rank!r}. "
                              "Hint: 'powersgd:4'.")
        if not float(min_compression) >= 1.0:
            raise ConfigError(f"min_compression must be >= 1, got {min_compression!r}.")
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.min_compression = float(min_compression)
        self.seed = int(seed)
        self.memory: Residuals | None = Residuals() if error_feedback else None
        self._layouts: dict[str, list[tuple[int, ...]]] = {}
        self._plans: dict[tuple[str, int], _Plan] = {}
        self._q: dict[str, list[torch.Tensor | None]] = {}
        self._steps: dict[str, int] = {}

    # ------------------------------------------------------------------ planning
    def set_layout(self, key: str, shapes: list[tuple[int, ...]]) -> None:
        self._layouts[key] = [tuple(int(d) for d in s) for s in shapes]
        self._plans = {k: v for k, v in self._plans.items() if k[0] != key}

    def _worth(self, rows: int, cols: int) -> bool:
        r = self.rank
        return r < min(rows, cols) and r * (rows + cols) * self.min_compression <= rows * cols

    def plan(self, key: str, numel: int) -> _Plan:
        """Which parts of bucket ``key`` become matrices and which go dense (cached)."""
        cached = self._plans.get((key, numel))
        if cached is None:
            cached = self._plans[(key, numel)] = self._plan(self._layouts.get(key), numel, key)
        return cached

    def _plan(self, shapes: Sequence[Sequence[int]] | None, numel: int, key: str = "") -> _Plan:
        mats: list[_Mat] = []
        dense: list[tuple[int, int]] = []
        if shapes is not None:
            total = sum(math.prod(s) for s in shapes)
            if total != numel:
                raise ConfigError(f"PowerSGD layout of {key!r} covers {total} elements but the "
                                  f"bucket has {numel}. Hint: call set_layout with the shapes "
                                  "of exactly the tensors in the bucket, in order.")
            off = 0
            for s in shapes:
                n = math.prod(s)
                if len(s) >= 2 and n and self._worth(s[0], n // s[0]):
                    mats.append(_Mat(off, n, s[0], n // s[0]))
                elif n:
                    dense.append((off, n))
                off += n
        elif numel:
            rows = math.isqrt(numel - 1) + 1
            cols = -(-numel // rows)
            if self._worth(rows, cols):
                mats.append(_Mat(0, numel, rows, cols))
            else:
                dense.append((0, numel))
        merged: list[tuple[int, int]] = []
        for o, n in dense:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        return _Plan(numel, tuple(mats), tuple(merged))

    def wire_rounds(self, numel: int, shapes: Sequence[Sequence[int]] | None = None,
                    bytes_per_element: int = 4) -> list[Round]:
        """P (with the dense leftovers), then Q, in the compute dtype (fp32 for fp32 buckets)."""
        shp = [tuple(int(d) for d in s) for s in shapes] if shapes else None
        plan = self._plan(shp, sum(math.prod(s) for s in shp) if shp else int(numel))
        p = sum(m.rows for m in plan.mats) * self.rank + sum(n for _, n in plan.dense)
        q = sum(m.cols for m in plan.mats) * self.rank
        return [Round("allreduce", p * 4)] + ([Round("allreduce", q * 4)] if q else [])

    def codec_s(self, numel: float, world: int, costs: Any) -> float:
        return float(numel * (costs.powersgd_s_per_elem
                              + self.rank * costs.powersgd_s_per_elem_rank))

    def _start_q(self, key: str, i: int, m: _Mat, like: torch.Tensor, step: int) -> torch.Tensor:
        qs = self._q.setdefault(key, [])
        while len(qs) <= i:
            qs.append(None)
        q = qs[i] if self.warm_start else None
        if q is None or q.shape != (m.cols, self.rank):
            g = torch.Generator().manual_seed(seed_for(self.seed, f"{key}#{i}", step))
            q = torch.randn(m.cols, self.rank, generator=g, dtype=torch.float64)
        return q.to(device=like.device, dtype=like.dtype)

    # ------------------------------------------------------------------ the two rounds
    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        if flat.is_complex():  # its real low-rank factors would drop the imaginary part
            raise ConfigError(f"PowerSGD compresses real gradients; bucket {key!r} is "
                              f"{flat.dtype}. Hint: keep complex parameters out of the optimizer "
                              "PowerSGD reduces for, or use compression='fp16' or None.")
        plan = self.plan(key, flat.numel())
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        cdt = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
        g = flat.to(cdt)
        # Without error feedback ``m`` is only read (never written), so no copy is needed.
        m = self.memory.correct(key, g) if self.memory is not None else g
        ctx = _Ctx(key, plan, flat.dtype, m)
        parts = []
        for i, mt in enumerate(plan.mats):
            seg = m[mt.offset: mt.offset + mt.numel]
            if mt.rows * mt.cols == mt.numel:
                mat = seg.view(mt.rows, mt.cols)
            else:  # whole-bucket view, zero-padded to rows x cols
                mat = m.new_zeros(mt.rows * mt.cols)
                mat[: mt.numel] = seg
                mat = mat.view(mt.rows, mt.cols)
            ctx.mats.append(mat)
            # P^T (r x rows, contiguous) is the payload: flattened as is, no transposing copy.
            qt = self._start_q(key, i, mt, m, step).t().contiguous()
            parts.append(_mqt(mat, qt).view(-1))
        parts += [m[o: o + n] for o, n in plan.dense]
        payload = torch.cat(parts) if parts else m.new_zeros(0)
        return [payload], ctx

    def next_round(self, reduced: list[torch.Tensor], ctx: Any) -> list[torch.Tensor] | None:
        plan: _Plan = ctx.plan
        r = self.rank
        if ctx.stage == "P":
            buf = reduced[0]
            n_p = sum(mt.rows * r for mt in plan.mats)
            ctx.dense = buf[n_p:]
            qts, off = [], 0
            for mt, mat in zip(plan.mats, ctx.mats):
                p = buf[off: off + mt.rows * r].view(r, mt.rows).t()
                off += mt.rows * r
                phat = torch.linalg.qr(p, mode="reduced").Q
                ctx.phat.append(phat)
                # Q_w^T = P^T M (r x cols): BLAS streams the row-major M far faster this way.
                qts.append(phat.t() @ mat)
            if self.memory is not None:
                res = ctx.m  # owned by ctx: becomes the residual
                for mt, mat, phat, qt in zip(plan.mats, ctx.mats, ctx.phat, qts):
                    if mat.data_ptr() == res[mt.offset:].data_ptr():  # a view: in place
                        _outer_into(mat, phat, qt, sub=True)
                    else:
                        sent = (phat @ qt).reshape(-1)[: mt.numel]
                        res[mt.offset: mt.offset + mt.numel] -= sent
                for o, n in plan.dense:
                    res[o: o + n] = 0  # sent exactly
                self.memory.keep(ctx.key, res)
            ctx.m, ctx.mats = None, []
            if not plan.mats:
                ctx.stage = "done"
                return None
            ctx.stage = "Q"
            return [torch.cat([qt.reshape(-1) for qt in qts])]
        if ctx.stage == "Q":
            buf, off = reduced[0], 0
            stored = self._q.setdefault(ctx.key, [None] * len(plan.mats))
            for i, mt in enumerate(plan.mats):
                qt = buf[off: off + mt.cols * r].view(r, mt.cols)
                off += mt.cols * r
                norms = qt.norm(dim=1)
                # A zero or non-finite Q column would stall the power iteration: redraw it.
                ok = bool(torch.isfinite(norms).all()) and bool((norms > 0).all())
                # Kept as Q (cols x r) over Q^T's memory: the next step's Q^T is contiguous.
                stored[i] = qt.detach().clone().t() if ok else None
            ctx.stage = "done"
            return None
        return None

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the reduced rounds; into ``out`` (returned) when it fits, see reduce_async."""
        if ctx.stage != "done":
            raise ConfigError("PowerSGD needs its two collective rounds: reduce it with "
                              "parlay.compress.reduce_async, not with compress/decompress "
                              "alone (e.g. parameter-server pushes). Hint: use 'topk', "
                              "'randomk' or 'fp16' there.")
        plan: _Plan = ctx.plan
        dense = ctx.dense
        # The plan's matrices and dense ranges cover every element, so no zero fill.
        if not reusable(out, (plan.numel,), dense.dtype, dense.device):
            out = torch.empty(plan.numel, dtype=dense.dtype, device=dense.device)
        off, r = 0, self.rank
        for mt, phat in zip(plan.mats, ctx.phat):
            qt = payload[0][off: off + mt.cols * r].view(r, mt.cols)
            off += mt.cols * r
            if mt.rows * mt.cols == mt.numel:
                _outer_into(out[mt.offset: mt.offset + mt.numel].view(mt.rows, mt.cols),
                            phat, qt, sub=False)
            else:
                out[mt.offset: mt.offset + mt.numel] = (phat @ qt).reshape(-1)[: mt.numel]
        d = 0
        for o, n in plan.dense:
            out[o: o + n] = dense[d: d + n]
            d += n
        return out.to(ctx.dtype)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"steps": dict(self._steps),
                              "q": {k: list(v) for k, v in self._q.items()}}
        if self.memory is not None:
            sd.update(self.memory.state_dict())
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        q = state.get("q", {})
        if not isinstance(q, dict):
            raise ConfigError(f"PowerSGD state 'q' should map bucket keys to lists of tensors, "
                              f"got {type(q).__name__}.")
        self._q = {str(k): [None if t is None else t.detach().clone() for t in v]
                   for k, v in q.items()}
        self._steps = {str(k): int(v) for k, v in state.get("steps", {}).items()}
        if self.memory is not None:
            self.memory.load_state_dict(state)

    def __repr__(self) -> str:
        extra = "" if self.memory is not None else ", error_feedback=False"
        extra += "" if self.warm_start else ", warm_start=False"  # every option off its
        extra += "" if self.min_compression == 2.0 else \
            f", min_compression={self.min_compression}"  # default: ranks compare reprs
        extra += f", seed={self.seed}" if self.seed else ""
        return f"PowerSGD(rank={self.rank}{extra})"


def _make(*args: str) -> Compressor:
    o = parse_options(args, ["rank"], {"rank": int, "ef": bool, "warm_start": bool,
                                       "min_compression": float, "seed": int}, "powersgd")
    return PowerSGD(rank=o.get("rank", 4), error_feedback=o.get("ef", True),
                    warm_start=o.get("warm_start", True),
                    min_compression=o.get("min_compression", 2.0), seed=o.get("seed", 0))


register("powersgd", _make)
