"""Name matching for Horovod's operations, negotiated in the calling thread over int64 tensors.

Horovod matches operations across ranks by *name*, not by call order: a rank may start
``allreduce_async(a, name="x")`` and call ``barrier()`` while its peer calls ``barrier()`` first
and ``x`` later. So an operation is not issued when it is submitted; it waits in this rank's
table until a rank *waits* for something (``synchronize``, a blocking operation, ``barrier``,
``join``, ``poll``). Waiting runs *rounds* on the process set's private group: each round
allgathers every rank's pending descriptors (name, kind, dtypes, shapes, op, root, scale
factors), all encoded as integers, so nothing from a peer is ever unpickled.
An operation every active rank holds is *ready*; every rank runs the ready ones in the same
order (:func:`parlay.horovod.execute.run_ready`), and descriptors that disagree fail on every
rank with :class:`HorovodInternalError` instead of hanging c10d. A joined rank (``hvd.join``)
keeps answering rounds and contributes zeros to allreduces until every rank joined.
"""
from __future__ import annotations

import datetime
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm, runtime
from parlay.horovod import execute, timeline
from parlay.errors import CommError
from parlay.horovod.basics import HorovodInternalError
from parlay.horovod.groups import Group
from parlay.reduce_ops import ReduceOp

__all__ = ["Engine", "Handle", "Meta", "Request", "exchange"]

_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Meta:
    """What the other ranks learn about a request."""

    kind: str
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    device: str = "cpu"
    op: int = -1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None


