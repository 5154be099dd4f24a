"""The per-step engine behind ``DistributedOptimizer``: gradient hooks filling fused buckets.

Each trainable parameter gets a ``post_accumulate_grad`` hook. When its gradient is final for
the step (after ``passes`` backward passes) the hook puts it into its bucket; when a bucket is
full its reduction starts (with ``overlap``), strictly in plan order on every rank, which keeps
the sequence of collectives identical across ranks even when some parameters get no gradient.
:meth:`GradientBuckets.finish` launches what is left, waits for every bucket and hands the
reduced gradients back. As in PyTorch's ``ddp_comm_hooks``, a hook is a plain function over
this small state object; the collective itself is a :class:`Reducer`.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from parlay import comm
from parlay.compress.base import CommStats, Compressor
from parlay.compress.reduce import reduce_async
from parlay.dp.buckets import Bucket, BucketPlan
from parlay.errors import ConfigError

__all__ = ["Reducer", "FlatReducer", "LocalReducer", "GradientBuckets", "zero_grad_of",
           "check_unhooked", "reduced_closure"]


class Reducer(Protocol):
    """Sums one flat bucket over a group (flat ring, host-first, ...)."""

    def reduce_async(self, flat: torch.Tensor, compressor: Compressor, key: str,
                     stats: CommStats | None = None) -> comm.Handle:
        """Start the sum; the handle's ``wait()`` returns it (``flat`` itself when possible)."""
        ...


