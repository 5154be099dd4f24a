"""Running negotiated operations: checks, fusion and the data movement on a group.

Every rank calls :func:`run_ready` with the same batch (names, every rank's descriptor) and so
takes the same decisions: which operations fail (descriptors disagree), which allreduces are
fused into one buffer, and in which order collectives are issued. Only the tensors differ; a
rank that joined (see ``hvd.join``) has no request and contributes zeros to allreduces.

Pure data movement (allgather, broadcast, alltoall) travels as bytes, so every dtype works on
every backend (gloo has no int16, for example). Scaling follows Horovod: integers are scaled in
float64 and truncated, fp16/bf16 on CPU in float32.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from parlay.horovod.basics import HorovodInternalError
from parlay.horovod.groups import Group
from parlay.reduce_ops import ReduceOp

__all__ = ["run_ready", "check", "scale_", "adasum", "scatter_rows"]

# Reductions gloo cannot do natively in a dtype run in a wider one.
_WIDEN = {torch.int16: torch.int32}
_NO_JOIN = ("allgather", "broadcast", "alltoall", "reducescatter")
_ALONE_BYTES = 1 << 20   # tensors this big are reduced in place, never copied for fusion


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check(key: str, metas: dict[int, Any], joined: set[int],
          global_ranks: list[int]) -> str | None:
    """Why the descriptors of one operation disagree (``None`` if they agree)."""
    kind = next(iter(metas.values())).kind
    if joined and kind in _NO_JOIN:
        return (f"{kind} is not supported while a rank has joined (rank(s) "
                f"{sorted(global_ranks[r] for r in joined)} called hvd.join()); only allreduce "
                "and barrier run with joined ranks, as in Horovod.")
    (r0, m0), *rest = sorted(metas.items())
    for r, m in rest:
        a, b = global_ranks[r0], global_ranks[r]
        if m.kind != m0.kind:
            return f"Mismatched operations for {key}: rank {a} ran {m0.kind}, rank {b} {m.kind}."
        if m.device != m0.device:
            return (f"Mismatched CPU/GPU device for {key}: rank {a} has a {m0.device} tensor, "
                    f"rank {b} a {m.device} tensor.")
        if len(m.dtypes) != len(m0.dtypes):
            return (f"Mismatched number of tensors for {key}: rank {a} sent "
                    f"{len(m0.dtypes)}, rank {b} {len(m.dtypes)}.")
        if m.dtypes != m0.dtypes:
            return (f"Mismatched data types for {key}: rank {a} sent {', '.join(m0.dtypes)}, "
                    f"rank {b} sent {', '.join(m.dtypes)}.")
        if m.op != m0.op:
            return (f"Mismatched reduction ops for {key}: rank {a} used "
                    f"{ReduceOp(m0.op).name}, rank {b} {ReduceOp(m.op).name}.")
        if (m.prescale, m.postscale) != (m0.prescale, m0.postscale):
            return (f"Mismatched prescale/postscale factors for {key}: rank {a} used "
                    f"{(m0.prescale, m0.postscale)}, rank {b} {(m.prescale, m.postscale)}.")
        if m.root != m0.root:
            return (f"Mismatched root ranks for {key}: rank {a} broadcasts from {m0.root}, "
                    f"rank {b} from {m.root}.")
        for s0, s in zip(m0.shapes, m.shapes):
            if kind in ("allgather", "alltoall"):
                if len(s0) != len(s) or s0[1:] != s[1:]:
                    return (f"Mismatched {kind} tensor shapes for {key}: rank {a} sent "
                            f"{_fmt(s0)}, rank {b} sent {_fmt(s)}; only the first dimension "
                            "may differ.")
            elif s0 != s:
                return (f"Mismatched {kind} tensor shapes for {key}: rank {a} sent a tensor of "
                        f"shape {_fmt(s0)}, rank {b} one of shape {_fmt(s)}.")
    if kind == "broadcast" and m0.root not in global_ranks:
        return f"broadcast root rank {m0.root} is not a member of the process set {global_ranks}."
    if kind in ("allreduce", "reducescatter") and m0.op in (ReduceOp.Min, ReduceOp.Max,
                                                           ReduceOp.Product):
        bad = [d for d in m0.dtypes if _dtype(d).is_complex]
        if bad:
            return f"{ReduceOp(m0.op).name} is not defined for complex tensors ({key})."
    if m0.op == ReduceOp.Adasum:
        bad = [d for d in m0.dtypes if not _dtype(d).is_floating_point]
        if bad:
            return f"Adasum needs floating point tensors, got {', '.join(bad)} for {key}."
    return None


def run_ready(g: Group, batch: list[tuple[str, dict[int, Any], Any]], joined: set[int],
              fusion_bytes: int) -> list[tuple[Any, Any, BaseException | None]]:
    """Run one cycle's ready operations (identically ordered on every rank).

    Args:
        g: The group to run on.
        batch: ``(name, {group rank: descriptor}, local request or None)`` in table order.
        joined: Group ranks that joined (no request, zeros for allreduce).
        fusion_bytes: Largest fused allreduce buffer.

    Returns:
        ``(request, result, error)`` for each local request of the batch.
    """
    out: list[tuple[Any, Any, BaseException | None]] = []
    fused: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for key, metas, req in batch:
        why = check(key, metas, joined, g.global_ranks)
        m = next(iter(metas.values()))
        if why is not None:
            if req is not None:
                out.append((req, None, HorovodInternalError(why, op=m.kind)))
            continue
        if m.kind == "allreduce" and m.op != ReduceOp.Adasum:
            # Results land in the outputs when the fused buffers below are reduced.
            ts = req.outputs if req is not None else [_zeros(m, i) for i in range(len(m.dtypes))]
            for t, d in zip(ts, m.dtypes):
                fused.setdefault((d, m.device, m.op, m.prescale, m.postscale), []).append(t)
            if req is not None:
                out.append((req, req.outputs, None))
            continue
        res = _run_one(g, m, metas, req)
        if req is not None:
            out.append((req, res, None))
    for (_, _, op, pre, post), tensors in fused.items():
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for t in tensors:
            b = t.numel() * t.element_size()
            if b >= _ALONE_BYTES and t.is_contiguous():
                # Copying a big tensor into a fusion buffer costs more than its own message.
                _allreduce_flat(g, [t], op, pre, post)
                continue
            if chunk and nbytes + b > fusion_bytes:
                _allreduce_flat(g, chunk, op, pre, post)
                chunk, nbytes = [], 0
            chunk.append(t)
            nbytes += b
        if chunk:
            _allreduce_flat(g, chunk, op, pre, post)
    return out


# ------------------------------------------------------------------------------ allreduce
def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place like Horovod: ints via float64 (truncated), CPU fp16/bf16 via fp32."""
    if factor == 1.0 or t.dtype == torch.bool:
        return t
    if t.is_floating_point() or t.is_complex():
        if t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16):
            t.copy_(t.float().mul_(factor))
        else:
            t.mul_(factor)
    else:
        t.copy_(t.double().mul_(factor))
    return t


