"""The compressed reduction every mode uses: :func:`reduce_async` sums (or averages) a flat
bucket over a group through a :class:`~parlay.compress.base.Compressor`, by one allreduce of
summable payloads or an allgather of the others, and runs a compressor's further rounds
(PowerSGD's Q, fp16's overflow retry) one at a time (:class:`Rounds`), so a caller holding many
buckets can start every bucket's next round before it waits for any.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parlay import comm
from parlay.compress.base import CommStats, Compressor
from parlay.compress.ctxwire import decode_ctx, encode_ctx

__all__ = ["reduce_async", "further_rounds", "local_round_trip", "has_rounds", "AllOf", "Rounds",
           "RoundsHandle", "payload_bytes"]


def payload_bytes(ts: list[torch.Tensor]) -> int:
    """The bytes a payload puts on the wire."""
    return sum(t.numel() * t.element_size() for t in ts)


def further_rounds(compressor: Compressor, reduced: list[torch.Tensor], ctx: Any,
                   stats: CommStats | None,
                   reduce: Callable[[list[torch.Tensor]], list[torch.Tensor]]
                   ) -> list[torch.Tensor]:
    """Run a summable compressor's further rounds (:meth:`Compressor.next_round`, e.g.
    PowerSGD's Q or fp16's overflow retry) with ``reduce`` summing each round's payload over
    the group; returns the last reduced payload."""
    more = getattr(compressor, "next_round", None)  # duck-typed compressors may lack it
    while more is not None:
        nxt = more(reduced, ctx)
        if nxt is None:
            break
        if stats is not None:
            stats.add_wire(payload_bytes(nxt))
        reduced = reduce(nxt)
    return reduced


def local_round_trip(compressor: Compressor, flat: torch.Tensor, key: str,
                     world: int = 1, into: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's codec work on a bucket, with no collective: what timing a codec measures.

    A summable compressor encodes ``flat``, runs its further rounds on its own payload (standing
    in for the group's sum) and decodes; any other decodes ``world`` copies of its payload, as
    after an allgather. Compressors that can decode into ``into`` (a buffer like ``flat``) do,
    as the optimizer's step decodes into its bucket.

    Returns:
        The decoded bucket (``world`` times ``flat``'s encoding for an allgather compressor).
    """
    payload, ctx = compressor.compress(flat, key)
    kw = {"out": into} if into is not None and compressor.decodes_into else {}
    if _summable(compressor, ctx):
        reduced = further_rounds(compressor, payload, ctx, None, lambda nxt: nxt)
        return compressor.decompress(reduced, ctx, **kw)
    return compressor.aggregate([payload] * world, ctx, **kw)


def reduce_async(flat: torch.Tensor, compressor: Compressor, key: str, group: Any = None,
                 average: bool = False, stats: CommStats | None = None,
                 into: torch.Tensor | None = None) -> comm.Handle:
    """Start the compressed sum (or mean) of ``flat`` over ``group``.

    Args:
        flat: 1-D bucket (not modified unless the compressor is the identity).
        compressor: How to encode the bucket.
        key: Stable bucket identifier for stateful compressors.
        group: Process group (default: world).
        average: Divide the sum by the group size.
        stats: Accumulates dense vs wire bytes.
        into: A tensor like ``flat`` (``flat`` itself is allowed: the compressor is done with
            it once the rounds finish) that compressors with ``decodes_into`` decode into,
            sparing a bucket-sized allocation per step; ``wait()`` then returns ``into``.
            Others ignore it (compare the result with ``into`` before copying).

    Returns:
        A handle whose ``wait()`` returns the reduced flat tensor (dtype of ``flat``). Further
        rounds (:meth:`Compressor.next_round`) run inside ``wait()`` (``is_completed()`` is
        False until then). ``name``: the collective (``"allreduce"`` or ``"allgather"``).
        For compressors with ``rounds > 1`` it is a :class:`RoundsHandle`.
    """
    world = comm.group_size(group)
    payload, ctx = compressor.compress(flat, key)
    if stats is not None:
        stats.add(flat.numel() * flat.element_size(), payload_bytes(payload))
    if _summable(compressor, ctx):
        works = [comm.allreduce(p, "sum", group=group, async_op=True) for p in payload]
        rounds = Rounds(compressor, ctx, payload, works, group, stats)

        def finish() -> torch.Tensor:
            reduced = rounds.result()
            if into is not None and getattr(compressor, "decodes_into", False):
                out = compressor.decompress(reduced, ctx, out=into)
            else:
                out = compressor.decompress(reduced, ctx)
            return out.div_(world) if average else out
        if getattr(compressor, "rounds", 1) > 1:  # the rounds wait for their own works
            return RoundsHandle(AllOf([], settled=False), "allreduce", finish, rounds)
        return comm.Handle(AllOf(works, settled=not has_rounds(compressor)), "allreduce", finish)
    ctxs = None if compressor.shared_ctx else \
        comm.allgather(encode_ctx(ctx), group=group, async_op=True, parts=True)
    outs = [p.new_empty((world * p.numel(),)) for p in payload]
    works = [comm.allgather_into(o, p.reshape(-1), group=group, async_op=True)
             for o, p in zip(outs, payload)]

    def finish_gather() -> torch.Tensor:
        for w in works:
            w.wait()
        per_rank = [[o.view(world, -1)[r].view(p.shape) for o, p in zip(outs, payload)]
                    for r in range(world)]
        codes = ctxs.wait() if ctxs is not None else []
        if any(not torch.equal(c, codes[0]) for c in codes):  # each payload with its own ctx
            decoded = [compressor.decompress(p, decode_ctx(c, ctx))
                       for p, c in zip(per_rank, codes)]
            out = sum(decoded[1:], decoded[0])
        elif into is not None and getattr(compressor, "decodes_into", False):
            out = compressor.aggregate(per_rank, ctx, out=into)
        else:
            out = compressor.aggregate(per_rank, ctx)
        return out.div_(world) if average else out

    return comm.Handle(AllOf(works, settled=not has_rounds(compressor)), "allgather",
                       finish_gather)