def _f2i(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _i2f(x: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", x))[0])


def encode(key: str, m: Meta) -> list[int]:
    """``key`` and ``m`` as integers (see :func:`decode`)."""
    name = list(key.encode())
    out = [len(name), *name, _KINDS.index(m.kind), _DEVICES.index(m.device), m.op, m.root,
           _f2i(m.prescale), _f2i(m.postscale), len(m.dtypes)]
    for d, s in zip(m.dtypes, m.shapes):
        out += [_DTYPES.index(getattr(torch, d.split(".")[-1])), len(s), *s]
    splits = list(m.splits) if m.splits is not None else []
    return out + [len(splits) if m.splits is not None else -1, *splits]


def decode(v: list[int]) -> tuple[str, Meta]:
    """The name and descriptor that :func:`encode` wrote (integers only: nothing a peer sends
    is unpickled or evaluated)."""
    key = bytes(v[1: 1 + v[0]]).decode()
    kind, dev, op, root, pre, post, n = v[1 + v[0]: 8 + v[0]]
    i, dtypes, shapes = 8 + v[0], [], []
    for _ in range(n):
        dtypes.append(str(_DTYPES[v[i]]))
        shapes.append(tuple(v[i + 2: i + 2 + v[i + 1]]))
        i += 2 + v[i + 1]
    splits = tuple(v[i + 1: i + 1 + v[i]]) if v[i] >= 0 else None
    return key, Meta(_KINDS[kind], tuple(dtypes), tuple(shapes), _DEVICES[dev], op, root,
                       _i2f(pre), _i2f(post), splits)


def exchange(g: Group, message: list[int]) -> list[list[int]]:
    """Allgather every rank's list of integers (lengths first, then the padded lists)."""
    dev = g.control_device()
    lens = torch.empty(g.size, dtype=torch.int64, device=dev)
    g.all_gather(lens, torch.tensor([len(message)], dtype=torch.int64, device=dev))
    n = lens.tolist()
    return _gather_padded(g, message, n)


def _gather_padded(g: Group, message: list[int], lens: list[int]) -> list[list[int]]:
    dev = g.control_device()
    send = torch.zeros(max(lens), dtype=torch.int64)
    send[: len(message)] = torch.tensor(message, dtype=torch.int64)
    out = torch.empty(g.size * max(lens), dtype=torch.int64, device=dev)
    g.all_gather(out, send.to(dev))
    rows = out.cpu().view(g.size, max(lens)).tolist()
    return [row[: k] for row, k in zip(rows, lens)]


@dataclass
class Request:
    """A local request: its descriptor, the tensors it sends and where its result goes."""

    key: str
    meta: Meta
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] | None = None
    finish: Callable[[Any], Any] | None = None
    done: bool = False
    result: Any = None
    error: BaseException | None = None

    def complete(self, result: Any, error: BaseException | None) -> None:
        if error is None and self.finish is not None:
            try:
                result = self.finish(result)
            except Exception as e:  # noqa: BLE001 - reported through the handle
                error = e
        self.result, self.error, self.done = result, error, True


class Handle:
    """What an ``*_async`` operation returns: ``wait()`` negotiates until it ran."""

    def __init__(self, runner: Any, req: Request) -> None:
        self._runner, self._req = runner, req

    def name(self) -> str:
        return self._req.key

    def is_completed(self) -> bool:
        return self._req.done

    def poll(self) -> bool:
        """Whether it ran; if not, move its negotiation on without blocking."""
        if not self._req.done:
            self._runner.nudge()
        return self._req.done

    def wait(self) -> Any:
        if not self._req.done:
            self._runner.drive(self._req)
        if self._req.error is not None:
            raise self._req.error
        return self._req.result


class Engine:
    """The pending operations of one process set on this rank, and the rounds that run them.

    Args:
        prefix: Store prefix of the set's private group (unique per set and init).
        global_ranks: Global rank of each member, in set-rank order.
        fusion_bytes: Largest fused allreduce buffer.
    """

    def __init__(self, prefix: str, global_ranks: list[int], fusion_bytes: int) -> None:
        self.prefix, self.global_ranks = prefix, global_ranks
        self.size = len(global_ranks)
        self.group: Group | None = None       # connected on the first round
        self.fusion_bytes = fusion_bytes
        self._local: dict[str, Request] = {}  # submitted here, not run yet
        self._counters = [0] * len(_KINDS)
        self._joined_at: dict[int, int] = {}  # set rank -> round in which it joined
        self._round = 0
        self._stall_s = runtime.timeout().total_seconds()
        self._closed = False
        self._first_seen: dict[str, float] = {}   # name -> when it entered the table here
        self._slot = 256        # ints per rank in a round's first allgather, grows on demand
        self._inflight: tuple[Any, torch.Tensor, list[int]] | None = None
        self._connecting: threading.Thread | None = None
        self._connected: Any = None
        #: While set (``hvd.join``'s mirror), a round may wait for ever and this is called
        #: between slices of the wait, with when the wait began: it raises to end it (a
        #: failure, or no progress).
        self.watch: Callable[[float], None] | None = None

    def auto_name(self, kind: str) -> str:
        """``kind.noname.N``: the N-th unnamed ``kind`` operation of this set on this rank."""
        i = _KINDS.index(kind)
        self._counters[i] += 1
        return f"{kind}.noname.{self._counters[i] - 1}"

    def submit(self, req: Request) -> Handle:
        """Queue ``req`` (it runs once every rank holds it and some rank waits).

        Raises:
            ValueError: An operation with the same name is still pending on this rank.
            HorovodInternalError: Horovod was shut down.
        """
        if self._closed:
            raise HorovodInternalError(f"cannot start {req.key}: Horovod is shut down. "
                                       "Hint: call hvd.init() again after hvd.shutdown().")
        if req.key in self._local:
            raise ValueError(f"an operation named {req.key!r} is already in flight on this "
                             "rank; names must be unique until the operation completes. "
                             "Hint: synchronize() the first one, or use another name.")
        self._local[req.key] = req
        return Handle(self, req)

    def drive(self, req: Request | None) -> Any:
        """Run rounds until ``req`` ran (``None``: until every rank joined).

        Returns:
            For a join, the set rank that joined last.

        Raises:
            HorovodInternalError: ``req`` did not become ready within the collective timeout
                (some rank never submitted it), or a peer was lost.
        """
        kind = (req.meta.kind if req is not None else "join").upper()
        with timeline.span(req.key if req is not None else "join", f"NEGOTIATE_{kind}"):
            while True:
                if self._inflight is None:
                    self._start_round(joined=req is None, blocked=True)
                joined = self._finish_round()
                if req is None and joined is not None:
                    return joined
                if req is not None and req.done:
                    return None

    def _connect(self, block: bool) -> bool:
        # Connecting waits for every member, so poll() connects on a helper thread.
        if self.group is None and self._connecting is None:
            def connect() -> None:
                try:
                    group = Group.private(self.prefix, self.global_ranks)
                    # Horovod's coordinator decides fusion: here the set's first member
                    fusion = torch.tensor([self.fusion_bytes], dtype=torch.int64)
                    group.broadcast(fusion, self.global_ranks[0])
                    self.fusion_bytes, self._connected = int(fusion.item()), group
                except Exception as e:  # noqa: BLE001 - re-raised in the calling thread
                    self._connected = e
            self._connecting = threading.Thread(target=connect, daemon=True,
                                                name="parlay-hvd-connect")
            self._connecting.start()
        if self.group is None and self._connecting is not None:
            if block:
                self._connecting.join()
            if self._connecting.is_alive():
                return False
            self._connecting, got = None, self._connected
            if isinstance(got, Exception):
                raise HorovodInternalError(f"connecting the process set {self.global_ranks} "
                                           f"failed: {got}", op="rendezvous") from got
            self.group = got
        return True

    def nudge(self) -> None:
        """Without blocking: finish a round every rank has answered, else start one."""
        if not self._connect(block=False):
            return
        if self._inflight is not None and self._inflight[0].is_completed():
            self._finish_round()
        if self._inflight is None and self._local:
            self._start_round(joined=False, blocked=False)

    def _start_round(self, joined: bool, blocked: bool) -> None:
        # One allgather of fixed-size slots carries every rank's length and message; a longer
        # message (any rank's) costs a second allgather in _finish_round, and the slot grows.
        self._connect(block=True)
        assert self.group is not None
        msg = [int(joined) | 2 * int(blocked), len(self._local)]
        for req in self._local.values():
            enc = encode(req.key, req.meta)
            msg += [len(enc), *enc]
        # Names some rank submitted that have waited past the timeout here: every rank drops
        # the same ones in the same round, so all report the same table.
        late = [list(k.encode()) for k, t0 in self._first_seen.items()
                if time.monotonic() - t0 > self._stall_s]
        msg.append(len(late))
        for name in late:
            msg += [len(name), *name]
        send = torch.zeros(self._slot, dtype=torch.int64)
        send[0] = len(msg)
        head = msg[: self._slot - 1]
        send[1: 1 + len(head)] = torch.tensor(head, dtype=torch.int64)
        out = torch.empty(self.size * self._slot, dtype=torch.int64)
        forever = datetime.timedelta(days=7) if self.watch is not None else None
        self._inflight = (self.group.start_all_gather(out, send, forever), out, msg)

    def _finish_round(self) -> int | None:
        assert self._inflight is not None and self.group is not None
        work, out, msg = self._inflight
        self._inflight = None
        with timeline.cycle():
            try:
                with comm.comm_errors("horovod negotiation", group=self.group.global_ranks):
                    self._wait(work)
                rows = out.view(self.size, self._slot).tolist()
                lens = [row[0] for row in rows]
                if max(lens) > self._slot - 1:
                    msgs = _gather_padded(self.group, msg, lens)
                    self._slot = 1 << max(lens).bit_length()
                else:
                    msgs = [row[1: 1 + n] for row, n in zip(rows, lens)]
            except CommError as e:  # it names the silent members
                raise HorovodInternalError(str(e), op="negotiation", rank=e.rank,
                                           peer=e.peer) from e
            except Exception as e:
                raise HorovodInternalError(f"Horovod negotiation on rank {dist.get_rank()} "
                                           f"failed: {e}", op="negotiation") from e
        self._round += 1
        table: dict[str, dict[int, Meta]] = {}
        late: set[str] = set()
        for r, m in enumerate(msgs):
            if m[0] & 1:
                self._joined_at.setdefault(r, self._round)
            i = 2
            for _ in range(m[1]):
                key, meta = decode(m[i + 1: i + 1 + m[i]])
                table.setdefault(key, {})[r] = meta
                i += 1 + m[i]
            for _ in range(m[i]):
                late.add(bytes(m[i + 2: i + 2 + m[i + 1]]).decode())
                i += 1 + m[i + 1]
        now = time.monotonic()
        self._first_seen = {k: self._first_seen.get(k, now) for k in table}
        active = [r for r in range(self.size) if r not in self._joined_at]
        ready = sorted(k for k, metas in table.items()
                       if active and all(r in metas for r in active))
        if ready:
            self._run(ready, table)
        elif active and all(msgs[r][0] & 2 for r in active):
            self._fail_kinds(table)  # every rank waits: nothing submitted later can match
        for key in sorted(late - set(ready)):
            self._first_seen.pop(key, None)
            if key in self._local:
                self._stall(self._local.pop(key), table)
        if len(self._joined_at) == self.size:
            return self._finish_join()
        return None

    def _wait(self, work: Any) -> None:
        if self.watch is None:
            work.wait()
            return
        t0 = time.monotonic()
        while True:
            self.watch(t0)
            try:
                work.wait(datetime.timedelta(milliseconds=50))
                return
            except RuntimeError:
                if work.is_completed():  # it failed: its own error
                    work.wait()
                    return

    def _fail_kinds(self, table: dict[str, dict[int, Meta]]) -> None:
        # One name submitted as different kinds (kind.name keys, as Horovod's) by ranks that
        # all wait: fail it on every rank rather than after the collective timeout.
        kinds: dict[str, list[str]] = {}
        for key in sorted(table):
            kinds.setdefault(key.split(".", 1)[1], []).append(key)
        for name, keys in kinds.items():
            if len(keys) != 2 or set(table[keys[0]]) & set(table[keys[1]]):
                continue  # (a rank that submitted both kinds is not the mismatch)
            (a, ma), (b, mb) = sorted((min(table[k].items(), key=lambda x: x[0]) for k in keys),
                                      key=lambda x: x[0])
            err = HorovodInternalError(
                f"Mismatched operations for {name}: rank {self.global_ranks[a]} ran {ma.kind}, "
                f"rank {self.global_ranks[b]} {mb.kind}. Hint: every rank must run the same "
                "operation under a name.", op=ma.kind)
            for key in keys:
                if key in self._local:
                    self._local.pop(key).complete(None, err)

    def _run(self, ready: list[str], table: dict[str, dict[int, Meta]]) -> None:
        batch = [(k, table[k], self._local.pop(k, None)) for k in ready]
        assert self.group is not None
        kinds = sorted({m.kind.upper() for _, metas, _ in batch for m in metas.values()})
        try:
            with torch.no_grad(), timeline.span(None, "_".join(kinds)):
                outcomes = execute.run_ready(self.group, batch, set(self._joined_at),
                                             self.fusion_bytes)
        except Exception as e:  # noqa: BLE001 - every request of the batch must learn it
            err = HorovodInternalError(f"Horovod operation on rank {dist.get_rank()} failed: "
                                       f"{e}", op="collective")
            outcomes = [(req, None, err) for _, _, req in batch if req is not None]
        for req, result, error in outcomes:
            req.complete(result, error)

    def _finish_join(self) -> int:
        # The last rank to join is the one that joined in the latest round (highest on ties).
        last = max(self._joined_at, key=lambda r: (self._joined_at[r], r))
        self._joined_at.clear()
        # Auto-names must agree again after ranks ran different numbers of operations.
        assert self.group is not None
        counters = torch.tensor(self._counters, dtype=torch.int64,
                                device=self.group.control_device())
        self.group.all_reduce(counters, int(ReduceOp.Max))
        self._counters = counters.tolist()
        return self.global_ranks[last]

    def _stall(self, req: Request, table: dict[str, dict[int, Meta]]) -> None:
        metas = table.get(req.key, {})
        missing = [r for r in range(self.size) if r not in metas and r not in self._joined_at]
        waits = {self.global_ranks[r]: [k for k, m in table.items() if r in m][:3]
                 for r in missing}
        req.complete(None, HorovodInternalError(
            f"{req.key} stalled: ranks {[self.global_ranks[r] for r in sorted(metas)]} "
            f"submitted it, ranks {[self.global_ranks[r] for r in missing]} did not within "
            f"{self._stall_s:.0f} s (they wait for: {waits}). Hint: every "
            "rank of the process set must run the same operations (names must match); raise "
            "PARLAY_TIMEOUT if a rank is legitimately this late.", op=req.meta.kind))

    def close(self) -> None:
        """At shutdown or set removal: fail what never ran; later submissions raise."""
        self._closed = True
        err = HorovodInternalError("Horovod was shut down before every rank submitted this "
                                   "operation", op="shutdown")
        for req in self._local.values():
            req.complete(None, err)
        self._local.clear()
