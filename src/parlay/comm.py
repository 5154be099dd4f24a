"""Thin wrappers over c10d: async handles, and failures turned into :class:`CommError`.

Everything that crosses the wire in parlay goes through these functions, so the one place that
knows how c10d reports a lost peer or a timeout is here. Each function takes ``group=None``
(the default group) and returns a :class:`Handle` when ``async_op=True``. Reductions are named
by the one reduce-op table, :mod:`parlay.reduce_ops` (re-exported here: ``comm.ReduceOp``).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from parlay.errors import CommError, ConfigError
from parlay.idle import idle_until as _idle_until
from parlay.reduce_ops import REDUCE_OPS, ReduceOp, c10d_op, reduce_op

__all__ = [
    "Handle", "comm_errors", "allreduce", "allgather", "allgather_into", "broadcast",
    "broadcast_object", "allgather_object", "barrier", "send", "recv", "group_rank",
    "group_size", "to_global_rank", "ReduceOp", "REDUCE_OPS", "reduce_op", "c10d_op",
    "all_gather_single", "reduce_scatter_single", "group_device", "gather_ints", "all_ok",
    "issued", "set_issued",
]


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor; keep working on
# torch>=2.4. Every single-tensor all-gather and reduce-scatter in parlay goes through these.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_PEER_RE = re.compile(r"\b(?:rank|peer)\s*[:=]?\s*(\d+)\b", re.IGNORECASE)
#: c10d errors about the tensors given, raised before any data moves: not a lost peer.
_LOCAL_RE = re.compile(r"invalid scalar type|unsupported (?:dtype|scalar type|device)|"
                       r"no backend type associated")

# Marks a comm_errors block whose peers are unknown (neither a collective nor point-to-point).
_UNKNOWN: Any = object()

#: How long survivors of a failed collective wait for each other's answer on the store before
#: naming the members that did not answer. Only paid on the error path.
LIVENESS_WAIT_S = 3.0
_liveness_checks: dict[str, int] = {}


def _my_rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _silent_members(group: Any) -> list[int] | None:
    """Global ranks of ``group`` that gave no sign of life after a failed collective.

    Every member that saw the failure writes its rank under a key naming the group and this
    process's count of such checks (the survivors of one fault agree on both) and waits a
    moment for the others'. Returns ``None`` when the check cannot run (no store, the store
    itself is gone); ``[]`` when everyone answered.
    """
    try:
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - c10d's own store
        members = _members(group)
        me = dist.get_rank()
    except (RuntimeError, ValueError, AttributeError):
        return None
    gid = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:12]
    n = _liveness_checks.get(gid, 0)
    _liveness_checks[gid] = n + 1
    base = f"parlay/liveness/{gid}/{n}"
    others = [r for r in members if r != me]
    wait = min(LIVENESS_WAIT_S, _group_timeout_s())
    try:
        store.set(f"{base}/{me}", "1")
        try:
            store.wait([f"{base}/{r}" for r in others], _dt.timedelta(seconds=wait))
            return []
        except (RuntimeError, TimeoutError):  # DistStoreError: someone did not answer
            return [r for r in others if not store.check([f"{base}/{r}"])]
    except (RuntimeError, TimeoutError, OSError, ValueError):
        return None


def _members(group: Any) -> list[int]:
    """Global ranks of ``group``: a torch group (``None``: the world) or a list of ranks (a
    group of backends outside torch's registry, as Horovod's process sets build)."""
    if isinstance(group, list):
        return group
    return list(dist.get_process_group_ranks(group or dist.GroupMember.WORLD))


def _group_timeout_s() -> float:
    from parlay import runtime  # runtime imports comm's users; import lazily

    return runtime.timeout().total_seconds() if runtime.is_initialized() else LIVENESS_WAIT_S


def _who(group: Any, peer: int | None, err: BaseException) -> tuple[str, int | None]:
    """A phrase naming the lost rank(s) when they can be known, and the single one if any."""
    if peer is not None:
        return f"rank {peer} was lost or did not answer", peer
    if group is not _UNKNOWN:
        try:
            members = _members(group)
        except (RuntimeError, ValueError):
            members = []
        others = [r for r in members if r != _my_rank()]
        # In a subgroup, a member that failed first in another group (where a rank was lost)
        # is alive but silent here too: it is named, hedged, and not taken as the lost one.
        whole = bool(members) and len(members) == dist.get_world_size()
        elsewhere = "" if whole else ", or it failed first in another group"
        if len(others) == 1:
            if whole:
                return f"rank {others[0]} (its only peer) was lost or did not answer", others[0]
            return (f"rank {others[0]}, its only peer in this group, did not answer (lost, "
                    f"stalled{elsewhere})", None)
        silent = _silent_members(group) if others else None
        if silent:
            names = ", ".join(map(str, silent))
            return (f"rank{'s' if len(silent) > 1 else ''} {names} did not answer a liveness "
                    f"check (lost, stalled, not yet at or already past this collective"
                    f"{elsewhere})", silent[0] if len(silent) == 1 and whole else None)
    m = _PEER_RE.search(str(err))
    if m:
        return f"peer rank {m.group(1)} was lost or the operation failed", int(m.group(1))
    return "a peer was lost or the operation failed", None


def _as_comm_error(op: str, err: BaseException, *, group: Any = _UNKNOWN,
                   peer: int | None = None) -> CommError:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    lowered = str(err).lower()
    if _LOCAL_RE.search(lowered):  # refused here, before any peer was involved
        return CommError(f"{op} failed on rank {_my_rank()}: the backend refused the tensors "
                         f"given ({text}); no peer is at fault. Hint: check their dtype and "
                         "device (gloo reduces float, int32/int64, int8/uint8 on the CPU).",
                         op=op, rank=_my_rank(), peer=None)
    who, lost = _who(group, peer, err)
    named = who.startswith("rank")
    if "timed out" in lowered or "timeout" in lowered:
        why = f"{who}, within the collective timeout" if named else \
            "a peer did not answer within the collective timeout"
        hint = ("Hint: a rank is stalled or died, or is waiting in another collective (every "
                "rank must make the same calls: save_checkpoint() or validate() on one rank "
                "only, or one rank taking an extra step, leaves the others waiting); check the "
                "other ranks' logs, or raise the timeout with parlay.init(timeout=...) / "
                "PARLAY_TIMEOUT.")
    else:
        why = who
        hint = ("Hint: check the log of the rank named for the first error." if named
                else "Hint: check the other ranks' logs for the first error.")
    return CommError(f"{op} failed on rank {_my_rank()}: {why} ({text}). {hint}",
                     op=op, rank=_my_rank(), peer=lost)


@contextlib.contextmanager
def comm_errors(op: str, *, group: Any = _UNKNOWN, peer: int | None = None) -> Iterator[None]:
    """Translate c10d failures raised inside the block into :class:`CommError` naming ``op``.

    Args:
        op: Name of the operation, for the message.
        group: For a collective, its group (``None``: the world; or its members' global
            ranks): on failure the members that did not answer are found through the store
            and named.
        peer: For point-to-point, the global rank on the other end; named on failure.
    """
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, TimeoutError, ConnectionError) as e:  # DistBackendError is a RuntimeError
        raise _as_comm_error(op, e, group=group, peer=peer) from e


class Handle:
    """An in-flight operation. :meth:`wait` blocks and returns the result.

    The core's one handle type: c10d work objects and operations that completed synchronously
    answer ``is_completed()`` and ``wait()`` alike.

    Args:
        work: The c10d work object (``None`` for an operation that completed synchronously).
        op: Name used in error messages.
        finish: Called once after the wait; its return value is the handle's result.
        group: The collective's group, to name silent members on failure (see
            :func:`comm_errors`).
        peer: The point-to-point peer's global rank, named on failure.
    """

    def __init__(self, work: Any, op: str, finish: Callable[[], Any], *, group: Any = _UNKNOWN,
                 peer: int | None = None) -> None:
        self._work = work
        self._op = op
        self._where = {"group": group, "peer": peer}
        self._finish = finish
        self._done = False
        self._result: Any = None

    @property
    def name(self) -> str:
        """The operation's name."""
        return self._op

    def is_completed(self) -> bool:
        """Whether the operation finished (never blocks)."""
        return self._done or self._work is None or bool(self._work.is_completed())

    def wait(self) -> Any:
        """Block until the operation finished; return its result.

        Raises:
            CommError: A peer was lost or the operation timed out.
        """
        if not self._done:
            with comm_errors(self._op, **self._where):
                if self._work is not None:
                    _idle_until(self._work.is_completed)
                    self._work.wait()
                self._result = self._finish()
            self._done = True
        return self._result

    def __repr__(self) -> str:
        return f"Handle({self._op!r}, done={self.is_completed()})"


