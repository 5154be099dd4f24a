"""A parameter server: holds one shard, applies a torch optimizer to it, answers workers.

Transport (DESIGN.md "PS traffic runs over a gloo group on CPU tensors"): one gloo group of all
ranks. One receiver thread per worker does that worker's blocking receives and queues whole
messages, so messages are served in arrival order; the main thread owns all state, applies
updates and sends replies. A receive from one peer fails as soon as that peer's connection
closes (its process died), so a killed worker is dropped at once, and every receiver thread has
ended when serving ends (a thread still blocked in gloo while the group is destroyed can abort
the process at exit). The queue lets the main thread wake up at a deadline: a worker silent for
``timeout`` seconds after being answered is declared lost (a timed-out gloo wait would close
every connection of the group, so the receive itself never times out).
"""
from __future__ import annotations

import bisect
import datetime as _dt
import logging
import os
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import comm
from parlay.compress.base import Compressor
from parlay.errors import CommError, ConfigError
from parlay.launch import mark_dropped
from parlay.ps.chunks import (ChunkedServing, chunk_bounds, chunk_bytes, chunk_numel, cut_pieces,
                              on_one_host)
from parlay.ps.consistency import LOST, Consistency, Reply, ServerCore
from parlay.ps.plan import ShardPlan
from parlay.ps.shard_io import SNAPSHOTS_KEPT, ShardPersistence, snapshot_steps
from parlay.statefile import remove_temporaries
from parlay.ps.wire import (
    HEADER_BYTES,
    TAG_PUSH,
    TAG_REPLY,
    Err,
    Message,
    Op,
    decode_ctx,
    pack,
    probe,
    push_capacity,
    reply_capacity,
    unpack,
)

__all__ = ["Server", "lost_message", "snapshot_steps", "SNAPSHOTS_KEPT"]

log = logging.getLogger("parlay.ps")

_FOREVER = _dt.timedelta(days=365)

def lost_message(kind: int, peer_index: int, peer_rank: int, timeout: float, where: str) -> str:
    """The text of the error a worker raises for an ERROR reply (shared by server and worker)."""
    if kind == Err.EVICTED:
        return (f"{where}: this worker (rank {peer_rank}) was declared lost by the parameter "
                f"server after {timeout:g} s of silence and may not rejoin. Hint: raise the "
                "timeout (parlay.init(timeout=...) / PARLAY_TIMEOUT) if steps can be this slow.")
    what = {Err.LOST: "was lost (the parameter server heard nothing from it for "
                      f"{timeout:g} s)",
            Err.GONE: "was lost (its connection closed: the process died)"}.get(
                kind, "failed (it raised an error)")
    return (f"{where}: worker {peer_index} (rank {peer_rank}) {what}; synchronous training "
            "needs every worker's gradient for each step, so it cannot continue. Hint: check "
            f"rank {peer_rank}'s log, or train with consistency='async' or 'stale:s' to "
            "survive lost workers.")


