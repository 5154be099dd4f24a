"""Broadcast and gather of model and optimizer state, straight on c10d (through
:mod:`parlay.comm`), in the calling thread.

``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object`` and
``allgather_object`` are what the core (the Trainer's strategies, the pipeline) and scripts use
to start every rank from the same state. They run directly on the world, on a torch
``process_group=``, or on a ``process_set=``: any object with ``group()`` (its torch group,
``None`` for the world) and ``global_ranks()`` (its members, in set-rank order), such as a
``parlay.horovod.ProcessSet``. This module never imports :mod:`parlay.horovod`; Horovod
exports these very functions (``parlay.broadcast_parameters is
parlay.horovod.broadcast_parameters``). With a ``process_group``, ``root_rank`` counts within
that group; everywhere else it is a global rank.

The Horovod-named tensor collectives (``parlay.allreduce``, ``allgather``, ``broadcast`` and
their ``_async`` forms) keep Horovod's semantics (matched by name, join-aware, negotiated in
the calling thread) and so live in :mod:`parlay.horovod.functions`; ``parlay`` re-exports them
lazily. The core's own tensor collectives are :mod:`parlay.comm`'s.
"""
from __future__ import annotations

import collections
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from parlay import comm
from parlay._tree import map_tensors, tensors_in
from parlay.errors import ConfigError

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object", "coalesced_broadcast", "RankSet"]


class RankSet(Protocol):
    """A set of ranks that runs collectives on one torch group (e.g. ``hvd.ProcessSet``)."""

    def group(self) -> Any:
        """The set's torch process group (``None`` for the world)."""

    def global_ranks(self) -> list[int]:
        """The members' global ranks, in set-rank order."""


def _check_group_root(root_rank: int, group: Any) -> None:
    world = comm.group_size(group)
    if not isinstance(root_rank, int) or isinstance(root_rank, bool) or not 0 <= root_rank < world:
        raise ConfigError(f"root_rank must be an int in [0, {world}), got {root_rank!r}.")


def _set_group(process_set: Any) -> tuple[Any, list[int]]:
    """The torch group and members of ``process_set`` (``None``: the world)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("no process group: parlay is not initialised. Hint: call "
                          "parlay.init() (or hvd.init()) first.")
    if process_set is None:
        return None, list(range(dist.get_world_size()))
    if not (callable(getattr(process_set, "group", None))
            and callable(getattr(process_set, "global_ranks", None))):
        raise ConfigError(f"process_set must be a process set such as hvd.ProcessSet, got "
                          f"{type(process_set).__name__}. Hint: process_group= takes a torch "
                          "group.")
    return process_set.group(), list(process_set.global_ranks())


def _group_and_root(root_rank: int, process_set: Any, process_group: Any) -> tuple[Any, int]:
    """The torch group to use directly and the root's rank within it."""
    if process_group is not None:
        if process_set is not None and getattr(process_set, "process_set_id", None) != 0:
            raise ConfigError("pass either process_set= (Horovod) or process_group= (a torch "
                              "group), not both.")
        _check_group_root(root_rank, process_group)
        return process_group, root_rank
    group, members = _set_group(process_set)
    if isinstance(root_rank, bool) or root_rank not in members:
        raise ConfigError(f"root_rank must be a global rank in the process set {members}, "
                          f"got {root_rank!r}.")
    return group, members.index(root_rank)


# ------------------------------------------------------------------------------ state
def _same_everywhere(text: str, group: Any) -> bool:
    """Whether every rank of ``group`` passed the same ``text`` (one allreduce of its CRC)."""
    crc = zlib.crc32(text.encode())
    agree = torch.tensor([crc, -crc], dtype=torch.int64, device=comm.group_device(group))
    comm.allreduce(agree, "max", group=group)
    return int(agree[0]) == -int(agree[1])


