"""Topology-aware (hierarchical) allreduce: reduce inside each host, then across hosts.

A flat ring allreduce over ``n`` hosts of ``l`` ranks sends ``2(nl-1)/(nl)`` of the bucket out
of every rank, and the ring crosses each host boundary, so each host link carries about 1.5
models per step at 2 x 2. Here, per bucket:

1. **reduce-scatter inside the host**: local rank ``j`` ends with shard ``j`` of the host's sum;
2. **allreduce across hosts** of shard ``j`` among the ranks with local rank ``j`` (one ring per
   local rank, each over ``1/l`` of the bucket);
3. **allgather inside the host**: every rank gets the whole sum.

Only step 2 uses host links: ``2(n-1)/n`` of the model per host and step (one model at n = 2),
split over ``l`` parallel rings. This is the scheme of Horovod's hierarchical allreduce and of
NCCL's tree/ring split, built from c10d collectives on subgroups. The sum is the same as the
flat one up to floating-point summation order.

Step 2 of a bucket starts as soon as its step 1 has finished (checked without blocking each time
another bucket becomes ready), so the host link works during backward, as the flat path's
overlap does. Steps 1 and 3 use two different local groups, so each group sees its collectives
in one fixed order on every rank (bucket order), whatever the interleaving of buckets.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm, runtime
from parlay.compress.base import (AllOf, CommStats, Compressor, _nbytes, further_rounds,
                                  has_rounds)
from parlay.errors import ConfigError

__all__ = ["Topology", "HierarchicalReducer", "make_reducer"]

_reduce_scatter = comm.reduce_scatter_single   # the one shim over torch's renames


@dataclass(frozen=True)
class Topology:
    """Which members of a group share a host. Pure.

    Attributes:
        hosts: For each host (in order of first appearance), the group ranks on it, ascending.
    """

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_node_ids(cls, node_ids: list[int]) -> "Topology":
        """Group ranks by host: ``node_ids[r]`` is the host of group rank ``r``."""
        order: dict[int, list[int]] = {}
        for r, node in enumerate(node_ids):
            order.setdefault(int(node), []).append(r)
        return cls(tuple(tuple(v) for v in order.values()))

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @property
    def local_size(self) -> int:
        """Ranks per host (the largest, when not uniform)."""
        return max(len(h) for h in self.hosts)

    @property
    def worthwhile(self) -> bool:
        """Several hosts with several ranks each, evenly spread: hierarchy saves host traffic."""
        return self.num_hosts > 1 and self.local_size > 1 and self.uniform

    def local_group(self, rank: int) -> tuple[int, ...]:
        """Group ranks on ``rank``'s host."""
        return next(h for h in self.hosts if rank in h)

    def cross_group(self, rank: int) -> tuple[int, ...]:
        """One group rank per host: those with ``rank``'s local index."""
        j = self.local_group(rank).index(rank)
        return tuple(h[j] for h in self.hosts)


def _node_rank() -> int:
    from parlay import runtime

    if runtime.is_initialized():
        return runtime.cross_rank()
    from parlay.env import detect

    return detect().node_rank


def discover(group: Any = None) -> Topology:
    """Which members of ``group`` share a host (a collective over ``group``)."""
    dev = comm.group_device(group)  # a NCCL-only group gathers CUDA tensors only
    mine = torch.tensor([_node_rank()], dtype=torch.int64, device=dev)
    every = torch.empty(comm.group_size(group), dtype=torch.int64, device=dev)
    comm.allgather_into(every, mine, group=group)
    return Topology.from_node_ids(every.tolist())


def _new_group(group: Any, members: tuple[int, ...]) -> Any:
    ranks = [comm.to_global_rank(group, r) for r in members]
    with comm.comm_errors("new_group"):
        # Only the members call: ranks of other groups (other stages, other hosts) need not.
        return runtime.new_group(ranks, use_local_synchronization=True)