class Server(ShardPersistence, ChunkedServing):
    """Serve one shard of the parameters.

    Args:
        index: Server index (= its global rank; servers take the first ranks).
        plan: The placement shared by every rank.
        model: This rank's copy of the model; its parameter values initialise the shard
            (unless a checkpoint is resumed).
        optimizer_cls: Any ``torch.optim.Optimizer`` class.
        optimizer_args: Its keyword arguments.
        policy: Consistency policy.
        compressor: Decodes pushes (a server-side instance of the workers' compressor).
        worker_ranks: Global ranks of the workers, by worker index.
        group: The gloo group of all ranks that carries PS traffic.
        timeout: Seconds a worker may stay silent before it is declared lost.
        checkpoint_dir: Where checkpoints are written (``None``: none; see
            :class:`~parlay.ps.shard_io.ShardPersistence`).
        checkpoint_every: Save every this many versions (and at the end).
        tagged: Checkpoints are taken when the workers ask (:meth:`snapshot`, files
            ``ps-<index>.step-<tag>.pt``) instead of every ``checkpoint_every`` versions.
        resume_step: The step (``sync``: version) to resume, agreed by every rank.
        memory: In-memory snapshots of this server (``sync`` only: see
            :mod:`parlay.ps.shard_io`), taken right after every update; ``None``: none.
        from_memory: ``resume_step`` is read from ``memory`` rather than from disk.
        run: The session's run id, recorded in this server's checkpoint files.
    """

    def __init__(self, index: int, plan: ShardPlan, model: nn.Module,
                 optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any],
                 policy: Consistency, compressor: Compressor, worker_ranks: list[int],
                 group: Any, timeout: float, checkpoint_dir: str | None = None,
                 checkpoint_every: int | None = 100, *, tagged: bool = False,
                 resume_step: int | None = None, memory: Any = None,
                 from_memory: bool = False, run: int = 0) -> None:
        self.index, self.plan, self.policy, self.run = index, plan, policy, run
        self.compressor = compressor
        self.worker_ranks = worker_ranks
        self.group, self.timeout = group, timeout
        self.checkpoint_every = None if tagged else checkpoint_every
        self.dir = checkpoint_dir
        self.memory = memory if policy.aggregate else None
        self.path = (os.path.join(checkpoint_dir, f"ps-{index}.pt")
                     if checkpoint_dir and not tagged else None)
        if checkpoint_dir:
            remove_temporaries(checkpoint_dir, f"ps-{index}.*")
        self.pieces = plan.pieces(index)
        self.model = model
        named = dict(model.named_parameters())
        dtype = plan.params[0][2]
        numel = plan.numel(index)
        self.flat = torch.empty(numel, dtype=dtype)
        self.grad = torch.zeros(numel, dtype=dtype)
        for p in self.pieces:
            src = named[p.name].detach().reshape(-1)[p.start: p.start + p.length]
            self.flat[p.offset: p.offset + p.length].copy_(src)
        per_chunk = chunk_numel(numel, self.flat.element_size(),
                                chunk_bytes(one_host=on_one_host()), policy.aggregate,
                                compressor, optimizer_cls)
        cut = self._parameters(per_chunk)
        self.params: list[nn.Parameter] = [p for p, _, _ in cut]
        try:
            self.optimizer = optimizer_cls(self.params, **optimizer_args)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"parameter server {index} could not build "
                              f"{getattr(optimizer_cls, '__name__', optimizer_cls)} with "
                              f"optimizer_args={optimizer_args}: {e}") from e
        self.base_lrs = [g.get("lr") for g in self.optimizer.param_groups]
        self._init_chunks(per_chunk, cut)
        # Pushes carry their compressor context's values (wire.encode_ctx); its structure comes
        # from a template made by a probe compress at setup.
        self.key = f"ps{index}"
        self.ctx_template = probe(compressor, numel, dtype, self.key)[1]
        self.push_capacity = push_capacity(compressor, numel, dtype, self.key, len(self.pieces))
        self.reply_capacity = reply_capacity(self.flat.numel(), self.flat.element_size(),
                                             len(worker_ranks))
        version, clocks = self._resume(tagged, resume_step, from_memory)
        self.core: ServerCore = ServerCore(policy, len(worker_ranks), timeout, self._apply,
                                           time.monotonic(), version=version, clocks=clocks,
                                           snapshot=self.snapshot)
        self.served = False
        self.fingerprint = plan.fingerprint()
        self._q: queue.Queue[Any] = queue.Queue()
        self._reply_bufs = [torch.empty(self.reply_capacity, dtype=torch.uint8)
                            for _ in worker_ranks]
        self._sends: dict[int, comm.Handle] = {}
        self._wait_bufs = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in worker_ranks]
        self._waits: dict[int, comm.Handle] = {}  # WAITs sent that the worker has not confirmed

    def _parameters(self, per_chunk: int) -> list[tuple[nn.Parameter, int, int]]:
        """The optimizer's parameters: views of ``flat`` (gradients: of ``grad``), the plan's
        pieces cut at chunk bounds, each with its chunk index and its piece's index."""
        cut: list[tuple[nn.Parameter, int, int]] = []
        bounds = chunk_bounds(self.flat.numel(), per_chunk)
        starts = [p.offset for p in self.pieces]
        for off, length, shape, k in cut_pieces(self.pieces, bounds):
            param = nn.Parameter(self.flat[off: off + length].view(shape))
            param.grad = self.grad[off: off + length].view(shape)
            cut.append((param, k, bisect.bisect_right(starts, off) - 1))
        if not cut:  # an empty shard still keeps versions in step with the others
            cut.append((nn.Parameter(torch.zeros(0, dtype=self.flat.dtype)), 0, -1))
        return cut

    def _resume(self, tagged: bool, step: int | None, from_memory: bool
                ) -> tuple[int, list[int] | None]:
        """Load the agreed ``step`` (or ``ps-<k>.pt``); returns (version, worker clocks)."""
        version, clocks = 0, None
        stepped = tagged or self.policy.aggregate  # step files (sync: of versions)
        if from_memory and step is not None and self.memory is not None:
            version, clocks = self._load_memory(step)
        elif step is not None and stepped:
            version, clocks = self._load(self.snapshot_path(step), tag=step)
        elif self.path and os.path.exists(self.path):  # async/stale (or sync before step files)
            version, clocks = self._load(self.path)
        # Later steps than the resumed one belong to a lost future. Without an agreed step
        # (a fresh start, or a relaunch about to be refused) nothing is removed.
        if self.dir and step is not None and stepped:
            for t in snapshot_steps(self.dir, self.index):
                if t > step:
                    os.remove(self.snapshot_path(t))
        return version, clocks

    # -- optimisation -------------------------------------------------------------------------
    def _apply(self, grads: list[Any], lr_factor: float) -> None:
        if self.chunk_numel:  # chunked pushes: ``grads`` are worker indices
            self._finish_chunked_round(grads, lr_factor)
        else:
            self._apply_whole(grads, lr_factor)
        if self.memory is not None:  # sync: the version this update makes is a worker step
            self.snapshot_memory(self.core.version + 1)

    def _set_lr(self, lr_factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            if base is not None:
                group["lr"] = base * lr_factor

    def _apply_whole(self, pushes: list[tuple[torch.Tensor, torch.Tensor]],
                     lr_factor: float) -> None:
        """``pushes``: (gradient, no-gradient flags) of each worker of the update."""
        grads = [g for g, _ in pushes]
        self.grad.copy_(grads[0])
        if len(grads) > 1:  # average in worker order: deterministic, and allreduce's mean
            for g in grads[1:]:
                self.grad.add_(g)
            self.grad.div_(len(grads))
        self._leave_out([f for _, f in pushes])
        self._arm(range(len(self._all)))
        self._set_lr(lr_factor)
        self.optimizer.step()

    def copy_to_model(self) -> None:
        """Write this shard's values into the server's copy of the model (its own pieces only)."""
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for p in self.pieces:
                dst = named[p.name]
                dst.view(-1)[p.start: p.start + p.length].copy_(
                    self.flat[p.offset: p.offset + p.length].to(dst.device))

    # -- serving ------------------------------------------------------------------------------
    def _receive(self, w: int) -> None:
        buf = torch.empty(self.push_capacity, dtype=torch.uint8)
        while True:
            try:
                work = dist.irecv(buf, src=self.worker_ranks[w], group=self.group, tag=TAG_PUSH)
                assert work is not None
                work.wait(timeout=_FOREVER)
            except Exception as e:  # noqa: BLE001 - the worker's connection closed
                self._q.put(("gone", w, e))
                return
            msg = unpack(buf, clone=True)
            if msg.op == Op.PUSH and msg.extra:  # chunked: the chunks follow on their own tags
                if not self._receive_chunks(w, msg):
                    return
                continue
            self._q.put(("msg", w, msg))
            if msg.op in (Op.DONE, Op.FAIL):  # its last message
                return

    def _send(self, r: Reply) -> None:
        w = r.worker
        if r.kind == "wait":  # in a buffer of its own; the next once the worker said it heard
            if w not in self._waits:  # (never waited for here: a stopped worker must not
                h = self._post_send(pack(Message(Op.WAIT, self.index, 0, 0),  # stall the rest)
                                         self._wait_bufs[w]), w, TAG_REPLY)
                if h is not None:
                    self._waits[w] = h
            return
        prev = self._sends.pop(w, None)
        if prev is not None:
            self._wait_sent(w, prev)  # the worker got it: it has since sent us another message
        c = self.core
        chunked = self._hdr.pop(w, None) is not None
        if r.kind == "params" and chunked:  # the values went ahead in chunks
            msg = Message(Op.PARAMS, self.index, c.clocks[w], c.version, float(r.code), extra=1)
        elif r.kind == "params":  # a hello learns the chunk size (0: pushes are not chunked)
            msg = Message(Op.PARAMS, self.index, c.clocks[w], c.version, float(r.code),
                          extra=self.chunk_numel, tensors=[self.flat])
        elif r.kind == "bye":
            msg = Message(Op.BYE, self.index, c.clocks[w], c.version)
        elif r.kind == "saved":
            msg = Message(Op.SAVED, self.index, c.clocks[w], c.version)
        elif r.kind == "epoch":
            msg = Message(Op.EPOCHED, self.index, c.clocks[w], c.version, extra=r.code,
                          tensors=[torch.tensor(r.counts, dtype=torch.int64)])
        else:
            msg = Message(Op.ERROR, self.index, c.clocks[w], c.version, float(r.code),
                          extra=self.worker_ranks[r.peer])
        out = pack(msg, self._reply_bufs[w])
        h = self._post_send(out, w, TAG_REPLY)
        if h is not None:
            self._sends[w] = h

    def _wait_sent(self, w: int, h: comm.Handle) -> None:
        try:
            h.wait()
        except CommError as e:  # that worker died; its receiver thread reports it
            log.debug("ps%d: reply to worker %d not delivered: %s", self.index, w, e)

    def _handle(self, w: int, msg: Message, now: float) -> list[Reply]:
        c = self.core
        if msg.op == Op.WAIT:  # the worker heard our WAIT and listens on: it was delivered
            h = self._waits.pop(w, None)
            if h is not None:
                self._wait_sent(w, h)
            return []
        if msg.op == Op.HELLO:
            if msg.extra != self.fingerprint:
                log.error("ps%d: worker %d (rank %d) has a different model or placement",
                          self.index, w, self.worker_ranks[w])
                return c.lose(w, Err.FAILED, now) + [Reply("error", w, Err.MISMATCH, w)]
            return c.hello(w, now)
        if msg.op == Op.PUSH:
            if c.failure is not None or c.state[w] == LOST:
                return c.push(w, msg.step, msg.version, None, 1.0, now)
            if msg.extra:
                self._chunk_header(w, msg)
                return []
            codes = msg.tensors[-1]  # the context's codes, then the no-gradient flags
            cut = codes.numel() - len(self.pieces)
            if self.flat.numel():
                ctx = decode_ctx(codes[:cut], self.ctx_template)
                grad = self.compressor.decompress(msg.tensors[:-1], ctx)
            else:
                grad = self.flat
            return c.push(w, msg.step, msg.version, (grad.to(self.flat.dtype), codes[cut:]),
                          msg.scalar, now)
        if msg.op == Op.DONE:
            return c.done(w, now)
        if msg.op == Op.SAVE:
            return c.save(w, msg.extra, now)
        if msg.op == Op.EPOCH:
            return c.end_epoch(w, msg.extra, int(msg.scalar), now)
        if msg.op == Op.FAIL:
            return c.lose(w, Err.FAILED, now)
        raise CommError(f"parameter server {self.index} got an unknown message op {msg.op} from "
                        f"worker {w}. Hint: every rank must run the same parlay version.",
                        op="ps serve", rank=self.index,
                        peer=self.worker_ranks[w] if w >= 0 else None)

    def serve(self) -> None:
        """Serve until every worker finished or was lost.

        Raises:
            CommError: In ``sync`` mode, after a worker was lost or failed (the other workers
                were told), naming it; or when the transport itself failed.
        """
        if self.served:
            return
        self.served = True
        threads = [threading.Thread(target=self._receive, args=(w,), daemon=True,
                                    name=f"parlay-ps{self.index}-recv{w}")
                   for w in range(len(self.worker_ranks))]
        for t in threads:
            t.start()
        c = self.core
        c.start(time.monotonic())
        n_lost, saved = 0, c.version
        while not c.finished():
            dl = c.next_deadline()
            wait = 5.0 if dl is None else min(5.0, max(0.0, dl - time.monotonic()))
            try:
                item = self._q.get(timeout=wait)
            except queue.Empty:
                item = None
            now = time.monotonic()
            replies: list[Reply] = []
            if item is not None and item[0] == "gone":
                log.debug("ps%d: worker %d's connection closed: %s", self.index, item[1], item[2])
                replies += c.lose(item[1], Err.GONE, now)
            elif item is not None and item[0] == "chunk":
                replies += self._chunk_arrived(item[1], item[2], now)
            elif item is not None:
                replies += self._handle(item[1], item[2], now)
            replies += c.expire(now)
            for r in replies:
                self._send(r)
            for w in c.lost[n_lost:]:
                self._on_lost(w)
            n_lost = len(c.lost)
            every = self.checkpoint_every
            if self.path and every and c.version // every > saved // every:
                saved = c.version
                self.save()
        self._finish(threads)

    def _on_lost(self, w: int) -> None:
        """Log worker ``w``'s loss; where the others go on, tell ``parlay run`` it is dropped."""
        c = self.core
        why = {Err.FAILED: "raised an error", Err.GONE: "died (its connection closed)"}.get(
            c.lost_kind.get(w, Err.LOST), f"lost after {self.timeout:g} s of silence")
        if not self.policy.aggregate:
            mark_dropped(self.worker_ranks[w])
        log.warning("ps%d: worker %d (rank %d) %s; %s", self.index, w, self.worker_ranks[w], why,
                    "sync training stops" if self.policy.aggregate
                    else f"continuing with {len(c.active())} workers")

    def _finish(self, threads: list[threading.Thread]) -> None:
        c = self.core
        for w, h in list(self._sends.items()):
            if w not in c.lost:
                self._wait_sent(w, h)
        self._sends.clear()
        self._drain_chunk_sends(c.lost)
        # Workers told of a failure leave, which ends their receivers; wait a little for that.
        # (Also for a silent worker's: its launcher may stop it meanwhile, which ends its
        # receive. A receive still blocked when the process group is destroyed aborts it.)
        end = time.monotonic() + min(5.0, self.timeout)
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        if self.torn:  # a sync round broke after some of its chunks were applied
            log.warning("ps%d: not saving a checkpoint: the last update was cut short mid-way "
                        "(the previous checkpoint stays the newest)", self.index)
        else:
            self.save()
        self.copy_to_model()
        if c.failure is None and len(c.lost) < c.num_workers:
            self.drop_memory()  # training is over: give the memory back
        log.info("ps%d: done at version %d; staleness histogram %s; lost workers %s",
                 self.index, c.version, dict(sorted(c.histogram.items())),
                 [self.worker_ranks[w] for w in c.lost] or "none")
        if c.failure is not None:
            kind, peer = c.failure
            raise CommError(lost_message(kind, peer, self.worker_ranks[peer], self.timeout,
                                         f"parameter server {self.index}"),
                            op="ps serve", rank=self.index, peer=self.worker_ranks[peer])
        if c.lost and len(c.lost) == c.num_workers:
            w = c.lost[-1]
            raise CommError(f"parameter server {self.index}: every worker was lost or failed "
                            f"(ranks {[self.worker_ranks[v] for v in c.lost]}), none finished. "
                            "Hint: see the workers' logs for the first error.",
                            op="ps serve", rank=self.index, peer=self.worker_ranks[w])
