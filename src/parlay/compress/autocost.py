"""What ``compression="auto"`` measures and how it predicts each candidate's time per bucket.

Three measurements, each taken on every rank and then MAX-reduced over the group, so every rank
feeds identical numbers into the same pure prediction and reaches the same choice:

* the link (:func:`probe_link`): blocking allreduces of two fp32 sizes and one fp16 size. The
  difference of the two fp32 times gives the cost per byte (a token-bucket shaper's burst, as
  Linux ``tbf`` keeps, cancels out of the difference), the smaller one the fixed cost; the fp16
  time gives its own cost per byte, because gloo sums half floats in software.
* each candidate's CPU cost on the bucket itself (:func:`codec_seconds`): a fresh instance
  encodes the bucket, runs its further rounds on its own payload as a stand-in for the sum and
  decodes, exactly the work a real step does on this rank.
* the step time (the interval between two starts of the first bucket), which triggers a new
  decision when it moves.

The prediction (:func:`predict_s`) is the codec time plus the collectives the candidate runs,
timed by the shared alpha-beta formulas of :mod:`parlay.plan.model` on a :class:`Link` fitted to
the measured allreduces.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from parlay import comm
from parlay.compress.base import get_compressor, local_round_trip
from parlay.plan import model

__all__ = ["LinkFit", "probe_link", "codec_seconds", "sample_layout", "predict_s",
           "probe_sizes", "switch_margin", "SAMPLE_NUMEL", "ONE_HOST_MARGIN"]

_KIB = 1024
#: Timing hook: ``hook(kind, name, seconds) -> seconds`` (see AutoCompressor.timing_hook).
Hook = Callable[[str, str, float], float]
#: Least margin for a switch when every rank runs on one host: the "link" there is the same
#: CPU and memory the codecs use, both measure noisily under load (the dense prediction moved
#: 10-26 ms, the codecs' 14-45 ms between launches here), and compression rarely pays.
ONE_HOST_MARGIN = 0.5


def switch_margin(margin: float) -> float:
    """The margin a switch needs: ``margin``, at least :data:`ONE_HOST_MARGIN` when every rank
    of the initialised parlay world runs on this host."""
    from parlay import runtime  # a lower layer; lazily, as comm does

    one_host = runtime.is_initialized() and runtime.cluster().one_host
    return max(margin, ONE_HOST_MARGIN) if one_host else margin


@dataclass(frozen=True)
class LinkFit:
    """The measured cost of an allreduce over the group: ``alpha + nbytes * beta``.

    Attributes:
        alpha_s: Fixed seconds per allreduce (software plus latency).
        beta_s: Seconds per byte of an fp32 allreduce (wire, copies and sums).
        beta_half_s: Seconds per byte of an fp16 allreduce.
        world: Ranks in the group.
    """

    alpha_s: float
    beta_s: float
    beta_half_s: float
    world: int

    def link(self, half: bool = False, steps: int = 0) -> model.Link:
        """The cost model's :class:`~parlay.plan.model.Link` whose ring allreduce costs what was
        measured: ``2(n-1) latency + 2(n-1)/n nbytes beta_link``.

        Args:
            half: The link as an fp16 allreduce sees it.
            steps: Spread the fixed cost over this many ring steps instead (``n-1`` for an
                allgather): one collective costs one ``alpha`` whatever its kind, as measured
                on gloo, rather than the ring's count of steps.
        """
        n = max(2, self.world)
        per_byte = max(self.beta_half_s if half else self.beta_s, 1e-15) * n / (2 * (n - 1))
        return model.Link(8.0 / per_byte, max(0.0, self.alpha_s) / (steps or 2 * (n - 1)), 1.0)


def probe_sizes(bucket_bytes: Sequence[int]) -> tuple[int, int]:
    """(smaller, larger) probe sizes in bytes: a quarter of the largest bucket, between 1 MiB and
    4 MiB, and a quarter of that. The slope between them is the cost per byte even when the
    smaller one fits in a shaper's burst (Linux tbf lets ~10 ms of line rate through at once)."""
    big = max(bucket_bytes) if bucket_bytes else 0
    large = int(min(4 * 1024 * _KIB, max(1024 * _KIB, big // 4)))
    return large // 4, large


def agreed_max(values: Sequence[float], group: Any) -> list[float]:
    """Each of ``values``' maximum over ``group`` (one float64 allreduce, on the group's
    device: CUDA for a NCCL-only group)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=comm.group_device(group))
    comm.allreduce(t, "max", group=group)
    return t.tolist()


def _timed_allreduce(t: torch.Tensor, group: Any) -> float:
    """Seconds of one allreduce of ``t``; on a fast link (under 50 ms) the best of five, as
    the first of a size pays one-off costs and a loaded machine adds noise. Every rank repeats
    alike: the count depends only on the slowest rank's first time (a MAX allreduce)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        comm.allreduce(t, "sum", group=group)
        if t.is_cuda:  # NCCL's wait only orders streams: time the transfer itself
            torch.cuda.synchronize(t.device)
        times.append(time.perf_counter() - t0)
        if len(times) == 1 and agreed_max(times, group)[0] > 0.05:
            break
    return min(times)


def probe_link(group: Any, world: int, bucket_bytes: Sequence[int],
               hook: Hook | None = None) -> LinkFit:
    """Time allreduces over ``group`` (a collective: every member calls it) and fit alpha-beta.

    Returns:
        The fit from the slowest rank's times (identical on every rank).
    """
    small, large = probe_sizes(bucket_bytes)
    dev = comm.group_device(group)  # CUDA for a NCCL-only group
    buf = torch.zeros(large // 4, device=dev)
    comm.allreduce(torch.zeros(1, device=dev), "sum", group=group)  # line the ranks up first
    times = [_timed_allreduce(buf[: small // 4], group), _timed_allreduce(buf, group),
             _timed_allreduce(torch.zeros(large // 2, dtype=torch.float16, device=dev), group)]
    if hook is not None:
        times = [hook("link", name, t) for name, t in zip(("small", "large", "half"), times)]
    t_small, t_large, t_half = agreed_max(times, group)
    # The slope between two sizes is the cost per byte; when noise makes it implausible (no
    # larger than zero), the larger size alone bounds it.
    beta = (t_large - t_small) / (large - small)
    if beta <= 0:
        beta = t_large / large
    beta = max(beta, 1e-15)
    alpha = max(0.0, t_small - beta * small)
    # Same bytes in fp16 and fp32: the ratio of the two times carries gloo's software half
    # sums without inheriting the intercept's noise (an overestimated alpha would otherwise
    # make fp16 look cheaper than it is). The same bytes never cost less in fp16 (the same
    # wire, sums no faster): a ratio under 1 is noise on the fp32 probe (a loaded machine
    # once read 0.5, which predicted fp16 4x faster than dense on loopback), so it counts as 1.
    beta_half = max(beta * max(1.0, t_half / max(t_large, 1e-12)), 1e-15)
    return LinkFit(alpha, beta, beta_half, world)


#: Codec costs are timed on at most this many leading elements of a bucket (16 MB of fp32:
#: past the caches, as the whole bucket is) and scaled up:
#: every candidate's work is linear in the elements (a matrix keeps its columns, loses rows).
SAMPLE_NUMEL = 1 << 22


def sample_layout(shapes: Sequence[tuple[int, ...]] | None, numel: int,
                  limit: int = SAMPLE_NUMEL) -> tuple[int, list[tuple[int, ...]] | None]:
    """The leading part of a bucket to time: ``(elements, its layout)``. A matrix that does not
    fit whole keeps its columns and as many rows as fit, so its per-element cost is kept."""
    if numel <= limit:
        return numel, list(shapes) if shapes is not None else None
    if shapes is None:
        return limit, None
    out: list[tuple[int, ...]] = []
    used = 0
    for s in shapes:
        n = math.prod(s)
        if used + n <= limit:
            out.append(tuple(s))
            used += n
            continue
        rest = math.prod(s[1:]) if len(s) >= 2 else 1
        rows = (limit - used) // rest if len(s) >= 2 else limit - used
        if rows >= 1:
            out.append((rows, *s[1:]) if len(s) >= 2 else (rows,))
            used += rows * rest
        break
    return (used, out) if used else (limit, None)


def codec_seconds(spec: str, flat: torch.Tensor, key: str, world: int,
                  shapes: Sequence[tuple[int, ...]] | None, repeats: int = 3,
                  enough: float = math.inf) -> float:
    """CPU seconds one rank spends on ``spec`` for this bucket per step: encode, further rounds
    (on its own payload, standing in for the sum) and decode, on a fresh instance (the
    optimizer's compressors keep their state untouched), timed on at most
    :data:`SAMPLE_NUMEL` leading elements (:func:`sample_layout`) and scaled to the bucket.
    The best of ``repeats`` runs: the later ones run warm, as every step after the first does,
    and a burst of load from elsewhere on the machine does not decide. Runs stop early once
    the scaled time exceeds ``enough`` (a candidate already too slow to be chosen)."""
    n, layout = sample_layout(shapes, flat.numel())
    c = get_compressor(spec)
    if layout is not None:
        c.set_layout(key, layout)
    part = flat[:n]
    scratch, best = torch.empty_like(part), math.inf  # decoded into, as the step's bucket is
    for _ in range(repeats):
        t0 = time.perf_counter()
        local_round_trip(c, part, key, world, into=scratch)
        best = min(best, time.perf_counter() - t0)
        if best * flat.numel() / max(1, n) > enough:
            break
    return best * flat.numel() / max(1, n)


def predict_s(spec: str, numel: int, fit: LinkFit, codec_s: float,
              shapes: Sequence[tuple[int, ...]] | None = None, collective: bool = True) -> float:
    """Predicted seconds to reduce one bucket with ``spec``: its codec time plus its
    collectives on the fitted link (``collective=False``: one point-to-point message carrying
    every round's bytes, as a parameter-server push)."""
    name = model.parse_compressor(spec).name
    rounds = model.wire_rounds(spec, numel, fit.world, shapes)
    if fit.world <= 1:
        return codec_s
    if not collective:
        return codec_s + fit.link().transfer_s(sum(r.nbytes for r in rounds))
    total = codec_s
    for r in rounds:
        if r.kind == "allgather":
            total += model.allgather_s(r.nbytes, fit.world, fit.link(steps=fit.world - 1))
        else:
            total += model.allreduce_s(r.nbytes, fit.world, fit.link(name in ("fp16", "bf16")))
    return total if math.isfinite(total) else float("inf")