class HierarchicalReducer:
    """Sums buckets host-first over ``group``; see the module docstring.

    Args:
        group: The process group the optimizer reduces over (``None``: the world).
        topology: Hosts of the group's members; must be :attr:`Topology.uniform`.
    """

    def __init__(self, group: Any, topology: Topology) -> None:
        if not topology.uniform:
            raise ConfigError(f"hierarchical allreduce needs the same number of ranks on every "
                              f"host, got {[len(h) for h in topology.hosts]} ranks per host. "
                              "Hint: launch the same -n on every node, or hierarchical=False.")
        me = comm.group_rank(group)
        self.topology = topology
        self.local_size = topology.local_size
        self.num_hosts = topology.num_hosts
        self.local_index = topology.local_group(me).index(me)
        local = topology.local_group(me)
        self._scatter_group = _new_group(group, local)
        self._gather_group = _new_group(group, local)
        self._cross_group = _new_group(group, topology.cross_group(me))
        self.cross_bytes = 0
        self._pending: list[_Bucket] = []

    def _cross_sent(self, part: torch.Tensor) -> None:
        # What this rank's ring across hosts sends over the host link for one shard.
        self.cross_bytes += int(2 * (self.num_hosts - 1) / self.num_hosts
                                * part.numel() * part.element_size())

    def _scatter(self, payload: list[torch.Tensor]) -> "_Bucket":
        """Step 1 for every tensor of ``payload``, started asynchronously."""
        ls = self.local_size
        bk = _Bucket([p.numel() for p in payload], [p.shape for p in payload])
        for p, k in zip(payload, bk.numels):
            if k % ls == 0 and p.is_contiguous():
                # In place: the sum is gathered back into the payload (often the bucket itself),
                # which step 1 has finished reading by then.
                pad = p.view(-1)
            else:
                pad = p.reshape(-1).new_zeros(-(-k // ls) * ls)
                pad[:k] = p.reshape(-1)
            part = pad.new_empty(pad.numel() // ls)
            with comm.comm_errors("allreduce"):
                bk.scatter.append(_reduce_scatter(part, pad, group=self._scatter_group,
                                                  async_op=True))
            bk.padded.append(pad)
            bk.parts.append(part)
        return bk

    def _cross(self, bk: "_Bucket") -> None:
        """Step 2, started asynchronously once step 1 is done (waits for it)."""
        for w in bk.scatter:
            w.wait()
        with comm.comm_errors("allreduce"):
            bk.cross = [dist.all_reduce(part, group=self._cross_group, async_op=True)
                        for part in bk.parts]
        for part in bk.parts:
            self._cross_sent(part)

    def _gather(self, bk: "_Bucket") -> list[torch.Tensor]:
        """Step 3 (waits for step 2); returns the summed tensors."""
        assert bk.cross is not None
        for w in bk.cross:
            w.wait()
        for pad, part in zip(bk.padded, bk.parts):
            comm.allgather_into(pad, part, group=self._gather_group)
        return [pad[:k].view(shape) for pad, k, shape in zip(bk.padded, bk.numels, bk.shapes)]

    def _advance(self) -> None:
        """Start step 2 of pending buckets whose step 1 finished, in bucket order, without
        blocking: the host link then works while backward still runs."""
        for bk in self._pending:
            if bk.cross is not None:
                continue
            if not all(w.is_completed() for w in bk.scatter):
                break
            self._cross(bk)

    def _allreduce(self, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        """All three steps for a further round of a compressor (blocking)."""
        bk = self._scatter(payload)
        self._cross(bk)
        return self._gather(bk)

    def reduce_async(self, flat: torch.Tensor, compressor: Compressor, key: str,
                     stats: CommStats | None = None) -> comm.Handle:
        """Start the sum of ``flat`` (compressed by a summable ``compressor``) over the group.

        Returns:
            A handle whose ``wait()`` returns the summed flat tensor (dtype of ``flat``).
        """
        payload, ctx = compressor.compress(flat, key)
        if stats is not None:
            stats.add(flat.numel() * flat.element_size(), _nbytes(payload))
        # Further rounds (PowerSGD's Q, fp16's overflow retry) run inside wait() and use the
        # same groups, so buckets may only run ahead when there can be none.
        eager = not has_rounds(compressor)
        bk = self._scatter(payload)
        if eager:
            self._pending.append(bk)
            self._advance()

        def finish() -> torch.Tensor:
            if eager:
                # Queue step 2 of every bucket launched so far (in order): the host link then
                # never idles while this rank gathers inside its host.
                for b in self._pending:
                    if b.cross is None:
                        self._cross(b)
                self._pending.remove(bk)
            else:
                self._cross(bk)
            reduced = self._gather(bk)
            if eager:
                self._advance()
            reduced = further_rounds(compressor, reduced, ctx, stats, self._allreduce)
            return compressor.decompress(reduced, ctx)

        # Step 3 (and any further round) runs inside wait(): complete only after it. (The
        # step-1 works are waited by _cross, once: a second wait of a gloo reduce-scatter
        # copies its result out again, over what step 2 made of it.)
        return comm.Handle(AllOf([], settled=False), "hierarchical allreduce", finish)


@dataclass
class _Bucket:
    """One bucket's payload on its way through the three steps."""

    numels: list[int]
    shapes: list[Any]
    padded: list[torch.Tensor] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    scatter: list[Any] = field(default_factory=list)
    cross: list[Any] | None = None


def make_reducer(hierarchical: Any, group: Any, compressor: Compressor,
                 world: int) -> HierarchicalReducer | None:
    """The reducer for ``DistributedOptimizer(hierarchical=...)``, or ``None`` for flat.

    Args:
        hierarchical: ``False``, ``True`` or ``"auto"`` (hierarchical when the group spans
            several hosts with several ranks on each and the compressor is summable).
        group: The optimizer's process group.
        compressor: The optimizer's compressor.
        world: Size of ``group``.

    Raises:
        ConfigError: A bad value, or ``True`` where it cannot apply (allgather compressors).
    """
    if hierarchical is False or hierarchical is None:
        return None
    if hierarchical is not True and hierarchical != "auto":
        raise ConfigError(f"hierarchical must be False, True or 'auto', got {hierarchical!r}.")
    if not getattr(compressor, "summable", True):
        if hierarchical is True:
            raise ConfigError(f"hierarchical=True needs a compressor whose payloads can be "
                              f"summed on the wire; {compressor!r} is allgathered. Hint: use "
                              "hierarchical='auto' (flat for such compressors) or e.g. 'fp16'.")
        return None
    if world == 1:
        return None
    topo = discover(group)
    if hierarchical == "auto" and not topo.worthwhile:
        return None
    if topo.num_hosts == 1 or topo.local_size == 1:
        warnings.warn(f"hierarchical=True on {topo.num_hosts} host(s) of {topo.local_size} "
                      "rank(s) each: there is no host link to spare, the reduction just takes "
                      "extra steps. Hint: hierarchical='auto' decides by topology.", stacklevel=3)
    return HierarchicalReducer(group, topo)
