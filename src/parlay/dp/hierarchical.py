"""Topology-aware (hierarchical) allreduce: reduce inside each host, then across hosts.

A flat ring allreduce over ``n`` hosts of ``l`` ranks sends ``2(nl-1)/(nl)`` of the bucket out
of every rank, and the ring crosses each host boundary, so each host link carries about 1.5
models per step at 2 x 2. Here, per bucket:

1. **sum inside the host**: an allreduce among the host's ranks (loopback or shared memory);
2. **allreduce across hosts** of shard ``j`` (``1/l`` of the bucket) among the ranks with local
   rank ``j``: one ring per local rank, each over its own shard;
3. **share inside the host**: each rank zeroes every shard but its own and the host's ranks
   allreduce again, which hands every rank the whole sum exactly (``x + 0 == x``).

Only step 2 uses host links: ``2(n-1)/n`` of the model per host and step (one model at n = 2),
split over ``l`` parallel rings. This is the scheme of Horovod's hierarchical allreduce and of
NCCL's tree/ring split, built from c10d collectives on subgroups. The sum is the same as the
flat one up to floating-point summation order. Steps 1 and 3 are allreduces rather than a
reduce-scatter and an all-gather: gloo's allreduce is faster for the same bucket, and its
reduce-scatter spends much of its launch on the calling thread, which held up backward
(figures in docs/benchmarks.md, "Design measurements").

Step 2 of a bucket starts the moment its step 1 finishes, also while backward still runs: a
helper thread (one per step) waits for step 1 of each bucket in turn, starts its step 2,
waits for it and starts its step 3. Buckets cross the host link one after the other, so
bucket k's step 3 runs while bucket k+1 crosses and only the last bucket's is left when the
link is done. Steps 1 and 3 use two different local groups (step 1 is started by the
caller's thread, step 3 by the helper), and only the helper uses the cross-host group, so each
group sees its collectives in one fixed order on every rank (bucket order). Compressors with
further rounds (PowerSGD's Q, fp16's overflow retry) run all three steps in ``wait()``.
"""
from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from parlay import comm, runtime
from parlay.compress.base import CommStats, Compressor
from parlay.compress.reduce import AllOf, further_rounds, has_rounds, payload_bytes
from parlay.errors import CommError, ConfigError

__all__ = ["Topology", "HierarchicalReducer", "make_reducer", "host_topology", "host_groups"]


@dataclass(frozen=True)
class Topology:
    """Which members of a group share a host. Pure.

    Attributes:
        hosts: For each host (in order of first appearance), the group ranks on it, ascending.
    """

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_node_ids(cls, node_ids: list[int]) -> Topology:
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