def coalesced_broadcast(tensors: list[torch.Tensor], root_rank: int = 0,
                        process_group: Any = None, *, check: bool = True) -> None:
    """Broadcast tensors in place from group rank ``root_rank``, one message per dtype/device.

    Args:
        check: First check that every rank holds the same tensors (one more collective; off
            where the caller checked once already).

    Raises:
        ConfigError: On every rank, when the ranks hold different tensors (count, shapes or
            dtypes): a broadcast into other shapes would scramble them.
    """
    if check and not _same_everywhere(repr([(t.dtype, tuple(t.shape)) for t in tensors]),
                                      process_group):
        raise ConfigError("the ranks broadcast different tensors (their number, shapes or "
                          "dtypes differ), so the values cannot be copied. Hint: build the same "
                          "model (and optimizer) on every rank before broadcasting.")
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = \
        collections.defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        if flat.device.type == "cpu":  # NCCL alone carries no CPU tensors (e.g. Adam's step)
            flat = flat.to(comm.group_device(process_group))
        comm.broadcast(flat, src=root_rank, group=process_group)
        off = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[off: off + n].view_as(t))
                off += n


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any],
                         root_rank: int = 0, process_set: Any = None, *,
                         process_group: Any = None) -> None:
    """Overwrite every rank's tensors with root's, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``.
        root_rank: Rank whose values win (global; within ``process_group`` if given).
        process_set: Ranks to broadcast among (default: all).
        process_group: A torch group instead.

    Raises:
        ConfigError: ``params`` holds something other than tensors.
    """
    group, root = _group_and_root(root_rank, process_set, process_group)
    if isinstance(params, Mapping):
        items: list[Any] = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        try:
            items = list(params)
        except TypeError:
            raise ConfigError("broadcast_parameters expects model.state_dict(), "
                              "model.named_parameters() or model.parameters(); got "
                              f"{type(params).__name__}.") from None
        items = [it if isinstance(it, tuple) else (None, it) for it in items]
        if all(isinstance(n, str) for n, _ in items):
            items.sort(key=lambda kv: kv[0])
    tensors = []
    for item in items:
        if len(item) != 2:
            raise ConfigError("broadcast_parameters expects (name, tensor) pairs or tensors.")
        if isinstance(item[1], torch.Tensor):
            tensors.append(item[1])
        elif item[1] is not None:
            raise ConfigError(f"broadcast_parameters: {item[0]!r} is a "
                              f"{type(item[1]).__name__}, not a tensor.")
    coalesced_broadcast(tensors, root, group)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Any = None, process_set: Any = None, *,
                              process_group: Any = None) -> None:
    """Make every rank's optimizer state (buffers, step counts, hyper-parameters) root's.

    Works for every ``torch.optim`` optimizer, including ones newer than Horovod (and
    L-BFGS): the structure of root's ``state_dict()`` travels as a small object and its tensors
    as fused broadcasts, then each rank loads it, so hyper-parameters keep root's types.

    Args:
        optimizer: The optimizer (or a DistributedOptimizer).
        root_rank: Rank whose state wins (global; within ``process_group`` if given).
        model: Accepted for Horovod compatibility; not needed.
        process_set: Ranks to broadcast among (default: all).
        process_group: A torch group instead.

    Raises:
        ConfigError: ``optimizer`` is sharded (``shard=``), on every rank: each rank holds its
            own chunks, so there is no state to copy.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}. Hint: broadcast a model's weights with "
                          "broadcast_parameters(model.state_dict()).")
    if getattr(optimizer, "shard_engine", None) is not None:
        raise ConfigError("broadcast_optimizer_state: a DistributedOptimizer(shard=...) holds "
                          "only this rank's chunks of the state, so there is nothing to copy. "
                          "Hint: drop the call (broadcast the parameters before wrapping); "
                          "restore a state with each rank's own load_state_dict().")
    group, root = _group_and_root(root_rank, process_set, process_group)
    inner = getattr(optimizer, "optimizer", optimizer)
    if not _same_everywhere(type(inner).__qualname__, group):
        raise ConfigError(f"broadcast_optimizer_state: the ranks wrap different optimizer classes "
                          f"(this rank: {type(inner).__name__}), so root's state would be loaded "
                          "into another optimizer. Hint: build the same optimizer on every rank.")
    me = comm.group_rank(group)
    state = optimizer.state_dict() if me == root else None
    # The structure travels as an object, each tensor in it as a shape-only ("meta") tensor.
    skeleton = comm.broadcast_object(
        None if state is None else map_tensors(lambda t: t.to("meta"), state),
        src=root, group=group)
    # Every rank sends or receives on the first parameter's device, so the fused broadcasts
    # match (root's Adam steps live on the CPU, its buffers on the parameters' device).
    dev = next((p.device for g in optimizer.param_groups for p in g["params"]),
               torch.device("cpu"))
    if state is not None:
        tensors = [t.detach().to(dev, copy=True) for t in tensors_in(state)]
    else:
        tensors = [torch.empty(t.shape, dtype=t.dtype, device=dev)
                   for t in tensors_in(skeleton)]
    coalesced_broadcast(tensors, root, group)
    if state is None:
        received = iter(tensors)
        optimizer.load_state_dict(map_tensors(lambda _: next(received), skeleton))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None, *, process_group: Any = None) -> Any:
    """Broadcast any picklable object from ``root_rank``; returns it on every rank."""
    group, root = _group_and_root(root_rank, process_set, process_group)
    return comm.broadcast_object(obj, src=root, group=group)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None, *,
                     process_group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank of the set, ordered by rank."""
    if process_group is None:
        process_group, _ = _set_group(process_set)
    return comm.allgather_object(obj, group=process_group)