class FlatReducer:
    """One compressed collective per bucket over the whole group (:func:`reduce_async`)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def reduce_async(self, flat: torch.Tensor, compressor: Compressor, key: str,
                     stats: CommStats | None = None) -> comm.Handle:
        return reduce_async(flat, compressor, key=key, group=self.group, stats=stats, into=flat)


class LocalReducer:
    """A group of one with the identity compressor: the bucket already holds the sum."""

    def reduce_async(self, flat: torch.Tensor, compressor: Compressor, key: str,
                     stats: CommStats | None = None) -> comm.Handle:
        return comm.Handle(None, "local", lambda: flat)


class GradientBuckets:
    """Hooks, buckets and the state of one step's reduction.

    Args:
        named: ``(name, parameter)`` of every parameter to reduce, in plan order.
        plan: Which parameters share a bucket.
        reducer: Sums a bucket over the group.
        compressor: Encodes each bucket on the wire.
        stats: Counts the bytes sent.
        passes: Backward passes per reduction (``backward_passes_per_step``).
        prescale: Factor applied to each gradient before the sum.
        postscale: Factor applied to each sum.
        overlap: Launch each bucket as soon as it is full, during backward.
        as_views: Make each ``p.grad`` a view into its bucket.
        sparse_only: The optimizer takes sparse gradients only (``SparseAdam``).
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], plan: BucketPlan, reducer: Reducer,
                 compressor: Compressor, stats: CommStats, *, passes: int, prescale: float,
                 postscale: float, overlap: bool, as_views: bool, sparse_only: bool) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.plan, self.reducer, self.compressor, self.stats = plan, reducer, compressor, stats
        self.passes, self.prescale, self.postscale = passes, prescale, postscale
        self.overlap, self.sparse_only = overlap, sparse_only
        #: While True (``no_sync()``) the hooks do nothing and gradients accumulate locally.
        self.silent = False
        self.buffers = [self._new_buffer(b) for b in plan.buckets]
        self.views: list[torch.Tensor | None] = [None] * len(self.params)
        if as_views:
            self._attach_views()
        # By parameter identity, for zero_grad (which walks the optimizer's param_groups).
        self.view_of = {id(p): v for p, v in zip(self.params, self.views) if v is not None}
        self.reset()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self.params)]
        _HOOKED.add(self)

    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        """The flat buffer of one bucket (the sharded engine pads it, or makes it per step)."""
        return torch.zeros(bucket.numel, dtype=bucket.dtype, device=torch.device(bucket.device))

    def _slot(self, i: int) -> tuple[int, slice]:
        b, slot = self.plan.where[i]
        off = self.plan.buckets[b].offsets[slot]
        return b, slice(off, off + self.params[i].numel())

    def _attach_views(self) -> None:
        for i, p in enumerate(self.params):
            b, where = self._slot(i)
            view = self.buffers[b][where].view_as(p)
            if p.grad is not None and not p.grad.is_sparse:
                view.copy_(p.grad)
            p.grad = view
            self.views[i] = view

    def reset(self) -> None:
        """Forget the current step (counters, handles): the next backward starts a new one."""
        n = len(self.plan.buckets)
        self._delay = [self.passes] * len(self.params)
        self._filled = [False] * len(self.params)
        self._ready = [0] * n
        self._sparse: set[int] = set()
        self._handles: list[comm.Handle | None] = [None] * n
        self._next = 0

    @property
    def in_flight(self) -> bool:
        """Whether a reduction has started (a gradient went into a bucket) and not finished."""
        return any(self._filled)

    @property
    def untouched(self) -> bool:
        """Whether no backward pass reached a hook since the last :meth:`finish`."""
        return not self.in_flight and all(d == self.passes for d in self._delay)

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _HOOKED.discard(self)

    # ----------------------------------------------------------------- during backward
    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self.on_grad(i)
        return hook

    def on_grad(self, i: int) -> None:
        """Parameter ``i``'s gradient was accumulated by one backward pass."""
        if self.silent:
            return
        self._delay[i] -= 1
        if self._delay[i] > 0:
            return
        if self._delay[i] < 0 or self._filled[i]:  # raised, as Horovod does: it would be lost
            raise ConfigError(
                f"gradient of {self.names[i]!r} was computed more than backward_passes_per_step="
                f"{self.passes} times before optimizer.step(); its reduction had started, so "
                "the extra pass would be lost. Hint: raise backward_passes_per_step, call "
                "step() after each group of passes, or run the extra passes inside "
                "optimizer.no_sync().")
        self._fill(i)
        self._ready[self.plan.where[i][0]] += 1
        if self.overlap:
            self._launch_ready()

    def _fill(self, i: int) -> None:
        b, where = self._slot(i)
        p, view, buf = self.params[i], self.views[i], self.buffers[b]
        g = p.grad  # an empty view's data_ptr() is 0: only its dtype can tell
        if view is not None and (view.dtype != p.dtype or p.numel() and view.data_ptr()
                                 != buf.data_ptr() + where.start * buf.element_size()):
            raise ConfigError(  # model.double(), .to(memory_format=...) replaced p.grad's data
                f"the gradient of {self.names[i]!r} is no longer a view into its bucket: the "
                "model was converted (dtype, device or memory format) after its "
                "DistributedOptimizer was built, and its reduced gradient would be lost. Fix: "
                "build the optimizer after converting the model, or pass "
                "gradient_as_bucket_view=False.")
        if g is not None and g.is_sparse:
            self._sparse.add(i)  # reduced densely in the bucket, handed back sparse
        if view is not None and g is not None and not g.is_sparse \
                and g.data_ptr() == view.data_ptr():
            # Autograd accumulated straight into the bucket: nothing to copy.
            if self.prescale != 1.0:
                view.mul_(self.prescale)
        elif g is None:
            self.buffers[b][where].zero_()
        else:
            flat = (g.to_dense() if g.is_sparse else g).reshape(-1)
            if self.prescale != 1.0:
                torch.mul(flat, self.prescale, out=self.buffers[b][where])
            else:
                self.buffers[b][where].copy_(flat)
        self._filled[i] = True

    def _launch_ready(self) -> None:
        buckets = self.plan.buckets
        while self._next < len(buckets) and \
                self._ready[self._next] == len(buckets[self._next].members):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        self._handles[b] = self.reducer.reduce_async(self.buffers[b], self.compressor,
                                                     key=f"bucket{b}", stats=self.stats)

    # ----------------------------------------------------------------- in step()
    def finish(self) -> None:
        """Launch the buckets not started yet (parameters without a gradient contribute
        zeros, so ranks whose models took different branches never wait on each other), wait
        for every bucket and hand the reduced gradients back.

        Raises:
            CommError: A peer was lost or timed out.
        """
        buckets = self.plan.buckets
        for b in range(self._next, len(buckets)):
            for i in buckets[b].members:
                if not self._filled[i]:
                    self._fill(i)
            self._launch(b)
        self._next = len(buckets)
        # Start every bucket's further round (PowerSGD's Q) before waiting for any: the link
        # then carries bucket b's while bucket b+1's is computed. Same order on every rank.
        for h in self._handles:
            advance = getattr(h, "advance", None)
            if advance is not None:
                advance()
        try:
            for b, h in enumerate(self._handles):
                if h is not None:
                    self._hand_back(b, h.wait())
        finally:  # a failed step too: a retry (Horovod elastic) starts a new one
            self.reset()

    def _hand_back(self, b: int, out: torch.Tensor) -> None:
        buf = self.buffers[b]
        if out is not buf:
            buf.copy_(out)
        if self.postscale != 1.0 and (buf.dtype.is_floating_point or buf.dtype.is_complex):
            buf.mul_(self.postscale)
        for i in self.plan.buckets[b].members:
            p, view = self.params[i], self.views[i]
            sparse = i in self._sparse or self.sparse_only
            red = view if view is not None else buf[self._slot(i)[1]].view_as(p)
            if sparse:
                p.grad = red.to_sparse(min(1, red.dim()))
            elif view is not None:
                if p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None or p.grad.is_sparse:
                p.grad = red.detach().clone()
            else:
                p.grad.copy_(red)

    # ----------------------------------------------------------------- zero_grad
    def zero_grad(self, params: Iterable[torch.Tensor], set_to_none: bool) -> None:
        """``set_to_none``: gradients become ``None`` and the buckets are left as they are
        (the next fill overwrites every slot). Otherwise the buckets are zeroed in place and
        gradient views re-attached, so autograd accumulates straight into them."""
        views = self.view_of
        if views and not set_to_none:
            for buf in self.buffers:
                buf.zero_()
        for p in params:
            v = views.get(id(p))
            if v is None or set_to_none:
                zero_grad_of(p, set_to_none)
            elif p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != v.data_ptr():
                p.grad = v  # re-attach after e.g. model.zero_grad(set_to_none=True)


