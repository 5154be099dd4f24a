"""A parameter-server worker: computes gradients, pushes them, pulls fresh parameters.

Workers keep no optimizer state. One step: forward, backward, copy each server's slice of the
gradients into a flat CPU buffer, compress it, push it (one atomic message per server, see
:mod:`parlay.ps.wire`), then wait for every server's reply, which carries the parameters
released by the consistency policy, and copy them into the model. In ``sync`` mode without
compression the servers ask (in their first reply) for chunked pushes: every chunk of every
server's slice is posted at once, and the parameters come back chunk by chunk while later
chunks still go up (see :mod:`parlay.ps.chunks`).
"""
from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import comm
from parlay._tree import to_device
from parlay.compress.base import Compressor
from parlay.compress.reduce import further_rounds
from parlay.errors import CheckpointError, CommError, ConfigError
from parlay.ps.chunks import chunk_bounds
from parlay.ps.plan import ShardPlan
from parlay.ps.server import lost_message
from parlay.ps.wire import (HEADER_BYTES, TAG_PUSH, TAG_PUSH_CHUNK, TAG_REPLY, TAG_REPLY_CHUNK,
                            Err, Message, Op, encode_ctx, pack, push_capacity, reply_capacity,
                            unpack)

__all__ = ["Worker"]

log = logging.getLogger("parlay.ps")


