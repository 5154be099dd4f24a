"""The negotiation engine: Horovod's name-matched, asynchronous collectives on c10d.

Horovod matches operations across ranks by *name*, not by call order: a rank may start
``allreduce_async(a, name="x")`` and then call ``barrier()`` while its peer calls ``barrier()``
first and ``x`` later; the operation runs once every rank has submitted it. Each process set
gets one engine: a background thread with a private process group. The thread sleeps while
this rank has nothing in flight. Otherwise each *cycle* it allgathers the descriptors of the
requests submitted since the last cycle (kind, name, dtypes, shapes, op, root, ...), so every
rank holds the same table of who asked for what. A name is *ready* when every rank that has
not joined asked for it; every rank then checks the descriptors agree and runs the ready
operations in the same order (the table's), fusing small allreduces. A mismatch fails the
operation on every rank with :class:`HorovodInternalError` instead of hanging c10d.

``join()`` marks a rank as done: it keeps answering cycles, contributes zeros to allreduces
(the average still divides by the full size, as Horovod does), and returns when every rank
joined. Shutdown is a negotiated stop, so no thread is ever left inside a collective.
"""
from __future__ import annotations

import atexit
import pickle
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from parlay import runtime
from parlay.comm import Handle
from parlay.horovod import execute, timeline
from parlay.horovod.basics import HorovodInternalError
from parlay.horovod.groups import Group, PrivateGroup

__all__ = ["Meta", "Request", "Engine", "exchange", "STOP", "JOIN"]

STOP = "stop.__parlay__"
JOIN = "join.__parlay__"


@dataclass(frozen=True)
class Meta:
    """What the other ranks learn about a request (small and picklable)."""

    kind: str
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    device: str = "cpu"
    op: int = -1
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] | None = None
    extra: Any = None


@dataclass
class Request:
    """A local request: its descriptor, the tensors it sends and where its result goes."""

    key: str
    meta: Meta
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] | None = None
    finish: Callable[[Any], Any] | None = None
    handle: Handle = field(init=False)
    t_submit: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        # parlay's one handle type; this engine's thread completes it with resolve().
        self.handle = Handle.pending(self.key)


_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