#: The engines whose hooks are attached (each parameter is reduced by one at most).
_HOOKED: weakref.WeakSet[GradientBuckets] = weakref.WeakSet()


def check_unhooked(named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse parameters that still carry another engine's hooks.

    Raises:
        ConfigError: Some do (their gradients would be counted by both engines).
    """
    mine = {id(p) for _, p in named}
    for eng in list(_HOOKED):
        taken = [n for n, p in zip(eng.names, eng.params) if id(p) in mine]
        if taken:
            raise ConfigError(
                f"{len(taken)} parameter(s) ({taken[0]!r}, ...) still carry the gradient hooks "
                "of another DistributedOptimizer, which would count their gradients too. Fix: "
                "call remove_hooks() on the old optimizer before wrapping a new one (e.g. when "
                "switching optimizers between phases of training).")


def reduced_closure(opt: Any, closure: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """The closure ``opt.step(closure)`` hands the wrapped optimizer (``None`` stays ``None``):
    each call of ``closure`` is followed by ``opt.synchronize()``, which reduces its gradients,
    and the loss it returns is reduced over the group with ``opt.op`` (averaged), so every rank
    decides as one process would on the combined batch (L-BFGS calls it several times a step,
    its line search compares the losses)."""
    if closure is None or opt._buckets is None:  # no reduction: local gradients, local loss
        return closure
    group = opt.process_group

    def reduced() -> Any:
        loss = closure()
        opt.synchronize()
        opt._synchronized = False
        if loss is None:
            return None
        own = isinstance(loss, torch.Tensor)
        t = torch.tensor([float(loss.detach() if own else loss)], dtype=torch.float64,
                         device=comm.group_device(group))
        comm.allreduce(t, opt.op, group=group)
        return t.reshape(loss.shape).to(loss) if own else float(t)
    return reduced


def zero_grad_of(p: torch.Tensor, set_to_none: bool) -> None:
    """``torch.optim.Optimizer.zero_grad`` for one parameter."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        p.grad.detach_()
        p.grad.zero_()

