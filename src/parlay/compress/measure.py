"""What ``compression="auto"`` decides from: the link, timed once over the group and fitted to
``alpha + bytes * beta``; each candidate's codec, timed on a sample of the bucket; and a
candidate's predicted seconds, its codec plus its own collectives
(:meth:`~parlay.compress.base.Compressor.wire_rounds`) on the fitted link. Times are
MAX-reduced over the group, so every rank prices the candidates from the same numbers.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from parlay import comm
from parlay.compress.base import Compressor, get_compressor
from parlay.compress.reduce import local_round_trip

__all__ = ["LinkFit", "probe_link", "agreed_max", "codec_seconds", "predict_s", "Hook",
           "SAMPLE_NUMEL"]

#: Codec costs are timed on at most this many leading elements of a bucket and scaled up.
SAMPLE_NUMEL = 1 << 22
#: ``hook(kind, name, seconds) -> seconds``: a test's hand on each local time before it is
#: reduced.
Hook = Callable[[str, str, float], float]


class LinkFit(NamedTuple):
    """An allreduce over the group costs ``alpha_s + nbytes * beta_s`` (``beta_half_s`` in
    fp16)."""

    alpha_s: float
    beta_s: float
    beta_half_s: float


def agreed_max(values: Sequence[float], group: Any) -> list[float]:
    """Each value's maximum over ``group`` (one float64 allreduce on the group's device)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=comm.group_device(group))
    comm.allreduce(t, "max", group=group)
    return t.tolist()


def _timed_allreduce(t: torch.Tensor, group: Any) -> float:
    """Seconds of one allreduce of ``t``: the best of five on a fast link (the first pays
    one-off costs); one when the slowest rank's first took over 50 ms (all ranks alike)."""
    times: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        comm.allreduce(t, "sum", group=group)
        if t.is_cuda:  # NCCL's wait only orders streams: time the transfer itself
            torch.cuda.synchronize(t.device)
        times.append(time.perf_counter() - t0)
        if len(times) == 1 and agreed_max(times, group)[0] > 0.05:
            break
    return min(times)


def probe_link(group: Any, bucket_bytes: Sequence[int], hook: Hook | None = None) -> LinkFit:
    """Time allreduces over ``group`` (every member calls it) and fit alpha-beta from the
    slowest rank's times. The sizes: a quarter of the largest bucket (1-4 MiB) and a quarter of
    that; their slope is the cost per byte even when the smaller fits a shaper's burst."""
    large = int(min(4 << 20, max(1 << 20, max(bucket_bytes, default=0) // 4)))
    small = large // 4
    dev = comm.group_device(group)
    buf = torch.zeros(large // 4, device=dev)
    comm.allreduce(torch.zeros(1, device=dev), "sum", group=group)  # line the ranks up first
    times = [_timed_allreduce(buf[: small // 4], group), _timed_allreduce(buf, group),
             _timed_allreduce(torch.zeros(large // 2, dtype=torch.float16, device=dev), group)]
    if hook is not None:
        times = [hook("link", n, t) for n, t in zip(("small", "large", "half"), times)]
    t_small, t_large, t_half = agreed_max(times, group)
    beta = (t_large - t_small) / (large - small)
    beta = max(beta if beta > 0 else t_large / large, 1e-15)  # noise: the larger size bounds it
    # The same bytes never cost less in fp16 (same wire, sums no faster): a ratio under 1 is
    # noise on the fp32 probe, so it counts as 1.
    return LinkFit(max(0.0, t_small - beta * small), beta,
                   max(beta * max(1.0, t_half / max(t_large, 1e-12)), 1e-15))


def _sample(shapes: Sequence[tuple[int, ...]] | None,
            numel: int) -> tuple[int, list[tuple[int, ...]] | None]:
    """The leading part of a bucket to time: ``(elements, its layout)``. A matrix that does
    not fit whole keeps its columns and as many rows as fit, so its per-element cost is kept
    (every candidate's work is linear in the elements)."""
    if numel <= SAMPLE_NUMEL or shapes is None:
        return min(numel, SAMPLE_NUMEL), list(shapes) if shapes is not None else None
    out: list[tuple[int, ...]] = []
    used = 0
    for s in shapes:
        n = math.prod(s)
        if used + n <= SAMPLE_NUMEL:
            out.append(tuple(s))
            used += n
            continue
        rest = math.prod(s[1:]) if len(s) >= 2 else 1
        rows = (SAMPLE_NUMEL - used) // rest
        if rows >= 1:
            out.append((rows, *s[1:]))
            used += rows * rest
        break
    return (used, out) if used else (SAMPLE_NUMEL, None)


def codec_seconds(spec: str, flat: torch.Tensor, key: str, world: int,
                  shapes: Sequence[tuple[int, ...]] | None, enough: float = math.inf) -> float:
    """CPU seconds one rank spends on ``spec`` for this bucket per step (a fresh instance:
    encode, further rounds on its own payload, decode), the best of three warm runs on a
    sample scaled to the bucket; stops early once over ``enough``."""
    n, layout = _sample(shapes, flat.numel())
    c = get_compressor(spec)
    if layout is not None:
        c.set_layout(key, layout)
    part, best = flat[:n], math.inf
    scratch = torch.empty_like(part)  # decoded into, as the step's bucket is
    for _ in range(3):
        t0 = time.perf_counter()
        local_round_trip(c, part, key, world, into=scratch)
        best = min(best, time.perf_counter() - t0)
        if best * flat.numel() / max(1, n) > enough:
            break
    return best * flat.numel() / max(1, n)


def predict_s(cand: Compressor, numel: int, shapes: Any, fit: LinkFit, world: int,
              codec_s: float, collective: bool = True) -> float:
    """Codec time plus the candidate's own collectives on the fitted link (``collective``
    False: one point-to-point message with every round's bytes, a parameter-server push)."""
    if world <= 1:
        return codec_s
    rounds = cand.wire_rounds(numel, shapes)
    if not collective:
        sent = sum(r.nbytes for r in rounds)
        return codec_s + (fit.alpha_s + sent * fit.beta_s * world) / (2 * (world - 1))
    return codec_s + sum(
        fit.alpha_s + r.nbytes * (fit.beta_s * world / 2 if r.kind == "allgather"
                                  else fit.beta_half_s if r.half else fit.beta_s)
        for r in rounds)