class Worker:
    """The worker side of the parameter-server protocol.

    Args:
        index: Worker index (0-based among the workers).
        rank: This process's global rank.
        plan: The placement shared by every rank.
        model: The model this worker trains (any device).
        compressor: Encodes pushes (keeps error-feedback residuals, if any).
        server_ranks: Global ranks of the servers, by server index.
        group: The gloo group of all ranks that carries PS traffic.
        timeout: The servers' lost-worker timeout (for error messages).
        num_workers: Number of workers (an epoch end's reply holds a count for each).
        exact: ``sync``: the servers must agree on this worker's step. ``async``/``stale``: a
            worker lost between its pushes to two servers left them a step apart; it resumes
            the older step, and later counts each server's clock from that offset.
    """

    def __init__(self, index: int, rank: int, plan: ShardPlan, model: nn.Module,
                 compressor: Compressor, server_ranks: list[int], group: Any,
                 timeout: float, num_workers: int = 1, exact: bool = True) -> None:
        self.exact, self.skew = exact, [0] * len(server_ranks)
        self.index, self.rank, self.plan, self.model = index, rank, plan, model
        self.compressor, self.server_ranks = compressor, server_ranks
        self.group, self.timeout = group, timeout
        named = dict(model.named_parameters())
        # the first trainable one's, as the server and the plan take it (frozen ones never push)
        self.dtype = next(p for p in named.values() if p.requires_grad).dtype
        self.frozen = [(n, p) for n, p in named.items() if not p.requires_grad]  # as planned
        self.slices: list[list[tuple[torch.Tensor, int, int, int]]] = []
        self.grads: list[torch.Tensor] = []
        self.push_bufs: list[torch.Tensor] = []
        self.reply_bufs: list[torch.Tensor] = []
        self._heard_buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)  # answers a WAIT
        for s in range(plan.num_servers):
            numel = plan.numel(s)
            self.slices.append([(named[p.name], p.start, p.length, p.offset)
                                for p in plan.pieces(s)])
            self.grads.append(torch.zeros(numel, dtype=self.dtype))
            # Same computation as the server's, so both agree on the message capacity.
            self.push_bufs.append(torch.empty(push_capacity(
                compressor, numel, self.dtype, f"ps{s}", len(self.slices[s])), dtype=torch.uint8))
            self.reply_bufs.append(torch.empty(
                reply_capacity(numel, self.grads[s].element_size(), num_workers),
                dtype=torch.uint8))
        self.versions = [0] * plan.num_servers
        #: Per server, the chunks of a push (``None``: one message), as the server asked.
        self.bounds: list[list[tuple[int, int]] | None] = [None] * plan.num_servers
        self.pulled: list[torch.Tensor | None] = [None] * plan.num_servers
        self.step = 0
        self.lr_factor = 1.0
        self.histogram: collections.Counter[int] = collections.Counter()
        self.closed = False
        self.told_error = False
        self.finished: list[int] = []  # workers done (not lost) at the last epoch end
        #: Context of the forward pass and loss (e.g. bf16 autocast, set by the "ps" strategy).
        self.forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = \
            contextlib.nullcontext
        #: Called with (loss, model) after backward, before the push (the non-finite check).
        self.before_push: Callable[[torch.Tensor, Any], None] | None = None

    @property
    def global_step(self) -> int:
        """Parameter version: updates applied so far (the smallest over the servers)."""
        return min(self.versions)

    # -- protocol -----------------------------------------------------------------------------
    def _exchange(self, op: int, payloads: list[list[torch.Tensor]] | None,
                  what: str, extra: int = 0, scalar: float | None = None) -> list[Message]:
        chunked = op == Op.PUSH and any(b is not None for b in self.bounds)
        recvs = [(s, comm.recv(self.reply_bufs[s], src=r, tag=TAG_REPLY, group=self.group,
                               async_op=True)) for s, r in enumerate(self.server_ranks)]
        pulls = self._post_chunks(recv=True) if chunked else []
        sends = []
        for s, r in enumerate(self.server_ranks):
            n = len(self.bounds[s] or ()) if chunked else 0
            msg = Message(op, self.index, self.step, self.versions[s],
                          self.lr_factor if scalar is None else scalar,
                          extra=self.plan.fingerprint() if op == Op.HELLO else n or extra,
                          tensors=payloads[s] if payloads is not None else [])
            out = pack(msg, self.push_bufs[s])
            sends.append((s, comm.send(out, r, tag=TAG_PUSH, group=self.group, async_op=True)))
        if chunked:
            sends += self._post_chunks(recv=False)
        self._wait(sends + recvs, what)
        replies = [unpack(buf) for buf in self.reply_bufs]
        waiting = [s for s, m in enumerate(replies) if m.op == Op.WAIT]
        while waiting:  # slower workers hold these servers: listen on, then say so
            heard = pack(Message(Op.WAIT, self.index, self.step, 0), self._heard_buf)
            recvs = [(s, comm.recv(self.reply_bufs[s], src=self.server_ranks[s], tag=TAG_REPLY,
                                   group=self.group, async_op=True)) for s in waiting]
            self._wait([(s, comm.send(heard, self.server_ranks[s], tag=TAG_PUSH,
                                      group=self.group, async_op=True)) for s in waiting]
                       + recvs, what)
            for s in waiting:
                replies[s] = unpack(self.reply_bufs[s])
            waiting = [s for s in waiting if replies[s].op == Op.WAIT]
        self._check(replies, what)
        self._wait(pulls, what)
        return replies

    def _post_chunks(self, recv: bool) -> list[tuple[int, comm.Handle]]:
        """Post every chunk's send (of the gradient) or receive (of the parameters), chunk
        ``k`` of every server before chunk ``k + 1`` of any, so all servers start at once."""
        out = []
        longest = max(len(b) for b in self.bounds if b is not None)
        for k in range(longest):
            for s, r in enumerate(self.server_ranks):
                bounds = self.bounds[s]
                if bounds is None or k >= len(bounds):
                    continue
                a, b = bounds[k]
                if recv:
                    pulled = self.pulled[s]
                    assert pulled is not None
                    h = comm.recv(pulled[a:b], src=r, tag=TAG_REPLY_CHUNK + k, group=self.group,
                                  async_op=True)
                else:
                    h = comm.send(self.grads[s][a:b], r, tag=TAG_PUSH_CHUNK + k,
                                  group=self.group, async_op=True)
                out.append((s, h))
        return out

    def _wait(self, works: list[tuple[int, comm.Handle]], what: str) -> None:
        """Wait for ``(server, handle)`` pairs in order; a failure names the server."""
        s = 0  # the server whose handle failed, named in the error
        try:
            for server, h in works:
                s = server
                h.wait()
        except CommError as e:
            r = self.server_ranks[s]
            dropped = "" if self.exact else (
                f" (or, if this worker was paused or slow for longer than the lost-worker "
                f"timeout, {self.timeout:g} s, the servers dropped it and went on without it)")
            raise CommError(f"{what} on worker {self.index} (rank {self.rank}): parameter server "
                            f"{s} (rank {r}) did not answer{dropped}: {e}", op=e.op,
                            rank=self.rank, peer=r) from e

    def _check(self, replies: list[Message], what: str) -> None:
        """Raise the error a server's reply reports, if any."""
        for s, m in enumerate(replies):
            if m.op == Op.ERROR and int(m.scalar) == Err.MISMATCH:
                self.told_error = True
                raise ConfigError(f"worker {self.index} (rank {self.rank}) built a model whose "
                                  f"parameters differ from parameter server {s}'s (names, shapes, "
                                  "dtypes or placement options). Hint: build the same model with "
                                  "the same DistributedSession options on every rank.")
            if m.op == Op.ERROR and int(m.scalar) == Err.SAVE_MISMATCH:
                self.told_error = True
                raise CheckpointError(f"{what} at step {self.step} on worker {self.index} "
                                      f"(rank {self.rank}): the live workers asked parameter "
                                      f"server {s} for checkpoints (or epoch ends) of different "
                                      "steps, or some went on training while others waited at "
                                      "one, so no consistent cut exists. Hint: every worker "
                                      "must checkpoint and end epochs at the same steps (same "
                                      "Trainer options; call save_checkpoint() on every "
                                      "worker, not only on one).")
            if m.op == Op.ERROR:
                self.told_error = True
                raise CommError(lost_message(int(m.scalar), m.extra - len(self.server_ranks),
                                             m.extra, self.timeout, f"{what} (step {self.step})"),
                                op="ps " + what, rank=self.rank, peer=m.extra)

    def _load(self, replies: list[Message], chunked: bool = False) -> None:
        with torch.no_grad():
            for s, m in enumerate(replies):
                pulled = self.pulled[s]
                flat = pulled if chunked and pulled is not None else m.tensors[0]
                for p, start, length, off in self.slices[s]:
                    p.view(-1)[start: start + length].copy_(flat[off: off + length])
                self.versions[s] = m.version
        clocks = {m.step - k for m, k in zip(replies, self.skew)}
        if len(clocks) != 1:
            raise CheckpointError(f"the parameter servers disagree on worker {self.index}'s step "
                                  f"({sorted(clocks)}): they resumed from checkpoints of "
                                  "different times. Hint: resume every server from the same run.")
        self.step = clocks.pop()

    def hello(self) -> None:
        """First pull: take the servers' parameters (and step, when resuming)."""
        replies = self._exchange(Op.HELLO, None, "first pull")
        for s, m in enumerate(replies):  # the server's chunk size (0: one message per push)
            numel = self.plan.numel(s)
            self.bounds[s] = chunk_bounds(numel, m.extra) if m.extra > 0 else None
            self.pulled[s] = torch.empty(numel, dtype=self.dtype) if m.extra > 0 else None
        first = min(m.step for m in replies)
        if not self.exact and any(m.step != first for m in replies):
            # async/stale servers checkpoint apart (and a worker may be lost between pushes):
            # the worker goes on from its oldest step, each server counting from its own
            self.skew = [m.step - first for m in replies]
            log.warning("worker %d (rank %d): the parameter servers hold steps %s of it (they "
                        "checkpointed at different times, or it was lost between its pushes); "
                        "it resumes at step %d", self.index, self.rank,
                        [m.step for m in replies], first)
        self._load(replies)

    def train_step(self, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> float:
        """Forward, backward, push the gradients, pull the released parameters.

        Returns:
            This worker's loss on ``batch`` (computed before the update).
        """
        thawed = [n for n, p in self.frozen if p.requires_grad]
        if thawed:
            raise ConfigError(f"parameter(s) {', '.join(thawed[:3])} were frozen when the "
                              "session started and became trainable: the servers hold no "
                              "shard of them, so they would never be trained. Hint: make them "
                              "trainable before the session starts (a new session to unfreeze).")
        x, y = _split(batch)
        dev = next(self.model.parameters()).device
        x, y = to_device(x if isinstance(x, tuple) else (x,), dev), to_device(y, dev)
        for param in self.model.parameters():
            param.grad = None
        with self.forward_context():
            loss = loss_fn(self.model(*x), y)
        loss.backward()
        if self.before_push is not None:
            self.before_push(loss, self.model)
        payloads = []
        for s in range(self.plan.num_servers):
            g = self.grads[s]
            for p, start, length, off in self.slices[s]:
                if p.grad is None:  # no gradient this step (frozen, unused): zeros, flagged
                    g[off: off + length].zero_()
                else:
                    grad = p.grad.to_dense() if p.grad.is_sparse else p.grad  # (an Embedding's)
                    g[off: off + length].copy_(grad.reshape(-1)[start: start + length])
            # The last tensor ends with a flag per piece, 1: no gradient (the server steps no
            # piece that no push has a gradient for, as torch skips grad=None). Chunked: alone.
            flags = torch.tensor([p.grad is None for p, *_ in self.slices[s]], dtype=torch.int64)
            whole = g.numel() and self.bounds[s] is None  # (chunked: sent as it is)
            *payload, codes = self._encode(g, f"ps{s}") if whole else [flags[:0]]
            payloads.append([*payload, torch.cat([codes, flags])])
        replies = self._exchange(Op.PUSH, payloads, "push")
        for m in replies:
            self.histogram[int(m.scalar)] += 1
        self._load(replies, chunked=True)
        return float(loss.detach())

    def _encode(self, flat: torch.Tensor, key: str) -> list[torch.Tensor]:
        payload, ctx = self.compressor.compress(flat, key)
        # Further rounds (fp16's overflow retry) resolve here: this worker's payload is the
        # whole "reduction" the server will decode, so each round's sum is the payload itself.
        payload = further_rounds(self.compressor, payload, ctx, None, lambda nxt: nxt)
        return [*payload, encode_ctx(ctx)]

    def save_shards(self, tag: int) -> None:
        """Ask every server to checkpoint its shard as ``tag`` (this worker's step) and wait
        until it is written; servers write once every live worker asked for ``tag``."""
        for s, m in enumerate(self._exchange(Op.SAVE, None, "checkpoint", extra=int(tag))):
            self._expect(m, Op.SAVED, s, "checkpoint")

    def end_epoch(self, epoch: int, samples: int) -> tuple[int, list[int]]:
        """Tell every server this worker ended ``epoch`` after training ``samples`` of it, and
        wait until every live worker did (a barrier, like :meth:`save_shards`).

        Returns:
            The samples trained of ``epoch`` by every worker that ended it, and the indices of
            the workers that train on (live at every server): the same on every live worker.
        """
        replies = self._exchange(Op.EPOCH, None, "epoch end", extra=int(epoch),
                                 scalar=float(samples))
        for s, m in enumerate(replies):
            self._expect(m, Op.EPOCHED, s, "epoch end")
        counts = list(zip(*(m.tensors[0].tolist() for m in replies)))  # per worker, per server
        self.finished = [w for w, c in enumerate(counts) if max(c) == -2]  # not lost: done
        return (sum(max(0, *c) for c in counts),
                [w for w, c in enumerate(counts) if min(c) >= 0])

    def _expect(self, m: Message, op: int, s: int, what: str) -> None:
        if m.op != op:
            raise CommError(f"{what} on worker {self.index} (rank {self.rank}): parameter server "
                            f"{s} answered op {m.op}, expected {op}. Hint: every rank must run "
                            "the same parlay version.", op="ps " + what, rank=self.rank,
                            peer=self.server_ranks[s])

    def finish(self) -> None:
        """Tell every server this worker is done and wait for their acknowledgement."""
        if self.closed or self.told_error:
            return
        self.closed = True
        self._exchange(Op.DONE, None, "finish")

    def fail(self) -> None:
        """Tell every server this worker stops because of an error (best effort, no reply)."""
        if self.closed or self.told_error:
            return
        self.closed = True
        works = []
        for s, r in enumerate(self.server_ranks):
            out = pack(Message(Op.FAIL, self.index, self.step, self.versions[s]),
                       self.push_bufs[s])
            try:
                wk = dist.isend(out, dst=r, group=self.group, tag=TAG_PUSH)
                if wk is not None:
                    works.append(wk)
            except Exception as e:  # noqa: BLE001 - already failing; the server times out
                log.debug("worker %d: could not report its failure: %s", self.index, e)
        for wk in works:
            try:
                # A bounded wait: this process is failing anyway, so a timeout that closes the
                # group's connections costs nothing, and a dead server must not hold us.
                wk.wait(timeout=_dt.timedelta(seconds=min(5.0, self.timeout)))
            except Exception as e:  # noqa: BLE001
                log.debug("worker %d: failure report not delivered: %s", self.index, e)


def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    got = type(batch).__name__
    if isinstance(batch, (tuple, list)):
        got += f" of length {len(batch)}"
    raise ConfigError(f"train_step expects batch=(inputs, targets), got {got}. "
                      "Hint: pass sess.train_step((x, y), loss_fn); loss_fn(model(x), y) -> loss.")
