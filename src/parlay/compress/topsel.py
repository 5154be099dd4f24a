"""Top-k selection: the indices of the ``k`` largest entries (or magnitudes) of a bucket.

A full ``torch.topk`` over a large bucket is the slowest part of top-k compression. Like DGC
(Lin et al. 2018) we first estimate a threshold from a random sample, keep only the entries
above it (one pass), and choose among those few.

That pass is memory-bound work: |x|, a comparison and a scan for the set bits. On CPU tensors of
the dtypes NumPy knows it runs on NumPy views of the same memory (no copy), which measured
faster than the same three steps as torch ops (torch's CPU ``nonzero`` is the slow one; figures
in docs/benchmarks.md, "Design measurements"). Other devices and dtypes (CUDA,
bfloat16) take the torch ops. Both give the same indices.

The final choice among the candidates keeps them in ascending order (a partition for the k-th
value, then a mask), so a payload needs no sort; there ties at the k-th value go to the lowest
indices. Small or dense buckets take ``torch.topk``, whose choice among ties is its own.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["exact_topk", "magnitude_topk"]

#: Elements per pass of the candidate scan: its scratch stays in a core's L2 cache.
_CHUNK = 1 << 18
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def exact_topk(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of ``a`` (exact), ascending."""
    return _select(a, k, magnitude=False, sample=0.0)


def magnitude_topk(x: torch.Tensor, k: int, sample: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Indices of the ``k`` largest ``|x|`` (exact), or DGC's sampled selection; ascending.

    With ``sample == 0`` this is exact: the sampled threshold aims at ~2k candidates, and if at
    least ``k`` entries pass it the k-th largest is >= the threshold, so every true top-k entry
    is a candidate; if fewer pass, it falls back to a full ``topk``. With ``sample > 0`` (a
    fraction of the coordinates to sample) it is DGC's estimate: the threshold aims at ``k``
    entries and those above it are returned, trimmed to the ``k`` largest when more pass, and
    *fewer than k* when fewer pass (never a full topk). ``seed`` varies which coordinates are
    sampled (top-k passes the step).
    """
    return _select(x, k, magnitude=True, sample=float(sample), seed=seed)


def _on_numpy(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and x.is_contiguous() \
        and not x.requires_grad


def _above(x: torch.Tensor, thr: torch.Tensor, magnitude: bool) -> torch.Tensor:
    """Indices ``i`` with ``|x[i]| >= thr`` (or ``x[i] >= thr``), ascending, scanned in
    cache-sized chunks so no bucket-sized ``|x|`` or mask is ever allocated."""
    n = x.numel()
    if _on_numpy(x):
        xn, t = x.numpy(), thr.item()
        scratch, mask = np.empty(min(n, _CHUNK), dtype=xn.dtype), np.empty(min(n, _CHUNK), bool)
        parts = []
        for s in range(0, n, _CHUNK):
            c = xn[s: s + _CHUNK]
            a = np.abs(c, out=scratch[: c.size]) if magnitude else c
            f = np.flatnonzero(np.greater_equal(a, t, out=mask[: c.size]))
            parts.append(f + s if s else f)
        return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
    scratch_t = x.new_empty(min(n, _CHUNK))
    mask_t = torch.empty(scratch_t.shape, dtype=torch.bool, device=x.device)
    found = []
    for s in range(0, n, _CHUNK):
        part = x[s: s + _CHUNK]
        m = mask_t[: part.numel()]
        torch.ge(torch.abs(part, out=scratch_t[: part.numel()]) if magnitude else part, thr, out=m)
        found.append(m.nonzero().squeeze(1).add_(s))
    return torch.cat(found)


def _largest(cand: torch.Tensor, vals: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` of ``cand`` (ascending) with the largest ``vals``, still ascending; ties at the
    k-th value go to the first ones."""
    if vals.device.type == "cpu" and vals.dtype in _NUMPY_DTYPES:
        v = vals.numpy()
        kth = np.partition(v, v.size - k)[v.size - k]
        keep = v > kth
        short = k - int(np.count_nonzero(keep))
        if short:  # (NaN never gets here: the threshold's comparison drops it)
            keep[np.flatnonzero(v == kth)[:short]] = True
        return cand[torch.from_numpy(keep)]
    kth = vals.kthvalue(vals.numel() - k + 1).values
    keep = vals > kth
    short = k - int(keep.sum())
    if short:
        keep[(vals == kth).nonzero().squeeze(1)[:short]] = True
    return cand[keep]


def _select(x: torch.Tensor, k: int, magnitude: bool, sample: float,
            seed: int = 0) -> torch.Tensor:
    n = x.numel()
    if n < 65536 or k * 32 > n:
        return torch.topk(x.abs() if magnitude else x, k, sorted=False).indices.sort().values
    m = max(16384, min(n, int(sample * n))) if sample else 16384
    # The exact path keeps one sample per bucket size (its result only depends on it through
    # tie-breaking at the k-th value); the sampled path draws a new one each step.
    g = torch.Generator(device=x.device).manual_seed(n * 31 + k + (1_000_003 * seed if sample
                                                                   else 0))
    # index_select/index_fill_/scatter_add_ rather than x[idx]: faster on CPU
    sample_vals = x.index_select(0, torch.randint(n, (m,), generator=g, device=x.device))
    if magnitude:
        sample_vals = sample_vals.abs()
    # exact: aim for ~2k candidates (+ slack for the sample's noise); sampled: aim for k
    target = k / n if sample else min(1.0, 2.0 * k / n)
    rank = max(1, m - int(m * target) - (0 if sample else 8))
    thr = sample_vals.kthvalue(rank).values
    cand = _above(x, thr, magnitude)
    if cand.numel() < k and not sample:
        full = x.abs() if magnitude else x
        return torch.topk(full, k, sorted=False).indices.sort().values
    if cand.numel() <= k:
        return cand
    vals = x.index_select(0, cand)
    return _largest(cand, vals.abs_() if magnitude else vals, k)