def host_groups(group: Any = None) -> tuple[Any, Any]:
    """``(host, cross)``: the group of this rank's host, and the group of one rank per host
    (those with this rank's local index); e.g. data parallel inside each host and local
    updates across hosts. A collective over ``group``.

    Raises:
        ConfigError: The hosts hold different numbers of ranks.
    """
    topo = discover(group)
    if not topo.uniform:
        raise ConfigError(f"host groups need the same number of ranks on every host, got "
                          f"{[len(h) for h in topo.hosts]}. Hint: launch the same -n on every "
                          "node.")
    me = comm.group_rank(group)
    return _new_group(group, topo.local_group(me)), _new_group(group, topo.cross_group(me))


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
        self._sum_group = _new_group(group, local)     # step 1: started by the caller
        self._share_group = _new_group(group, local)   # step 3: started by the helper
        self._cross_group = _new_group(group, topology.cross_group(me))
        self.cross_bytes = 0
        self._helper: _Helper | None = None
        self._open = 0  # buckets handed to the helper this step and not waited for yet

    # ----------------------------------------------------------------- the three steps
    def _sum_local(self, payload: list[torch.Tensor]) -> _Bucket:
        """Step 1 for every tensor of ``payload``, started asynchronously."""
        ls = self.local_size
        bk = _Bucket([p.numel() for p in payload], [p.shape for p in payload])
        for p, k in zip(payload, bk.numels):
            if k % ls == 0 and p.is_contiguous():
                flat = p.view(-1)  # in place: the sum lands in the payload (often the bucket)
            else:  # padded to equal shards
                flat = p.reshape(-1).new_zeros(-(-k // ls) * ls)
                flat[:k] = p.reshape(-1)
            bk.flats.append(flat)
            bk.works.append(comm.allreduce(flat, "sum", group=self._sum_group, async_op=True))
        return bk

    def _shard(self, flat: torch.Tensor) -> slice:
        n = flat.numel() // self.local_size
        return slice(self.local_index * n, (self.local_index + 1) * n)

    def _cross(self, bk: _Bucket) -> None:
        """Wait for step 1, then step 2 (blocking: one bucket on the host link at a time)."""
        for w in bk.works:
            w.wait()
        works = []
        for flat in bk.flats:
            part = flat[self._shard(flat)]
            if part.numel():
                works.append(comm.allreduce(part, "sum", group=self._cross_group,
                                            async_op=True))
                self.cross_bytes += int(2 * (self.num_hosts - 1) / self.num_hosts
                                        * part.numel() * part.element_size())
        for w in works:
            w.wait()

    def _share(self, bk: _Bucket) -> None:
        """Step 3, started asynchronously (step 2 is done)."""
        bk.works = []
        for flat in bk.flats:
            mine = self._shard(flat)
            flat[: mine.start].zero_()
            flat[mine.stop:].zero_()
            bk.works.append(comm.allreduce(flat, "sum", group=self._share_group, async_op=True))

    def _result(self, bk: _Bucket) -> list[torch.Tensor]:
        for w in bk.works:
            w.wait()
        return [flat[:k].view(shape) for flat, k, shape in zip(bk.flats, bk.numels, bk.shapes)]

    def _allreduce(self, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        """All three steps on the calling thread (a compressor's further rounds)."""
        bk = self._sum_local(payload)
        self._cross(bk)
        self._share(bk)
        return self._result(bk)

    # ----------------------------------------------------------------- the helper thread
    def _hand_over(self, bk: _Bucket) -> None:
        if self._helper is None:
            self._helper = _Helper(self)
        self._helper.todo.put(bk)
        self._open += 1

    def _await(self, bk: _Bucket) -> list[torch.Tensor]:
        helper = self._helper
        assert helper is not None
        while not bk.crossed.wait(1.0):
            if not helper.is_alive():
                raise CommError("hierarchical allreduce: its helper thread ended before the "
                                "bucket crossed hosts", op="hierarchical allreduce")
        self._open -= 1
        if self._open == 0:  # the step's last bucket: the helper ends, the next step starts one
            helper.todo.put(None)
            self._helper = None
        if bk.error is not None:
            raise bk.error
        return self._result(bk)

    def reduce_async(self, flat: torch.Tensor, compressor: Compressor, key: str,
                     stats: CommStats | None = None) -> comm.Handle:
        """Start the sum of ``flat`` (compressed by a summable ``compressor``) over the group.

        Returns:
            A handle whose ``wait()`` returns the summed flat tensor (dtype of ``flat``).
        """
        payload, ctx = compressor.compress(flat, key)
        if stats is not None:
            stats.add(flat.numel() * flat.element_size(), payload_bytes(payload))
        # Further rounds (PowerSGD's Q, fp16's overflow retry) run inside wait() and use the
        # same groups from this thread, so the helper only serves compressors without them.
        eager = not has_rounds(compressor)
        bk = self._sum_local(payload)
        if eager:
            self._hand_over(bk)

        def finish() -> torch.Tensor:
            if eager:
                reduced = self._await(bk)
            else:
                self._cross(bk)
                self._share(bk)
                reduced = further_rounds(compressor, self._result(bk), ctx, stats,
                                         self._allreduce)
            return compressor.decompress(reduced, ctx)

        # Complete only after wait(): step 3 (and any further round) finishes there.
        return comm.Handle(AllOf([], settled=False), "hierarchical allreduce", finish)


class _Helper(threading.Thread):
    """Steps 2 and 3 of each bucket handed over, in order; ends at ``None``. After a failure
    it starts no further collective: the remaining buckets get the same error."""

    def __init__(self, reducer: HierarchicalReducer) -> None:
        super().__init__(name="parlay-hierarchical", daemon=True)
        self.reducer = reducer
        self.todo: queue.SimpleQueue[_Bucket | None] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        error: BaseException | None = None
        while (bk := self.todo.get()) is not None:
            try:
                if error is None:
                    self.reducer._cross(bk)
                    self.reducer._share(bk)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                error = e
            bk.error = error
            bk.crossed.set()


@dataclass
class _Bucket:
    """One bucket's payload on its way through the three steps."""

    numels: list[int]
    shapes: list[Any]
    flats: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    crossed: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def make_reducer(hierarchical: Any, group: Any, compressor: Compressor,
                 world: int) -> HierarchicalReducer | None:
    """The reducer for ``DistributedOptimizer(hierarchical=...)``, or ``None`` for flat
    (arguments and errors as for :func:`host_topology`)."""
    topo = host_topology(hierarchical, group, compressor, world)
    return HierarchicalReducer(group, topo) if topo is not None else None


def host_topology(hierarchical: Any, group: Any, compressor: Compressor,
                  world: int) -> Topology | None:
    """The hosts to reduce over host first for ``hierarchical=...``, or ``None`` for flat.

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
                      "extra steps. Hint: hierarchical='auto' decides by topology.", stacklevel=4)
    if not topo.uniform:
        raise ConfigError(f"hierarchical reduction needs the same number of ranks on every "
                          f"host, got {[len(h) for h in topo.hosts]} ranks per host. Hint: "
                          "launch the same -n on every node, or hierarchical=False.")
    return topo
