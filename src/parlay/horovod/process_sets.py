"""Process sets: Horovod's name for a subset of ranks that runs collectives together.

Here a process set *is* process groups over its ranks: ``group()``, a torch group used directly
(DistributedOptimizer buckets, parameter broadcasts), and the private backends on which its
name-matched operations are negotiated and run (:mod:`parlay.horovod.engine`,
:class:`~parlay.horovod.groups.Group`), so that they never interleave with the calling
code's own collectives. Adding or removing a set is collective: every rank of the world calls
it, in the same order, as with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``. ``root_rank`` arguments stay
*global* ranks, as in Horovod.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from parlay import runtime
from parlay.errors import ConfigError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "stop_all"]

# id -> set, for the current init generation (runtime.generation(): groups made before the last
# shutdown/init are dead, so a set from an older generation is stale)
_sets: dict[int, ProcessSet] = {}
_next_id = 1


class ProcessSet:
    """A sorted set of global ranks that runs collective operations together.

    Build one from a list of ranks and pass it to :func:`add_process_set` (every rank calls
    it), then give it as ``process_set=`` to any operation. ``rank()`` and ``size()`` are
    relative to the set; ``root_rank`` arguments of broadcasts are global ranks.

    Args:
        ranks: Global ranks in the set (any order, no duplicates).

    Raises:
        ConfigError: ``ranks`` is not a collection of distinct ints.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        try:
            ranks = sorted(ranks)
        except TypeError:
            raise ConfigError("ProcessSet takes a list of global ranks, e.g. ProcessSet([0, 2]); "
                              f"got {ranks!r}.") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ConfigError(f"ProcessSet ranks must be ints, got {ranks!r}.")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"ProcessSet ranks must be distinct, got {ranks!r}.")
        self.ranks: list[int] = list(ranks)
        self.process_set_id: int | None = None
        self._group: Any = None           # torch group for the calling thread (None: world)
        self._engine: Any = None          # negotiation engine (it owns a private group)
        self._generation = -1

    # ------------------------------------------------------------------ Horovod API
    def included(self) -> bool | None:
        """Whether this process is in the set (``None`` before parlay is initialised)."""
        if not runtime.is_initialized():
            return None
        return self is global_process_set or runtime.rank() in self.ranks

    def size(self) -> int | None:
        """Number of ranks in the set (``None`` if the set is not registered)."""
        if self is global_process_set:
            return runtime.size() if runtime.is_initialized() else None
        return len(self.ranks) if self._valid() else None

    def rank(self) -> int | None:
        """This process's rank within the set (``None`` if not registered or not a member)."""
        if not runtime.is_initialized():
            return None
        if self is global_process_set:
            return runtime.rank()
        if not self._valid() or runtime.rank() not in self.ranks:
            return None
        return self.ranks.index(runtime.rank())

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    # ------------------------------------------------------------------ parlay internals
    def _valid(self) -> bool:
        return self.process_set_id is not None and self._generation == runtime.generation()

    def group(self) -> Any:
        """The torch process group of this set for direct use (``None`` means the world).

        Raises:
            ConfigError: The set is not registered, or this rank is not a member.
        """
        self._check_member()
        return None if self is global_process_set else self._group

    def engine_prefix(self) -> str:
        """Store prefix of this set's engine group: unique per set id and init generation."""
        self._check_member()
        return f"parlay.horovod/init{runtime.generation()}/set{self.process_set_id}"

    def global_ranks(self) -> list[int]:
        """Global ranks of the members, in set-rank order."""
        return list(range(runtime.size())) if self is global_process_set else list(self.ranks)

    def _check_member(self) -> None:
        if not runtime.is_initialized():
            raise ConfigError("parlay is not initialised. Hint: call hvd.init() first.")
        if self is global_process_set:
            if self._generation != runtime.generation():
                self._reset()
                self._generation = runtime.generation()
            return
        if not self._valid():
            raise ConfigError(f"{self!r} is not registered (never added, removed, or added "
                              "before the last shutdown). Hint: hvd.add_process_set(ranks) on "
                              "every rank after hvd.init().")
        if runtime.rank() not in self.ranks:
            raise ConfigError(f"rank {runtime.rank()} is not in {self!r}; only its members may "
                              "run operations on it.")

    def _reset(self) -> None:
        self._engine = None
        self._group = None


#: The set of all ranks; the default ``process_set`` of every operation.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank of the world must call this, in the same order.

    Args:
        process_set: A :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered set (the object passed in, when it was a ProcessSet).

    Raises:
        ConfigError: Bad ranks, or a set with the same ranks is already registered
            (a ``ValueError``, as in Horovod).
    """
    global _next_id
    pset = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = runtime.size()
    if not pset.ranks or pset.ranks[0] < 0 or pset.ranks[-1] >= world:
        raise ConfigError(f"process set ranks must be non-empty and in [0, {world}), "
                          f"got {pset.ranks}.")
    gen = runtime.generation()
    _purge(gen)
    if pset.ranks == list(range(world)) or any(s.ranks == pset.ranks for s in _sets.values()):
        raise ConfigError(f"Attempted to add a duplicate process set: {pset.ranks} is "
                          "already registered (the world is global_process_set).")
    pset.process_set_id, _next_id = _next_id, _next_id + 1
    _sets[pset.process_set_id] = pset
    # Collective over the whole world, in the same order on every rank.
    pset._group = runtime.new_group(pset.ranks)
    pset._engine = None
    pset._generation = gen
    return pset


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls this); returns whether it was registered.

    The global process set is never removed. A member's pending operations on the set are
    completed or failed first.
    """
    if process_set is global_process_set or not process_set._valid():
        return False
    _sets.pop(process_set.process_set_id or 0, None)
    engine, process_set._engine = process_set._engine, None
    if engine is not None:
        engine.close()
    g = process_set._group
    if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g)
    process_set._reset()
    process_set.process_set_id = None
    return True


def _purge(gen: int) -> None:
    # Ids are never reused within an init generation: they name the engines' store prefixes.
    stale = [k for k, s in _sets.items() if s._generation not in (gen, -1)]
    for k in stale:
        s = _sets.pop(k)
        s._reset()
        s.process_set_id = None


def stop_all() -> None:
    """At shutdown: close every set's engine (what never ran fails), then forget the sets."""
    global _next_id
    for s in [global_process_set, *_sets.values()]:
        if s._engine is not None:
            s._engine.close()
        s._reset()
    for s in _sets.values():
        s.process_set_id = None
    _sets.clear()
    _next_id = 1