def _divide_(t: torch.Tensor, n: int) -> None:
    if t.dtype == torch.bool:
        return
    if t.is_floating_point() or t.is_complex():
        if t.device.type == "cpu" and t.dtype in (torch.float16, torch.bfloat16):
            t.copy_(t.float().div_(n))
        else:
            t.div_(n)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def _zeros(meta: Any, i: int) -> torch.Tensor:
    dev = torch.device("cuda", torch.cuda.current_device()) if meta.device == "cuda" else "cpu"
    return torch.zeros(meta.shapes[i], dtype=_dtype(meta.dtypes[i]), device=dev)


def _allreduce_flat(g: Group, ts: list[torch.Tensor], op: int, pre: float, post: float) -> None:
    size = g.size
    single = len(ts) == 1 and ts[0].is_contiguous() and ts[0].dtype not in _WIDEN
    buf = ts[0] if single else torch.cat([t.reshape(-1) for t in ts])
    wide = _WIDEN.get(buf.dtype)
    work = buf.to(wide) if wide is not None else buf
    scale_(work, pre)
    g.all_reduce(work, op)
    if op == ReduceOp.Average:
        if post != 1.0 and not (work.is_floating_point() or work.is_complex()):
            work.copy_(work.double().mul_(post).div_(size))   # one rounding, like Horovod
        else:
            _divide_(work, size)
            scale_(work, post)
    else:
        scale_(work, post)
    if work is not buf:
        buf.copy_(work)
    if not single:
        off = 0
        for t in ts:
            n = t.numel()
            t.copy_(buf[off: off + n].view_as(t))
            off += n