class Engine:
    """Negotiates and runs the Horovod-style operations of one process set on this rank.

    Args:
        prefix: Store prefix of this engine's private group (unique per set and init).
        global_ranks: Global rank of each member, in set-rank order.
        fusion_bytes: Largest fused allreduce buffer.
    """

    def __init__(self, prefix: str, global_ranks: list[int], fusion_bytes: int) -> None:
        self.prefix = prefix
        self.global_ranks = global_ranks
        self.size = len(global_ranks)
        self.rank = global_ranks.index(dist.get_rank())
        self.group: Group | None = None       # connected by the thread, on first use
        self.fusion_bytes = fusion_bytes
        self._cv = threading.Condition()
        self._new: list[Request] = []
        self._local: dict[str, Request] = {}      # submitted here, not finished
        self._table: dict[str, dict[int, Meta]] = {}  # identical on every rank
        self._joined: dict[int, tuple[int, Any]] = {}  # rank -> (cycle, its name counters)
        self._cycle = 0
        self._counters: dict[str, int] = {}
        self._slot = 2048       # negotiation message size (bytes), grows on demand
        self._idle = 0          # cycles in a row in which nothing happened
        self._first_seen: dict[str, float] = {}   # when each table name appeared (local clock)
        self._reported: set[str] = set()           # names this rank reported as stalled
        self._stall_s = (runtime.timeout().total_seconds() if runtime.is_initialized()
                         else 300.0)
        self._device = runtime.device() if runtime.is_initialized() else torch.device("cpu")
        self._dead: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="parlay-hvd-engine", daemon=True)
        self._thread.start()
        _engines.add(self)

    # ------------------------------------------------------------------ calling thread
    def auto_name(self, kind: str) -> str:
        """``kind.noname.N``: the N-th unnamed ``kind`` operation of this set on this rank."""
        with self._cv:
            n = self._counters.get(kind, 0)
            self._counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(self, req: Request) -> Handle:
        """Queue ``req`` for negotiation and return its handle.

        Raises:
            ValueError: An operation with the same name is still in flight on this rank.
            HorovodInternalError: The engine died (a peer was lost) or is shut down.
        """
        with self._cv:
            if self._dead is not None or self._closing:
                raise HorovodInternalError(
                    f"cannot start {req.key}: the Horovod engine is shut down"
                    + (f" after an error: {self._dead}" if self._dead else "")
                    + ". Hint: call hvd.init() again after hvd.shutdown().")
            if req.key in self._local:
                raise ValueError(f"an operation named {req.key!r} is already in flight on this "
                                 "rank; names must be unique until the operation completes. "
                                 "Hint: synchronize() the first one, or use another name.")
            self._local[req.key] = req
            self._new.append(req)
            self._cv.notify()
        timeline.negotiate_start(req.key, req.meta.kind, self.rank)
        return req.handle

    def stop(self) -> None:
        """Negotiated stop: every member calls this; unmatched requests fail, the thread ends."""
        if not self._thread.is_alive():
            return
        if self._dead is None:
            req = Request(STOP, Meta("stop"))
            with self._cv:
                if STOP not in self._local:
                    self._local[STOP] = req
                    self._new.append(req)
                    self._cv.notify()
        # A peer that never stops must not keep this rank forever: give up after the timeout
        # (the daemon thread is abandoned; the group dies with the default group).
        self._thread.join(timeout=self._stall_s + 10)

    def close_if_idle(self) -> None:
        """At interpreter exit: end the thread if it is idle (no collective, no peers)."""
        with self._cv:
            self._closing = True
            self._cv.notify()

    # ------------------------------------------------------------------ background thread
    def _loop(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)   # the thread's own current device
            while True:
                with self._cv:
                    while not self._local and not self._closing:
                        self._cv.wait()
                    if not self._local:
                        return
                    if self._idle and not self._new:
                        # Nothing moved last cycle: back off (a new request wakes us early).
                        self._cv.wait(timeout=min(2e-4 * 2 ** min(self._idle, 8), 0.05))
                    new, self._new = self._new, []
                if self.group is None:
                    self.group = PrivateGroup(self.prefix, self.global_ranks)
                items = [(r.key, r.meta) for r in new] + self._stalled_here()
                msgs = self._exchange(items)
                self._cycle += 1
                timeline.cycle(self.rank)
                if self._process(msgs):
                    return
        except BaseException as e:  # noqa: BLE001 - every waiter must learn about it
            err = e if isinstance(e, HorovodInternalError) else HorovodInternalError(
                f"Horovod engine on rank {dist.get_rank()} failed: {e}", op="negotiation")
            with self._cv:
                self._dead = err
                waiting = list(self._local.values())
                self._local.clear()
            for r in waiting:
                r.handle.resolve(error=err)

    def _exchange(self, items: list[tuple[str, Meta]]) -> list[list[tuple[str, Meta]]]:
        assert self.group is not None
        msgs, self._slot = exchange(self.group, items, self._slot)
        return msgs

    def _stalled_here(self) -> list[tuple[str, Meta]]:
        """Names this rank has seen waiting longer than the timeout (reported once)."""
        now = time.monotonic()
        late = [k for k, t0 in self._first_seen.items()
                if now - t0 > self._stall_s and k != STOP and k not in self._reported]
        self._reported.update(late)
        return [(k, Meta("stalled")) for k in late]

    def _fail_stalled(self, keys: set[str]) -> None:
        # Every rank learns the same set in the same cycle, so all drop the same names.
        for key in sorted(k for k in keys if k in self._table):
            metas = self._table.pop(key)
            self._first_seen.pop(key, None)
            self._reported.discard(key)
            req = self._local.get(key)
            if req is None:
                continue
            missing = [r for r in range(self.size) if r not in metas and r not in self._joined]
            waits = {self.global_ranks[r]: [k for k, m in self._table.items() if r in m][:3]
                     for r in missing}
            err = HorovodInternalError(
                f"{key} stalled: ranks {[self.global_ranks[r] for r in sorted(metas)]} submitted "
                f"it, ranks {[self.global_ranks[r] for r in missing]} did not within "
                f"{self._stall_s:.0f} s (they wait for: {waits}). Hint: every rank of the process "
                "set must run the same operations (names must match); raise PARLAY_TIMEOUT if "
                "a rank is legitimately this late.", op=key.split(".")[0])
            self._complete([(req, None, err)])

    def _process(self, msgs: list[list[tuple[str, Meta]]]) -> bool:
        stalled: set[str] = set()
        moved = False
        for r, items in enumerate(msgs):
            for key, meta in items:
                moved = True
                if meta.kind == "join":
                    self._joined.setdefault(r, (self._cycle, meta.extra))
                elif meta.kind == "stalled":
                    stalled.add(key)
                else:
                    self._table.setdefault(key, {})[r] = meta
                    self._first_seen.setdefault(key, time.monotonic())
        active = [r for r in range(self.size) if r not in self._joined]
        ready = [k for k, metas in self._table.items()
                 if k != STOP and active and all(r in metas for r in active)]
        for k in ready:
            self._first_seen.pop(k, None)
            self._reported.discard(k)
        self._idle = 0 if (moved or ready) else self._idle + 1
        if ready:
            batch = []
            for k in ready:
                metas = self._table.pop(k)
                timeline.negotiate_end(k, self.rank)
                batch.append((k, metas, self._local.get(k)))
            assert self.group is not None
            with torch.no_grad():
                outcomes = execute.run_ready(self.group, batch, set(self._joined),
                                             self.fusion_bytes)
            if self._device.type == "cuda":
                # Results must be complete before another thread's stream reads them.
                torch.cuda.current_stream().synchronize()
            self._complete(outcomes)
        if stalled:
            self._fail_stalled(stalled)
        if len(self._joined) == self.size:
            self._finish_join()
        stop = self._table.get(STOP)
        if stop is not None and len(stop) == self.size:
            with self._cv:
                left = [req for k, req in self._local.items() if k != STOP]
                self._local.clear()
                self._closing = True
            err = HorovodInternalError("Horovod was shut down before every rank submitted this "
                                       "operation", op="shutdown")
            for req in left:
                req.handle.resolve(error=err)
            return True
        return False

    def _complete(self, outcomes: list[tuple[Request, Any, BaseException | None]]) -> None:
        with self._cv:
            for req, _, _ in outcomes:
                self._local.pop(req.key, None)
        for req, result, error in outcomes:
            timeline.op_end(req.key)
            if error is None and req.finish is not None:
                try:
                    result = req.finish(result)
                except Exception as e:  # noqa: BLE001 - reported through the handle
                    error = e
            req.handle.resolve(result, error)

    def _finish_join(self) -> None:
        # The last rank to join is the one that joined in the latest cycle (highest on ties).
        last = max(self._joined, key=lambda r: (self._joined[r][0], r))
        counters: dict[str, int] = {}
        for _, theirs in self._joined.values():
            for k, v in (theirs or {}).items():
                counters[k] = max(counters.get(k, 0), v)
        self._joined.clear()
        with self._cv:
            # Auto-names must agree again after ranks ran different numbers of operations.
            for k, v in counters.items():
                self._counters[k] = max(self._counters.get(k, 0), v)
            req = self._local.pop(JOIN, None)
        if req is not None:
            req.handle.resolve(self.global_ranks[last])

    def join_request(self) -> Request:
        """A join request carrying this rank's auto-name counters."""
        with self._cv:
            counters = dict(self._counters)
        return Request(JOIN, Meta("join", extra=counters))


