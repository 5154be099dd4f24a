"""Pipelined synchronous pushes: gradients go up and parameters come back in chunks.

A push-then-pull step keeps each host link busy in one direction at a time: a worker's link
sends its gradient, then sits idle while the servers wait for every worker, then receives. In
``sync`` mode with dense pushes (no compressor), a worker instead sends each server a small
header and then its gradient slice as ``n`` chunks, every one its own point-to-point message,
all posted at once (gloo keeps each connection busy). A server reduces chunk ``k`` as soon as
every worker's chunk ``k`` arrived, applies the optimizer to the parameters inside it and sends
the chunk's new values back at once, while later chunks are still coming in: pulls overlap
pushes, both directions of every link carry data (BytePS and Li et al. 2014 pipeline the same
way).

Exactness: each worker's chunks land in a buffer of their own, and a chunk is summed in worker
order once all of them are there, so the result never depends on arrival order and equals the
unchunked (and allreduce) update to the bit. The server's parameters are cut at chunk bounds, so
a chunk's update is an optimizer step over whole parameters. Only for torch's element-wise
optimizers (:data:`ELEMENTWISE`: SGD, Adam, AdamW, RMSprop, ...) is that the same as one step
over the shard; with any other optimizer (Adafactor, LAMB, a custom one) pushes stay unchunked.

``PARLAY_PS_CHUNK_BYTES`` sets the chunk size (default 256 KiB; ``0`` turns chunking off).
Async and stale pushes stay single atomic messages: they are applied as they arrive, and a
worker lost mid-push must leave nothing of it applied.
"""
from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import queue
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from parlay import comm
from parlay.compress.base import NoneCompressor
from parlay.errors import CommError, ConfigError
from parlay.ps.wire import MAX_CHUNKS, TAG_PUSH_CHUNK, TAG_REPLY_CHUNK, Message

__all__ = ["CHUNK_ENV", "ELEMENTWISE", "DEFAULT_CHUNK_BYTES", "chunk_bytes", "chunk_numel",
           "chunk_bounds", "cut_pieces", "on_one_host", "ChunkedServing"]

log = logging.getLogger("parlay.ps")

# A receive is never timed out: a timed-out gloo wait closes every connection of the group, so
# silence is judged by the server's deadlines instead (see parlay.ps.server).
_FOREVER = _dt.timedelta(days=365)

#: Environment variable with the chunk size in bytes (``0``: one message per push).
CHUNK_ENV = "PARLAY_PS_CHUNK_BYTES"
#: Default chunk size: small next to a shard (a deep pipeline), large next to the per-message
#: cost (a few hundred microseconds of Python and one gloo rendezvous).
DEFAULT_CHUNK_BYTES = 256 * 1024


#: Optimizers whose update of an element depends on that element alone (state included), so a
#: step over a chunk of a tensor equals that part of a step over the whole tensor.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta, torch.optim.Rprop)


def chunk_bytes(environ: dict[str, str] | None = None, one_host: bool = False) -> int:
    """The chunk size from ``PARLAY_PS_CHUNK_BYTES``; unset: :data:`DEFAULT_CHUNK_BYTES`, or 0
    when every rank is on ``one_host``. There a push and a pull are copies on the same cores,
    so overlapping them gains nothing and each chunk adds its per-message cost (measured: sync
    steps are slower chunked than whole; figures in docs/benchmarks.md, "Design measurements").

    Raises:
        ConfigError: The variable is not an integer >= 0.
    """
    raw = (os.environ if environ is None else environ).get(CHUNK_ENV, "").strip()
    if not raw:
        return 0 if one_host else DEFAULT_CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{CHUNK_ENV} must be a number of bytes >= 0, got {raw!r}. Hint: "
                          f"e.g. {CHUNK_ENV}={DEFAULT_CHUNK_BYTES} (0 sends each push as one "
                          "message).")
    return value


def on_one_host() -> bool:
    """Whether every rank of this initialised parlay world runs on this host (False when
    unknown)."""
    from parlay import runtime

    # unknown (not initialised): assume hosts apart (chunk)
    return runtime.is_initialized() and runtime.cluster().one_host


