"""Reduce-scatter and all-gather that move a ring's bytes on every backend.

The sharded levels of :class:`~parlay.dp.optimizer.DistributedOptimizer` need a reduce-scatter
and an all-gather that each carry ``(N-1)/N`` of a buffer per rank, as a ring does. NCCL's own
collectives do. Gloo's do not on torch 2.13: its reduce-scatter is an allreduce underneath and
its all-gather is slower than point-to-point transfers (measured in ``docs/benchmarks.md``). So
on gloo they are written here over c10d's batched point-to-point operations: the reduce-scatter
as a ring, in ``N-1`` steps of one chunk each, the all-gather as one round in which every rank
sends its chunk to every other (the same bytes per rank as a ring, without ``N-2`` waits).

Every buffer is ``N`` equal chunks (padded by the caller); rank ``r`` owns chunk ``r`` (with
:class:`HostRing`, chunk ``local_rank * hosts + host``). The
operations run on a :class:`CommThread`, one per sharded optimizer, in submission order, so they
overlap the computation of the calling thread while every rank issues them in the same order.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from parlay import comm, runtime

__all__ = ["Ring", "HostRing", "CommThread"]

T = TypeVar("T")


class Ring:
    """Reduce-scatter and all-gather over ``group`` (its own group: see :class:`CommThread`).

    Args:
        group: The process group (``None``: the world).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        self.native = self.size > 1 and dist.get_backend(group) != "gloo"
        if self.size > 1:
            self._next = comm.to_global_rank(group, (self.rank + 1) % self.size)
            self._prev = comm.to_global_rank(group, (self.rank - 1) % self.size)
            self._peers = [comm.to_global_rank(group, j) for j in range(self.size)]
        self._scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def _chunk(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        c = buf.numel() // self.size
        i %= self.size
        return buf[i * c:(i + 1) * c]

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if send.is_cuda:  # gloo moves host memory only: through the host and back
            host = torch.empty(recv.shape, dtype=recv.dtype)
            self._exchange(send.cpu(), host)
            recv.copy_(host)
            return
        ops = [dist.P2POp(dist.isend, send, self._next, self.group),
               dist.P2POp(dist.irecv, recv, self._prev, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def reduce_scatter(self, buf: torch.Tensor) -> torch.Tensor:
        """Sum ``buf`` over the group in place; returns this rank's chunk of the sum (a view of
        ``buf``; the other chunks hold partial sums afterwards)."""
        mine = self._chunk(buf, self.rank)
        if self.size == 1:
            return mine
        with comm.comm_errors("reduce_scatter", group=self.group):
            if self.native:
                out = torch.empty_like(mine)
                comm.reduce_scatter_single(out, buf, group=self.group)
                return mine.copy_(out)
            key = (mine.numel(), buf.dtype)
            tmp = self._scratch.get(key)
            if tmp is None:
                tmp = self._scratch[key] = torch.empty_like(mine)
            # Step s: pass on the chunk summed so far, add the one arriving; after N-1 steps
            # chunk r holds every rank's contribution.
            for s in range(self.size - 1):
                self._exchange(self._chunk(buf, self.rank - s - 1), tmp)
                self._chunk(buf, self.rank - s - 2).add_(tmp)
        return mine

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        """Fill every chunk of ``buf`` from its owner (this rank's chunk must hold its part)."""
        if self.size == 1:
            return buf
        with comm.comm_errors("all_gather", group=self.group):
            if self.native:
                comm.all_gather_single(buf, self._chunk(buf, self.rank).clone(), group=self.group)
                return buf
            if buf.is_cuda:  # gloo moves host memory only: through the host and back
                return buf.copy_(self.all_gather(buf.cpu()))
            # Every peer's chunk straight from it, all at once: a ring's bytes per rank in one
            # round instead of N-1 (faster on gloo, see docs/benchmarks.md).
            mine, ops = self._chunk(buf, self.rank), []
            for j in range(self.size):
                if j != self.rank:
                    peer = self._peers[j]
                    ops += [dist.P2POp(dist.isend, mine, peer, self.group),
                            dist.P2POp(dist.irecv, self._chunk(buf, j), peer, self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return buf


class HostRing:
    """Reduce-scatter and all-gather host first (``shard=`` with ``hierarchical=``): the
    buffer is reduce-scattered inside the host into ``l`` chunks, then each chunk among the
    ranks of that local rank on every host into ``n`` pieces (all-gather the other way round).
    Each host link carries a flat ring's bytes of the whole model, split over ``l`` rings,
    and a rank ends with ``1/(l*n)`` of the buffer, as over a flat ring.

    Args:
        local: The ring among this host's ranks.
        cross: The ring among the ranks of this local rank on every host.
        everyone: A group of all of them (for small agreements on the communication thread).
    """

    def __init__(self, local: Ring, cross: Ring, everyone: Any) -> None:
        self.local, self.cross, self.group = local, cross, everyone
        self.size = local.size * cross.size
        self.rank = local.rank * cross.size + cross.rank  # the chunk this rank ends with

    def reduce_scatter(self, buf: torch.Tensor) -> torch.Tensor:
        return self.cross.reduce_scatter(self.local.reduce_scatter(buf))

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        self.cross.all_gather(self.local._chunk(buf, self.local.rank))
        return self.local.all_gather(buf)


class CommThread:
    """One background thread running a sharded optimizer's collectives in submission order.

    The collectives run on process groups of their own (made by ``group``'s members at
    construction, with the configured timeout), so they never interleave with what the
    calling thread sends on ``group`` meanwhile.

    Args:
        group: The ranks to communicate among (``None``: the world).
        hosts: For each host, the group ranks on it (same count on each): reduce host first
            (:class:`HostRing`). ``None``: one flat ring.
    """

    def __init__(self, group: Any = None,
                 hosts: tuple[tuple[int, ...], ...] | None = None) -> None:
        def new(members: list[int] | None) -> Any:
            if members is not None:
                members = [comm.to_global_rank(group, r) for r in members]
            return runtime.new_group(members, use_local_synchronization=True)

        own = group if comm.group_size(group) == 1 else new(
            None if group is None else list(range(comm.group_size(group))))
        self.ring: Ring | HostRing = Ring(own)
        if hosts is not None:
            me = comm.group_rank(group)
            host = next(h for h in hosts if me in h)
            cross = [h[host.index(me)] for h in hosts]
            self.ring = HostRing(Ring(new(list(host))), Ring(new(cross)), own)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parlay-shard")

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` after everything submitted before it; ``result()`` re-raises its error."""
        return self._pool.submit(fn)