def adasum(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Adasum (Maleki et al., 2020) of equally shaped tensors, combined pairwise in a binary
    tree by rank ((0,1), (2,3), then their results, ...): for a pair a, b the result is
    ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``; orthogonal inputs add, equal ones average."""
    vs = [v.double() for v in vectors]
    step = 1
    while step < len(vs):
        for i in range(0, len(vs) - step, 2 * step):
            a, b = vs[i], vs[i + step]
            dot = torch.dot(a.reshape(-1), b.reshape(-1))
            na, nb = a.pow(2).sum(), b.pow(2).sum()
            ca = 1 - dot / (2 * na) if na > 0 else torch.ones((), dtype=a.dtype)
            cb = 1 - dot / (2 * nb) if nb > 0 else torch.ones((), dtype=a.dtype)
            vs[i] = ca * a + cb * b
        step *= 2
    return vs[0]


# ------------------------------------------------------------------------------ the others
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return b.contiguous().view(dtype).reshape(shape)


def _run_one(g: Group, m: Any, metas: dict[int, Any], req: Any) -> Any:
    size = g.size
    if m.kind == "barrier":
        return None
    if m.kind == "allreduce":              # Adasum: gather everything, combine locally
        outs = []
        for t in (req.outputs if req is not None else
                  [_zeros(m, j) for j in range(len(m.dtypes))]):
            scale_(t, m.prescale)
            parts = _gather_bytes(g, [t.reshape(1, -1)], {r: [1] for r in range(size)})[0]
            parts = parts.view(size, -1)
            res = adasum(list(parts.unbind(0))).to(t.dtype).view_as(t)
            t.copy_(scale_(res, m.postscale))
            outs.append(t)
        return outs
    if m.kind == "allgather":
        dims = {r: [s[0] if s else 1 for s in mm.shapes] for r, mm in metas.items()}
        ts = [t if t.dim() else t.reshape(1) for t in req.inputs]
        return _gather_bytes(g, ts, dims), [dims[r] for r in range(size)]
    if m.kind == "broadcast":
        return _broadcast(g, req.outputs, m.root)
    if m.kind == "alltoall":
        return _alltoall(g, req.inputs[0], metas)
    if m.kind == "reducescatter":
        return [_reducescatter(g, t, m) for t in req.inputs]
    raise HorovodInternalError(f"unknown operation kind {m.kind!r}")


def _gather_bytes(g: Group, ts: list[torch.Tensor],
                  dims: dict[int, list[int]]) -> list[torch.Tensor]:
    """Allgather several tensors in one message; ``dims[r][i]``: rank r's rows of tensor i."""
    size = g.size
    rows = [t[0].numel() * t.element_size() if t.shape[0] else
            math.prod(t.shape[1:]) * t.element_size() for t in ts]
    per_rank = [sum(d * rb for d, rb in zip(dims[r], rows)) for r in range(size)]
    longest = max(per_rank)
    dev = ts[0].device
    send = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if ts:
        mine = torch.cat([_bytes(t) for t in ts])
        send[: mine.numel()] = mine
    out = torch.empty(longest * size, dtype=torch.uint8, device=dev)
    if longest:   # every rank knows every size: all skip together
        g.all_gather(out, send)
    results = []
    offs = [r * longest for r in range(size)]
    for i, t in enumerate(ts):
        pieces = []
        for r in range(size):
            n = dims[r][i] * rows[i]
            pieces.append(out[offs[r]: offs[r] + n])
            offs[r] += n
        total = sum(dims[r][i] for r in range(size))
        results.append(_from_bytes(torch.cat(pieces), t.dtype, (total, *t.shape[1:])))
    return results


def _broadcast(g: Group, outs: list[torch.Tensor], root: int) -> list[torch.Tensor]:
    buf = torch.cat([_bytes(t) for t in outs]) if len(outs) > 1 else _bytes(outs[0]).clone()
    if buf.numel():
        g.broadcast(buf, root)
    off = 0
    for t in outs:
        n = t.numel() * t.element_size()
        t.copy_(_from_bytes(buf[off: off + n], t.dtype, tuple(t.shape)))
        off += n
    return outs


def _splits(m: Any, size: int) -> list[int]:
    if m.splits is not None:
        return list(m.splits)
    d0 = m.shapes[0][0] if m.shapes[0] else 1
    return [d0 // size] * size


def _alltoall(g: Group, t: torch.Tensor,
              metas: dict[int, Any]) -> tuple[torch.Tensor, list[int]]:
    size, rank = g.size, g.rank
    row = math.prod(t.shape[1:]) * t.element_size()
    send = _splits(metas[rank], size)
    recv = [_splits(metas[r], size)[rank] for r in range(size)]
    out = torch.empty(sum(recv) * row, dtype=torch.uint8, device=t.device)
    g.all_to_all(out, _bytes(t[: sum(send)]), [r * row for r in recv], [s * row for s in send])
    return _from_bytes(out, t.dtype, (sum(recv), *t.shape[1:])), recv


def scatter_rows(d0: int, size: int) -> list[int]:
    """Rows of a reducescatter each rank keeps: as even as possible, lower ranks first."""
    return [d0 // size + (1 if r < d0 % size else 0) for r in range(size)]


def _reducescatter(g: Group, t: torch.Tensor, m: Any) -> torch.Tensor:
    size, rank = g.size, g.rank
    rows = scatter_rows(t.shape[0], size)
    most = max(rows)
    wide = _WIDEN.get(t.dtype, t.dtype)
    padded = t.new_zeros((size * most, *t.shape[1:]), dtype=wide)
    off = 0
    for r, n in enumerate(rows):
        padded[r * most: r * most + n] = t[off: off + n]
        off += n
    scale_(padded, m.prescale)
    out = padded.new_empty((most, *t.shape[1:]))
    g.reduce_scatter(out, padded, m.op)
    out = out[: rows[rank]]
    if m.op == ReduceOp.Average:
        _divide_(out, size)
    scale_(out, m.postscale)
    return out.to(t.dtype)