def chunk_numel(numel: int, itemsize: int, nbytes: int, aggregate: bool,
                compressor: Any, optimizer_cls: Any) -> int:
    """Elements per chunk of a ``numel`` shard, or 0 when pushes are not chunked (``async`` or
    ``stale`` consistency, a compressor, an optimizer not in :data:`ELEMENTWISE`, chunking
    off, or an empty shard). At most :data:`~parlay.ps.wire.MAX_CHUNKS` chunks, so every chunk
    has a tag of its own."""
    if not (aggregate and isinstance(compressor, NoneCompressor) and nbytes and numel
            and optimizer_cls in ELEMENTWISE):
        return 0
    return max(1, nbytes // itemsize, math.ceil(numel / MAX_CHUNKS))


def chunk_bounds(numel: int, per_chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the chunks of a ``numel`` buffer (one chunk if ``per_chunk``
    is 0)."""
    if per_chunk <= 0 or numel <= per_chunk:
        return [(0, numel)]
    return [(a, min(a + per_chunk, numel)) for a in range(0, numel, per_chunk)]


def cut_pieces(pieces: Sequence[Any], bounds: list[tuple[int, int]]
               ) -> list[tuple[int, int, tuple[int, ...], int]]:
    """The server's parameters: each plan piece cut at chunk bounds.

    Returns:
        ``(offset, length, shape, chunk)`` in buffer order; a piece left whole keeps its shape,
        a cut one is 1-D.
    """
    out = []
    k = 0
    for p in pieces:
        pos, end = p.offset, p.offset + p.length
        while True:
            while k + 1 < len(bounds) and bounds[k + 1][0] <= pos:
                k += 1
            stop = min(end, bounds[k][1])
            whole = pos == p.offset and stop == end
            out.append((pos, stop - pos, tuple(p.shape) if whole else (stop - pos,), k))
            if stop >= end:
                break
            pos = stop
    return out


class ChunkedServing:
    """Server side of chunked pushes (a mixin of :class:`~parlay.ps.server.Server`).

    Uses the server's ``flat``, ``grad``, ``optimizer``, ``core``, ``worker_ranks``,
    ``group`` and ``index``; call :meth:`_init_chunks` once ``flat`` exists.
    """

    flat: torch.Tensor
    grad: torch.Tensor
    optimizer: torch.optim.Optimizer
    core: Any
    worker_ranks: list[int]
    group: Any
    index: int
    _q: queue.Queue[tuple[str, int, Any]]

    def _init_chunks(self, per_chunk: int, params: list[tuple[Any, int, int]]) -> None:
        """``params``: (parameter, chunk index, plan piece index) of every server parameter."""
        self.chunk_numel = per_chunk
        self.bounds = chunk_bounds(self.flat.numel(), per_chunk)
        # Each parameter's gradient is a fixed view of ``grad``; a chunk's optimizer step sees
        # only that chunk's parameters with a gradient (optimizers skip grad=None).
        self._all = [(p, p.grad) for p, _, _ in params]
        self._piece = [i for _, _, i in params]
        self._skip = [False] * len(params)  # this round: no push has a gradient for it
        self._by_chunk: list[list[int]] = [[] for _ in self.bounds]
        for j, (_, k, _) in enumerate(params):
            self._by_chunk[k].append(j)
        n = len(self.worker_ranks)
        self._wbuf = ([torch.empty_like(self.flat) for _ in range(n)] if per_chunk else [])
        self._hdr: dict[int, Message] = {}
        self._got = [0] * n
        self._applied = 0
        self._chunk_sends: dict[int, list[Any]] = {}

    def post_chunk_recvs(self, w: int, msg: Message) -> list[Any]:
        """In worker ``w``'s receiver thread: post the receives of the chunks ``msg``
        announces (into ``w``'s own buffer), in chunk order."""
        if msg.extra != len(self.bounds) or not self.chunk_numel:
            raise CommError(f"parameter server {self.index}: worker {w} announced a push in "
                            f"{msg.extra} chunks, this server expects {len(self.bounds)}. "
                            "Hint: every rank must run the same parlay version and "
                            f"{CHUNK_ENV}.", op="ps serve", rank=self.index,
                            peer=self.worker_ranks[w])
        buf, src = self._wbuf[w], self.worker_ranks[w]
        return [dist.irecv(buf[a:b], src=src, group=self.group, tag=TAG_PUSH_CHUNK + k)
                for k, (a, b) in enumerate(self.bounds)]

    def _receive_chunks(self, w: int, msg: Message) -> bool:
        """Receive the chunks ``msg`` announces; False when the worker's connection closed."""
        try:
            works = self.post_chunk_recvs(w, msg)
        except Exception as e:  # noqa: BLE001 - a mismatched worker: lost, with the reason
            log.error("ps%d: %s", self.index, e)
            self._q.put(("gone", w, e))
            return False
        self._q.put(("msg", w, msg))
        for k, work in enumerate(works):
            try:
                work.wait(timeout=_FOREVER)
            except Exception as e:  # noqa: BLE001 - the worker's connection closed mid-push
                self._q.put(("gone", w, e))
                return False
            self._q.put(("chunk", w, k))
        return True

    def _drain_chunk_sends(self, lost: list[int]) -> None:
        """Wait for the chunks sent to workers that are not lost (at the end of serving)."""
        for w, hs in list(self._chunk_sends.items()):
            for h in hs:
                if w not in lost:
                    _wait_quiet(h, self.index, w)
        self._chunk_sends.clear()

    @property
    def torn(self) -> bool:
        """Some chunks of an unfinished round were applied (a sync round broke mid-way)."""
        return self._applied > 0

    def _chunk_header(self, w: int, msg: Message) -> None:
        for h in self._chunk_sends.pop(w, []):  # delivered: w has pushed again since
            _wait_quiet(h, self.index, w)
        self._hdr[w] = msg
        self._got[w] = 0
        self._advance()

    def _chunk_arrived(self, w: int, k: int, now: float) -> list[Any]:
        """Chunk ``k`` of worker ``w`` is in; the push is complete after its last chunk."""
        msg = self._hdr.get(w)
        if msg is None:
            return []  # a push answered with an error already
        self._got[w] = k + 1
        if self.core.failure is None:
            self.core.heard(w, now)
            self._advance()
        if self._got[w] < len(self.bounds):
            return []
        # After a failure this push is answered with the error (the others were told already).
        # The gradient "value" is the worker index: the chunks are applied already.
        replies: list[Any] = self.core.push(w, msg.step, msg.version, w, msg.scalar, now)
        return replies

    def _advance(self) -> None:
        """Apply every chunk that every active worker has sent."""
        c = self.core
        act = c.active()
        if c.failure is not None or not act or any(w not in self._hdr for w in act):
            return
        ready = min(self._got[w] for w in act)
        for k in range(self._applied, ready):
            self._apply_chunk(k, act, self._hdr[act[0]].scalar)

    def _finish_chunked_round(self, workers: list[int], lr_factor: float) -> None:
        """The round is complete (``workers``: whose pushes it holds): apply what is left."""
        for k in range(self._applied, len(self.bounds)):
            self._apply_chunk(k, workers, lr_factor)
        self._applied = 0
        for p, g in self._all:
            p.grad = g

    def _apply_chunk(self, k: int, workers: list[int], lr_factor: float) -> None:
        a, b = self.bounds[k]
        g = self.grad[a:b]
        # Average in worker order: deterministic, and equal to allreduce's mean.
        g.copy_(self._wbuf[workers[0]][a:b])
        for w in workers[1:]:
            g.add_(self._wbuf[w][a:b])
        if len(workers) > 1:
            g.div_(len(workers))
        self._set_lr(lr_factor)
        if k == 0:
            self._leave_out([self._hdr[w].tensors[-1] for w in workers])
        self._arm(self._by_chunk[k])
        self.optimizer.step()
        self._applied = k + 1
        for w in workers:
            h = self._post_send(self.flat[a:b], w, TAG_REPLY_CHUNK + k)
            if h is not None:
                self._chunk_sends.setdefault(w, []).append(h)

    def _leave_out(self, flags: list[torch.Tensor]) -> None:
        """The round's pushes' no-gradient flags (one per plan piece, each): a piece that none
        has a gradient for is left out of the round's optimizer steps, as torch steps no
        parameter whose grad is None (no weight decay, momentum or state moves it)."""
        none = torch.stack(flags).all(0).tolist() if flags else []
        self._skip = [i >= 0 and bool(none[i]) for i in self._piece]

    def _arm(self, chosen: Sequence[int]) -> None:
        """Give the next optimizer step the gradients of parameters ``chosen`` (indices into
        ``_all``) that are not left out; every other parameter's grad is None."""
        for p, _ in self._all:
            p.grad = None
        for j in chosen:
            if not self._skip[j]:
                p, pg = self._all[j]
                p.grad = pg

    def _post_send(self, tensor: torch.Tensor, w: int, tag: int) -> Any:
        """Post a send to worker ``w``; ``None`` when posting it failed at once (gloo raises
        there when the connection already closed): then ``w`` is reported gone, as its
        receiver thread will, and the error that ends serving names the worker, not the send."""
        try:
            return comm.send(tensor, self.worker_ranks[w], tag=tag, group=self.group,
                             async_op=True)
        except CommError as e:
            log.debug("ps%d: send to worker %d failed at once: %s", self.index, w, e)
            self._q.put(("gone", w, e))
            return None

    def _set_lr(self, lr_factor: float) -> None:  # the server's: scale the base lrs
        raise NotImplementedError


def _wait_quiet(h: Any, index: int, w: int) -> None:
    try:
        h.wait()
    except CommError as e:  # that worker died; its receiver thread reports it
        log.debug("ps%d: chunk to worker %d not delivered: %s", index, w, e)
