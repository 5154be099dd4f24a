"""Sharded data parallel: the engine behind ``DistributedOptimizer(shard=...)`` (ZeRO 1-3).

Parameters are grouped into *units*: the flat engine's buckets, never mixing parameter groups
(with ``shard="parameters"``, one unit per module and parameter group). A unit is one flat
buffer padded to ``N`` equal chunks, and rank ``r`` owns chunk ``r`` of every unit. The wrapped
optimizer steps those chunks (its ``param_groups`` hold them instead of the model's tensors),
which equals stepping whole tensors for any element-wise optimizer (SGD, Adam, AdamW, RMSprop,
Adagrad, ...):

* ``"optimizer"`` (ZeRO-1): gradients accumulate into persistent buckets (``p.grad`` views),
  each bucket is reduce-scattered as soon as it is full, during backward, and zeroed once this
  rank's chunk is out; a rank steps and stores the optimizer state of its chunks only, then
  the units are all-gathered.
* ``"gradients"`` (ZeRO-2): as above, but each final gradient is copied into a bucket made for
  this step and freed at once (``p.grad`` becomes ``None``); a rank keeps only its chunks. A
  bucket is freed once reduce-scattered, and the launch of one waits for the previous one's,
  so at most two are alive at a time (one being filled, one on the wire).
* ``"parameters"`` (ZeRO-3): parameters are kept as chunks too. A unit is all-gathered just
  before its module's forward (the next two are prefetched), freed after it (but the last two,
  which backward needs first), gathered again when backward reaches the module and freed
  once its gradients are in.

At every level gradients never carry over a step: a parameter without a gradient since the
last step (an unused branch, or no backward at all) contributes zeros.

Collectives run on their own thread and group (:mod:`parlay.dp.ring`) in the same order on
every rank. Models must run the same modules in the same order on every rank (as with FSDP).
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, wait
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from parlay import comm
from parlay._validate import ceil_div
from parlay.compress.base import CommStats, Compressor
from parlay.dp.buckets import Bucket, BucketPlan
from parlay.dp.hooks import GradientBuckets, LocalReducer
from parlay.dp.ring import CommThread
from parlay.dp.shard_units import unit_params
from parlay.errors import ConfigError

__all__ = ["ShardedBuckets"]

def _empty(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def _elementwise_keys(state: dict[torch.Tensor, dict[str, Any]]) -> set[str]:
    """The keys of ``state`` (an optimizer's, by parameter) holding a tensor shaped as its
    parameter wherever that has dimensions (Adagrad's ``sum``, not its ``step``). Where every
    parameter is 0-dim, shapes tell nothing: every tensor key but torch's scalar ``step``."""
    wide = [(p, s) for p, s in state.items() if p.dim() > 0]
    if not wide:
        return {k for s in state.values() for k, v in s.items()
                if isinstance(v, torch.Tensor) and k != "step"}
    return {k for _, s in wide for k in s
            if all(isinstance(t.get(k), torch.Tensor) and t[k].shape == p.shape
                   for p, t in wide if k in t)}


class ShardedBuckets(GradientBuckets):
    """Hooks, per-unit chunks and collectives of one sharded optimizer.

    Args:
        named: ``(name, parameter)`` pairs, in the order ``plan`` indexes them.
        plan: The units (:func:`plan_units`).
        optimizer: The wrapped optimizer; its ``param_groups`` get the chunks instead of the
            parameters (it must hold no state yet).
        level: One of :data:`~parlay.dp.shard_units.LEVELS`.
        group: The data-parallel group.
        compressor: An element-wise cast (or none) applied on the wire.
        stats: Counts the bytes sent.
        passes, prescale, postscale: As for :class:`~parlay.dp.hooks.GradientBuckets`.
        model: The module (``"parameters"`` only): its modules gather their units.
        hosts: Reduce host first over these hosts' ranks (see :class:`~parlay.dp.ring.HostRing`).
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], plan: BucketPlan,
                 optimizer: torch.optim.Optimizer, level: str, group: Any,
                 compressor: Compressor, stats: CommStats, *, passes: int, prescale: float,
                 postscale: float, model: nn.Module | None = None,
                 hosts: tuple[tuple[int, ...], ...] | None = None) -> None:
        if any(float(s.get("step", 1)) > 0 for s in optimizer.state.values()):
            raise ConfigError("shard= needs an optimizer that has not stepped yet: wrap it "
                              "before its first step, then load a checkpoint into the wrapper.")
        made_at_init = {id(p): s for p, s in optimizer.state.items()}  # e.g. Adagrad's sums
        elementwise = _elementwise_keys(optimizer.state)
        optimizer.state.clear()
        self.level, self.thread = level, CommThread(group, hosts)
        self.world, self.rank = self.thread.ring.size, self.thread.ring.rank
        self.chunk = [ceil_div(b.numel, self.world) for b in plan.buckets]
        #: Each parameter's shape (with ``"parameters"`` it is empty while not gathered).
        self.shapes = [p.shape for _, p in named]
        super().__init__(named, plan, LocalReducer(), compressor, stats, passes=passes,
                         prescale=prescale, postscale=postscale, overlap=True,
                         as_views=level == "optimizer", sparse_only=False)
        self._full = [level != "parameters"] * len(plan.buckets)  # units holding full values
        self._accumulated = False  # a p.grad view of "optimizer" took a gradient since zeroed
        #: Per unit: the flat buffer of its full values, and this rank's chunk of it.
        made = [self._make_unit(b) for b in range(len(plan.buckets))]
        self.flats = [flat for flat, _ in made]
        self.shards = [shard for _, shard in made]
        group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups)
                    for p in grp["params"]}
        unit_group = [group_of[id(self.params[b.members[0]])] for b in plan.buckets]
        #: The unit of each chunk the optimizer holds, in its ``param_groups`` order.
        self.order = sorted(range(len(plan.buckets)), key=unit_group.__getitem__)
        for g, grp in enumerate(optimizer.param_groups):
            grp["params"] = [self.shards[b] for b in self.order if unit_group[b] == g]
        for b in range(len(plan.buckets)):
            self._chunk_state(optimizer, b, made_at_init, elementwise)
        self._pending: list[Future[torch.Tensor] | None] = [None] * len(plan.buckets)
        self._reducing: Future[torch.Tensor] | None = None  # the last reduce-scatter launched
        self._seen: list[set[int]] = [set() for _ in plan.buckets]
        self._module_hooks: list[Any] = []
        self._last = len(plan.buckets) - 1
        self._held = False  # inside gathered(): forwards free nothing
        if level == "parameters" and model is not None:
            self._hook_modules(model)

    # ----------------------------------------------------------------- layout
    def _chunk_state(self, optimizer: torch.optim.Optimizer, b: int,
                     made: dict[int, dict[str, Any]], elementwise: set[str]) -> None:
        """Unit ``b``'s chunk of the state ``optimizer`` made for its parameters at
        construction: the ``elementwise`` keys are chunked as the unit, the rest copied."""
        members = self._members(b)
        first = made.get(id(members[0][0]))
        if not first:
            return
        state = optimizer.state[self.shards[b]]
        for name, v in first.items():
            if name not in elementwise:
                state[name] = v.clone() if isinstance(v, torch.Tensor) else v
                continue
            flat = torch.zeros(self.chunk[b] * self.world, dtype=v.dtype, device=v.device)
            for p, where, _ in members:
                flat[where].copy_(made[id(p)][name].reshape(-1))
            state[name] = flat[self._span(b)].clone()

    def _span(self, b: int) -> slice:
        c = self.chunk[b]
        return slice(self.rank * c, (self.rank + 1) * c)

    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        if self.level != "optimizer":  # made per step (see _fill)
            return torch.empty(0, dtype=bucket.dtype, device=torch.device(bucket.device))
        return torch.zeros(self.chunk[bucket.index] * self.world, dtype=bucket.dtype,
                           device=torch.device(bucket.device))

    def _slot(self, i: int) -> tuple[int, slice]:
        # by shape: a parameter not gathered now (no gradient this step) is size 0
        b, slot = self.plan.where[i]
        off = self.plan.buckets[b].offsets[slot]
        return b, slice(off, off + self.shapes[i].numel())

    def _members(self, b: int) -> list[tuple[torch.Tensor, slice, torch.Size]]:
        """``(parameter, its slice of the unit, its shape)`` for each member of unit ``b``."""
        bucket = self.plan.buckets[b]
        return [(self.params[i], slice(off, off + self.shapes[i].numel()), self.shapes[i])
                for i, off in zip(bucket.members, bucket.offsets)]

    def _make_unit(self, b: int) -> tuple[torch.Tensor, nn.Parameter]:
        bucket = self.plan.buckets[b]
        flat = torch.zeros(self.chunk[b] * self.world, dtype=bucket.dtype,
                           device=torch.device(bucket.device))
        for p, where, _ in self._members(b):
            flat[where].copy_(p.detach().reshape(-1))
        mine = flat[self._span(b)]
        if self.level == "parameters":
            # The unit's full values live in ``flat`` only while gathered: its storage is freed
            # (resized to 0) in between, also under the views autograd saved in forward, and
            # gathered into again before backward. The parameters themselves are size-0
            # placeholders while freed, safe to read.
            shard = nn.Parameter(mine.clone())
            for p, _, _ in self._members(b):
                p.data = _empty(p)
            flat.untyped_storage().resize_(0)
        else:
            for p, where, shape in self._members(b):
                p.data = flat[where].view(shape)
            shard = nn.Parameter(mine)  # shares flat's storage: its step updates the model
        shard.grad = torch.zeros_like(mine)
        return flat, shard

    # ----------------------------------------------------------------- gradients
    def on_grad(self, i: int) -> None:
        self._accumulated = True
        super().on_grad(i)
        b = self.plan.where[i][0]
        self._seen[b].add(i)
        if self.level == "parameters" and len(self._seen[b]) == len(self.plan.buckets[b].members):
            self.release(b)  # backward is done with this unit's parameters

    def _fill(self, i: int) -> None:
        b = self.plan.where[i][0]
        if self.buffers[b].numel() == 0:
            buf = torch.empty(self.chunk[b] * self.world, dtype=self.plan.buckets[b].dtype,
                              device=self.shards[b].device)
            buf[self.plan.buckets[b].numel:].zero_()
            self.buffers[b] = buf
        super()._fill(i)
        if self.level != "optimizer":
            self.params[i].grad = None  # its copy is in the bucket: free it now

    def _launch(self, b: int) -> None:
        buf, ring = self.buffers[b], self.thread.ring
        dtype, own = buf.dtype, self.level != "optimizer"  # own: a buffer of this step only
        wire = self.compressor.shard_dtype(dtype) or dtype
        self.stats.add(buf.numel() * buf.element_size(),
                       buf.numel() * wire.itemsize * (self.world - 1) // self.world)
        held = [buf]

        def reduce() -> torch.Tensor:
            full = held.pop()  # no reference stays: the full buffer is freed on return
            if wire == dtype:
                out = ring.reduce_scatter(full)
                return out.clone() if own else out  # this rank's chunk only
            scale = self._agree_scale(full) if wire == torch.float16 else 1.0
            out = ring.reduce_scatter((full * scale).to(wire)).to(dtype)
            return out.div_(scale) if scale != 1.0 else out

        fut = self.thread.submit(reduce)
        self._handles[b] = comm.Handle(None, "reduce_scatter", fut.result)
        prev, self._reducing = self._reducing, fut
        if own:
            self.buffers[b] = self._new_buffer(self.plan.buckets[b])
            if prev is not None:  # at most two full buffers: this one and the next one filled
                wait([prev])

    def _agree_scale(self, buf: torch.Tensor) -> float:
        """A power of two that keeps the fp16 sum of every rank's ``buf`` below 2**14."""
        if buf.numel() == 0:  # an empty unit (on every rank alike)
            return 1.0
        peak = buf.abs().max().reshape(1).float()
        comm.allreduce(peak, "max", group=self.thread.ring.group)
        top = float(peak.item()) * self.world
        if not math.isfinite(top) or top == 0.0:
            return 1.0  # nothing to scale; a non-finite sum stays non-finite for the guard
        return 2.0 ** min(40, max(-24, 14 - math.ceil(math.log2(top))))

    def _hand_back(self, b: int, out: torch.Tensor) -> None:
        shard = self.shards[b]
        if shard.grad is None:  # the wrapped optimizer's own zero_grad() freed it
            shard.grad = torch.empty_like(shard)
        grad = shard.grad
        grad.copy_(out)
        if self.postscale != 1.0:
            grad.mul_(self.postscale)
        if self.level == "optimizer":
            # The other chunks hold partial sums now: zeroed, so that gradients (the
            # ``p.grad`` views) never carry a step over, as with every level. A gradient
            # that left its view (``model.zero_grad()``) is pointed back at it.
            self.buffers[b].zero_()
            for i in self.plan.buckets[b].members:
                p, view = self.params[i], self.views[i]
                if view is not None and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                    p.grad = view

    def zero_grad(self, params: Iterable[torch.Tensor], set_to_none: bool) -> None:
        """``"optimizer"`` keeps every ``p.grad`` a view of its (zeroed) bucket, so autograd
        accumulates straight into it, whatever ``set_to_none`` says; the other levels free
        the gradients (their chunks stay)."""
        if self.level != "optimizer":
            super().zero_grad(params, True)
            return
        if self._accumulated:  # gradients since the last reduction zeroed the buckets
            for buf in self.buffers:
                buf.zero_()
        self._accumulated = False
        super().zero_grad(params, False)

    def finish(self) -> None:
        super().finish()
        self._accumulated = False  # every bucket was reduced and zeroed
        for b in range(len(self.plan.buckets)):
            self._seen[b].clear()
            self.release(b)

    def layout(self) -> dict[str, Any]:
        """What a shard's saved state must match to be loaded, and this rank's parameter
        chunks (a sharded state holds no whole parameter)."""
        return {"level": self.level, "world": self.world, "rank": self.rank,
                "units": [b.numel for b in self.plan.buckets], "order": list(self.order),
                # a chunk of "optimizer"/"gradients" views its unit: saved alone, not the unit
                "params": [s.detach() if self.level == "parameters" else s.detach().clone()
                           for s in self.shards]}

    def load_layout(self, saved: dict[str, Any] | None) -> None:
        """Check ``saved`` (from :meth:`layout`) is this rank's shard; load its parameters.

        Raises:
            ConfigError: It is another rank's, level's, world's or model's shard.
        """
        mine = self.layout()
        why = {"level": "", "world": "", "rank": " (with host-first reduction the chunks go by "
               "host: did the ranks per host change?)", "units": " (the trainable parameters "
               "or the bucket size changed since)"}
        apart = [k for k in why if saved is not None and saved.get(k) != mine[k]]
        if saved is None or apart:
            def show(k: str, v: Any) -> str:
                return (f"{len(v)} units of {sum(v)} elements" if k == "units" and
                        isinstance(v, list) else f"{'chunk' if k == 'rank' else k} {v!r}")
            got = "a state without shards" if saved is None else "; ".join(
                f"{show(k, saved.get(k))} saved, {show(k, mine[k])} now{why[k]}" for k in apart)
            raise ConfigError(f"cannot load this rank's shard={self.level!r} state: {got}. "
                              "Each rank loads the chunks it wrote, with the same model, "
                              "trainable parameters, level and layout of ranks.")
        for b in range(len(self.shards)):
            self.release(b)  # nothing gathered or prefetched from the chunks replaced now
        for shard, saved_chunk in zip(self.shards, saved.get("params", [])):
            shard.data.copy_(saved_chunk)
        if saved.get("params") and self.level != "parameters":
            self.gather_all()  # every rank's chunks into the parameters

    def unit_name(self, b: int) -> str:
        """Unit ``b``'s chunk, named after the parameters it is part of (in messages)."""
        names = [self.names[i] for i in self.plan.buckets[b].members]
        return f"chunk of {', '.join(names[:3])}" + (", ..." if len(names) > 3 else "")

    def named_local_grads(self) -> list[tuple[str, torch.Tensor]]:
        """:meth:`local_grads` cut by parameter: ``(name, flat part)`` for each parameter with
        elements in this rank's chunks (so a message can name the very parameter)."""
        self._check_reduced()
        out = []
        for b, g in enumerate(s.grad for s in self.shards):
            if g is None:
                continue
            span, bucket = self._span(b), self.plan.buckets[b]
            for i, off in zip(bucket.members, bucket.offsets):
                lo, hi = max(off, span.start), min(off + self.shapes[i].numel(), span.stop)
                if lo < hi:
                    out.append((self.names[i], g[lo - span.start:hi - span.start]))
        return out

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's chunks of the averaged gradients (after :meth:`finish`)."""
        self._check_reduced()
        return [s.grad for s in self.shards if s.grad is not None]

    def _check_reduced(self) -> None:
        if not self.untouched:
            raise ConfigError(
                "the sharded gradient chunks were read (opt.clip_grad_norm_(), "
                "opt.local_gradients()) after a backward pass but before opt.synchronize(): "
                "they still hold the last step's values, and step() would not see the clip. "
                "Fix: loss.backward(); opt.synchronize(); opt.clip_grad_norm_(max_norm); "
                "with opt.skip_synchronize(): opt.step().")

    # ----------------------------------------------------------------- parameters
    def gather_all(self) -> None:
        """After a step of ``"optimizer"``/``"gradients"``: every rank's updated chunks into
        every parameter. (``"parameters"`` gathers units when they are used.)"""
        if self.level == "parameters":
            self.prefetch(self._last)  # the next forward's first unit
            return
        ring = self.thread.ring
        futs = [self.thread.submit(functools.partial(ring.all_gather, f)) for f in self.flats]
        for fut in futs:
            fut.result()

    def prefetch(self, b: int) -> None:
        """Start gathering unit ``b`` unless it is gathered or on its way."""
        if self._pending[b] is not None or self._full[b]:
            return
        shard, span, ring, flat = self.shards[b], self._span(b), self.thread.ring, self.flats[b]

        def gather() -> torch.Tensor:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            flat[span].copy_(shard.detach())
            return ring.all_gather(flat)

        self._pending[b] = self.thread.submit(gather)

    def ensure(self, b: int) -> None:
        """Unit ``b``'s parameters hold their full values (gathered now unless prefetched)."""
        if self._full[b]:
            return
        self.prefetch(b)
        fut, self._pending[b] = self._pending[b], None
        assert fut is not None
        flat = comm.Handle(None, "all_gather", fut.result).wait()
        for p, where, shape in self._members(b):
            p.data = flat[where].view(shape)
        self._full[b] = True

    def reload(self) -> None:
        """The chunks were written outside a step (an outer optimizer, a restore): drop what
        was gathered from the old values and gather anew, as after a step."""
        for b in range(len(self.shards)):
            self.release(b)
        self.gather_all()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Inside the block every parameter holds its full value (to read: writes to a
        gathered ``"parameters"`` unit are not kept); freed again after it."""
        for b in range(len(self.plan.buckets)):
            self.ensure(b)
        self._held = True  # forwards inside the block keep them
        try:
            yield
        finally:
            self._held = False
            for b, flat in enumerate(self.flats):
                if self.level == "parameters":  # tensors read inside keep their storage
                    self.flats[b] = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)
                    self.flats[b].untyped_storage().resize_(0)
                self.release(b)

    def release(self, b: int) -> None:
        """Free unit ``b``'s full parameters (``"parameters"`` only)."""
        if self.level != "parameters":
            return
        fut, self._pending[b] = self._pending[b], None
        if fut is not None:
            fut.result()
        for p, _, _ in self._members(b):
            p.data = _empty(p)
        self.flats[b].untyped_storage().resize_(0)
        self._full[b] = False
        self._seen[b].clear()

    def _hook_modules(self, model: nn.Module) -> None:
        units: dict[int, list[int]] = {}
        for b, bucket in enumerate(self.plan.buckets):
            for i in bucket.members:
                units.setdefault(id(self.params[i]), []).append(b)
        for module, params in unit_params(model, shared=True):
            mine = sorted({b for p in params for b in units.get(id(p), [])})
            if mine:
                self._module_hooks += [
                    module.register_forward_pre_hook(self._before_forward(mine)),
                    module.register_forward_hook(self._after_forward(mine))]

    def _before_forward(self, mine: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for b in mine:
                self.ensure(b)
            for ahead in (1, 2):  # units are in backward order: forward goes down
                if min(mine) - ahead >= 0:
                    self.prefetch(min(mine) - ahead)
        return hook

    def _after_forward(self, mine: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda grads: self._before_backward(mine), mode="any")
            for b in mine:
                # Backward's first two units stay (no more than forward held at a time), so
                # backward starts without waiting for a gather.
                if not self._held and not (outs and b <= 1):
                    self.release(b)
        return hook

    def _before_backward(self, mine: list[int]) -> None:
        for b in mine:
            self.ensure(b)
        for ahead in (1, 2):
            if max(mine) + ahead <= self._last:
                self.prefetch(max(mine) + ahead)

    def remove(self) -> None:
        """Detach the hooks; with ``"parameters"`` every unit is gathered back into its
        parameters for good (every rank must call it, as a collective)."""
        super().remove()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()
        if self.level == "parameters":
            for b in range(len(self.flats)):
                self.ensure(b)  # the parameters hold their full values again
            self.level = "detached"  # and keep them: release() frees nothing now