def exchange(g: Group, items: list[tuple[str, Meta]], slot: int = 2048
             ) -> tuple[list[list[tuple[str, Meta]]], int]:
    """Allgather every rank's list of ``(name, descriptor)``.

    One collective of fixed ``slot``-byte messages (an 8-byte length, then the pickle); when
    some rank's message is longer, a second round carries the full messages and the slot
    grows for the next cycles (every rank sees the lengths, so all grow alike).

    Returns:
        The per-rank lists and the slot size to use next time.
    """
    payload = pickle.dumps(items) if items else b""
    size = g.size
    dev = g.control_device()
    send = torch.zeros(8 + slot, dtype=torch.uint8)
    send[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    head = payload[:slot]
    if head:
        send[8: 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    out = torch.empty(size * (8 + slot), dtype=torch.uint8, device=dev)
    g.all_gather(out, send.to(dev))
    rows = out.cpu().view(size, 8 + slot)
    lens = rows[:, :8].contiguous().view(torch.int64).reshape(-1).tolist()
    longest = max(lens)
    if longest > slot:
        full = torch.zeros(longest, dtype=torch.uint8)
        full[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        big = torch.empty(size * longest, dtype=torch.uint8, device=dev)
        g.all_gather(big, full.to(dev))
        rows = big.cpu().view(size, longest)
        raw = [rows[i, :n].numpy().tobytes() for i, n in enumerate(lens)]
        slot = 1 << (longest - 1).bit_length()
    else:
        raw = [rows[i, 8: 8 + n].numpy().tobytes() for i, n in enumerate(lens)]
    return [pickle.loads(b) if b else [] for b in raw], slot


@atexit.register
def _close_idle_engines() -> None:
    for e in list(_engines):
        e.close_if_idle()