def _summable(compressor: Compressor, ctx: Any) -> bool:
    ask = getattr(compressor, "is_summable", None)  # duck-typed compressors may lack it
    return bool(ask(ctx)) if ask is not None else bool(getattr(compressor, "summable", True))


class Rounds:
    """A summable compressor's collective rounds, run one at a time: :meth:`advance` waits for
    the round in flight and starts the next without waiting for it, so a caller holding many
    buckets can start every bucket's second round (PowerSGD's Q) before it waits for any, and
    the link carries bucket k's while bucket k+1's is computed."""

    def __init__(self, compressor: Compressor, ctx: Any, payload: list[torch.Tensor],
                 works: list[comm.Handle], group: Any, stats: CommStats | None) -> None:
        self.compressor, self.ctx, self.group, self.stats = compressor, ctx, group, stats
        self.payload, self.works, self.done = payload, works, False

    def advance(self) -> None:
        """Finish the round in flight and start the next (if any)."""
        if self.done:
            return
        for w in self.works:
            w.wait()
        more = getattr(self.compressor, "next_round", None)  # duck-typed ones may lack it
        nxt = more(self.payload, self.ctx) if more is not None else None
        if nxt is None:
            self.works, self.done = [], True
            return
        if self.stats is not None:
            self.stats.add_wire(payload_bytes(nxt))
        self.payload = nxt
        self.works = [comm.allreduce(p, "sum", group=self.group, async_op=True) for p in nxt]

    def result(self) -> list[torch.Tensor]:
        """Run the remaining rounds; the last reduced payload."""
        while not self.done:
            self.advance()
        return self.payload


class RoundsHandle(comm.Handle):
    """The handle of a reduction with further rounds; :meth:`advance` starts the next one."""

    def __init__(self, work: Any, op: str, finish: Callable[[], Any], rounds: Rounds) -> None:
        super().__init__(work, op, finish)
        self.rounds = rounds

    def advance(self) -> None:
        """Wait for the round in flight and start the next, without waiting for it."""
        self.rounds.advance()


class AllOf:
    """Started handles seen as one c10d-like work, for a :class:`comm.Handle` whose
    ``finish`` runs after them. ``settled=False`` when ``finish`` itself communicates (further
    rounds): ``is_completed()`` then stays False until the handle's ``wait()`` ran it. Each
    part is waited once (a second wait of a gloo reduce-scatter copies its result out again).
    """

    def __init__(self, parts: list[comm.Handle], settled: bool = True) -> None:
        self.parts, self.settled = list(parts), settled

    def is_completed(self) -> bool:
        return self.settled and all(p.is_completed() for p in self.parts)

    def wait(self) -> None:
        for p in self.parts:
            p.wait()


def has_rounds(compressor: Compressor) -> bool:
    """Whether ``compressor`` may run further collective rounds after the first (its
    :meth:`Compressor.next_round` is its own, not the base class's)."""
    more = getattr(type(compressor), "next_round", None)
    return more is not None and more is not Compressor.next_round
