"""Top-k's compact wire (``topk:RATIO,compact=1``): 4 bytes a coordinate instead of 8.

One ``uint8`` payload per rank, of a fixed size for a bucket of ``numel`` elements and ``k``
coordinates (every rank's is allgathered): an int32 count per block of 65536 coordinates, then
``k`` bfloat16 values, then ``k`` 16-bit offsets within their blocks, the coordinates in
ascending order. Rounding the values to bfloat16 is exact over time with error feedback: the
compressor keeps ``value - rounded`` in the residual (:class:`~parlay.compress.sparse.TopK`).
"""
from __future__ import annotations

import torch

from parlay.errors import CommError

__all__ = ["pack_compact", "unpack_compact", "compact_bytes"]

_BLOCK_BITS = 16  # compact top-k: indices travel as 16-bit offsets within 65536-blocks


def compact_bytes(numel: int, k: int) -> int:
    """Bytes of a compact top-k payload: an int32 count per block, then k bfloat16 values
    and k uint16 offsets."""
    return 4 * ((numel + (1 << _BLOCK_BITS) - 1) >> _BLOCK_BITS) + 4 * k


def pack_compact(values: torch.Tensor, idx: torch.Tensor, numel: int, k: int) -> torch.Tensor:
    """One ``uint8`` payload of ``values`` at ``idx`` (distinct; fewer than ``k`` are padded
    with zeros at coordinate 0): per-block counts, bfloat16 values, 16-bit offsets."""
    nblocks = (numel + (1 << _BLOCK_BITS) - 1) >> _BLOCK_BITS
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):  # (top-k's are ascending)
        idx, order = torch.sort(idx, stable=True)  # stable: a radix sort, faster here
        values = values.index_select(0, order)
    counts = torch.bincount(idx >> _BLOCK_BITS, minlength=nblocks)
    pad = k - idx.numel()
    out = torch.empty(compact_bytes(numel, k), dtype=torch.uint8, device=values.device)
    head = 4 * nblocks
    vals, offs = out[head:head + 2 * k].view(torch.bfloat16), out[head + 2 * k:].view(torch.int16)
    if pad:  # zeros added to coordinate 0, first: block 0 comes first
        counts[0] += pad
        vals[:pad].zero_()
        offs[:pad].zero_()
    out[:head].view(torch.int32).copy_(counts)
    vals[pad:].copy_(values)
    offs[pad:].copy_(idx & 0xFFFF)  # int64 -> int16 keeps the low 16 bits
    return out


def unpack_compact(buf: torch.Tensor, numel: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of a :func:`pack_compact` payload.

    Raises:
        CommError: The payload does not describe ``k`` coordinates of a ``numel`` bucket.
    """
    if numel == k == buf.numel() == 0:  # an empty bucket (an empty view may not align)
        return buf.new_zeros(0, dtype=torch.bfloat16), buf.new_zeros(0, dtype=torch.long)
    nblocks = (numel + (1 << _BLOCK_BITS) - 1) >> _BLOCK_BITS
    head = 4 * nblocks
    counts = (buf[:head].view(torch.int32).long() if buf.dtype == torch.uint8
              and buf.numel() == compact_bytes(numel, k) else None)
    if counts is None or bool((counts < 0).any()) or int(counts.sum()) != k:
        raise CommError(f"a compact top-k payload for {k} of {numel} coordinates is malformed "
                        "(wrong size or block counts). Hint: every rank must run the same "
                        "compression spec.")
    base = torch.repeat_interleave(
        torch.arange(nblocks, device=buf.device) << _BLOCK_BITS, counts, output_size=k)
    idx = buf[head + 2 * k:].view(torch.int16).long().bitwise_and_(0xFFFF).add_(base)
    if k and int(idx.max()) >= numel:  # only the last block can overrun
        raise CommError(f"a compact top-k payload names coordinate {int(idx.max())} of a "
                        f"{numel}-element bucket.")
    return buf[head:head + 2 * k].view(torch.bfloat16), idx