def group_size(group: Any = None) -> int:
    """Size of ``group`` (default: the world).

    Raises:
        ConfigError: ``group`` is not a process group.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ConfigError(f"expected a torch.distributed process group (or None: every rank), "
                          f"got {type(group).__name__} {group!r}. Hint: "
                          "torch.distributed.new_group(ranks).")
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def group_device(group: Any = None) -> torch.device:
    """Where the tensors of a collective over ``group`` live: CPU when the group has a CPU
    transport (gloo, MPI, ``"auto"``'s ``cpu:gloo,cuda:nccl``; or no group), else (NCCL alone)
    this rank's CUDA device. Build flags, counts and metrics to reduce over ``group`` on it."""
    try:  # the config names the transports even where get_backend says "undefined"
        config = str(dist.get_backend_config(group))
    except (RuntimeError, ValueError, AttributeError):  # no process group, or not a member
        return torch.device("cpu")
    kinds = {part.split(":")[0].strip() for part in config.split(",") if ":" in part}
    if "cpu" in kinds or not (kinds or "nccl" in config):
        return torch.device("cpu")
    from parlay import runtime  # runtime imports comm's users; import lazily

    dev = runtime.device() if runtime.is_initialized() else torch.device("cpu")
    if dev.type != "cpu":
        return dev
    return torch.device("cuda", torch.cuda.current_device()) if "cuda" in kinds or not kinds \
        else torch.device(sorted(kinds)[0])


def to_global_rank(group: Any, group_rank_: int) -> int:
    """Global rank of member ``group_rank_`` of ``group``."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank_
    return dist.get_global_rank(group, group_rank_)


_issued = 0


def issued() -> int:
    """Collectives this process's main thread has issued (set back by a resume). Every rank
    issues the same ones in the same order, so ranks that meet only at collectives (mode
    ``"diloco"``) and show the same count stand between the same two of them."""
    return _issued


def set_issued(n: int) -> None:
    """Continue counting from ``n`` (the count a resumed state was written at)."""
    global _issued
    _issued = int(n)


def _issue() -> None:
    global _issued
    if threading.current_thread() is threading.main_thread():
        _issued += 1


def allreduce(tensor: torch.Tensor, op: str | int = "sum", group: Any = None,
              async_op: bool = False) -> Any:
    """In-place allreduce of ``tensor``; ``op="avg"`` (or ``ReduceOp.Average``) divides by
    the group size.

    Returns:
        The reduced tensor, or a :class:`Handle` whose ``wait()`` returns it.
    """
    rop = reduce_op(op)
    avg = rop == ReduceOp.Average
    _issue()
    with comm_errors("allreduce", group=group):
        work = dist.all_reduce(tensor, op=c10d_op(rop), group=group, async_op=True)

    def finish() -> torch.Tensor:
        if avg:
            tensor.div_(group_size(group))
        return tensor

    h = Handle(work, "allreduce", group=group, finish=finish)
    return h if async_op else h.wait()


def allgather_into(output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
    """Gather equally sized ``tensor`` from every rank into ``output`` (first dim = world * n)."""
    _issue()
    with comm_errors("allgather", group=group):
        work = all_gather_single(output, tensor.contiguous(), group=group, async_op=True)
    h = Handle(work, "allgather", group=group, finish=lambda: output)
    return h if async_op else h.wait()


def allgather(tensor: torch.Tensor, group: Any = None, async_op: bool = False,
              parts: bool = False) -> Any:
    """Concatenate ``tensor`` from every rank along dim 0; first-dimension sizes may differ
    (``parts=True``: the list of every rank's tensor instead).

    Raises:
        CommError: Ranks disagree on dtype or trailing shape, or a peer was lost.
    """
    world = group_size(group)
    t = tensor if tensor.dim() > 0 else tensor.reshape(1)
    meta = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(meta) for _ in range(world)]
    _issue()
    with comm_errors("allgather", group=group):
        dist.all_gather(sizes, meta, group=group)
    counts = [int(s.item()) for s in sizes]
    biggest = max(counts)
    padded = t
    if t.shape[0] < biggest:
        pad = t.new_zeros((biggest - t.shape[0],) + tuple(t.shape[1:]))
        padded = torch.cat([t, pad])
    out = t.new_empty((biggest * world,) + tuple(t.shape[1:]))
    with comm_errors("allgather", group=group):
        work = all_gather_single(out, padded.contiguous(), group=group, async_op=True)

    def finish() -> Any:
        if all(c == biggest for c in counts) and not parts:
            return out
        chunks = [c[:n] for c, n in zip(out.split(biggest), counts)]
        return chunks if parts else torch.cat(chunks)

    h = Handle(work, "allgather", group=group, finish=finish)
    return h if async_op else h.wait()


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """In-place broadcast from group rank ``src``."""
    _issue()
    with comm_errors("broadcast", group=group):
        work = dist.broadcast(tensor, src=to_global_rank(group, src), group=group, async_op=True)
    h = Handle(work, "broadcast", group=group, finish=lambda: tensor)
    return h if async_op else h.wait()


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Broadcast a picklable object from group rank ``src``; returns it on every rank."""
    box = [obj]
    _issue()
    with comm_errors("broadcast_object", group=group):
        dist.broadcast_object_list(box, src=to_global_rank(group, src), group=group)
    return box[0]


def allgather_object(obj: Any, group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank; returns the list ordered by rank."""
    out: list[Any] = [None] * group_size(group)
    _issue()
    with comm_errors("allgather_object", group=group):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    """Block until every rank of ``group`` reached the barrier (within the timeout)."""
    _issue()
    with comm_errors("barrier", group=group):
        # all_reduce instead of dist.barrier: the latter guesses a device on NCCL.
        t = torch.zeros(1, device=group_device(group))
        dist.all_reduce(t, group=group)


def send(tensor: torch.Tensor, dst: int, tag: int = 0, group: Any = None,
         async_op: bool = False) -> Any:
    """Send ``tensor`` to global rank ``dst``."""
    with comm_errors("send", peer=dst):
        work = dist.isend(tensor, dst=dst, group=group, tag=tag)
    h = Handle(work, "send", lambda: tensor, peer=dst)
    return h if async_op else h.wait()


def recv(tensor: torch.Tensor, src: int | None = None, tag: int = 0, group: Any = None,
         async_op: bool = False) -> Any:
    """Receive into ``tensor`` from global rank ``src`` (``None``: any source, gloo only).

    Returns:
        The sender's global rank, or a :class:`Handle` whose ``wait()`` returns it.
    """
    with comm_errors("recv", peer=src):
        work = dist.irecv(tensor, src=src, group=group, tag=tag)
    def finish() -> int:
        if src is not None:
            return src
        assert work is not None  # irecv always returns a work object
        return int(work.source_rank())

    h = Handle(work, "recv", finish, peer=src)
    return h if async_op else h.wait()




def gather_ints(values: list[int], width: int, group: Any = None) -> list[list[int]]:
    """Every rank's last ``width`` ``values``, padded with -1 to ``width``, one row per rank of
    ``group``: how ranks agree on steps (an ``int64`` allgather, never pickled objects). Without
    a process group, or in a group of one, the only row is this rank's."""
    row = list(values)[-width:] if width > 0 else []
    row += [-1] * (width - len(row))
    if not dist.is_initialized() or group_size(group) == 1:
        return [row]
    dev = group_device(group)  # a NCCL-only group gathers CUDA tensors only
    out = torch.empty(group_size(group) * width, dtype=torch.int64, device=dev)
    allgather_into(out, torch.tensor(row, dtype=torch.int64, device=dev), group=group)
    return out.view(-1, width).tolist()


def all_ok(ok: bool, group: Any = None) -> bool:
    """True on every rank of ``group`` when ``ok`` is true on every one (an allreduce)."""
    if not dist.is_initialized() or group_size(group) == 1:
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=group_device(group))
    allreduce(t, "min", group=group)
    return bool(t.item())
