"""DistributedOptimizer: bucketed gradient allreduce overlapped with backward.

Each parameter gets a ``post_accumulate_grad`` hook. When a parameter's gradient is final for
this step (after ``backward_passes_per_step`` passes) the hook copies it into its bucket; when
a bucket is full its compressed reduction starts asynchronously, so communication overlaps the
rest of backward. Buckets are launched strictly in plan order on every rank, which keeps the
sequence of collectives identical across ranks even when some parameters get no gradient.
``step()`` waits for every bucket, writes the reduced gradients back and steps the wrapped
optimizer. This is Horovod's hook -> async allreduce -> wait-in-step design, with DDP's buckets.
"""
from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from parlay import comm
from parlay.compress.base import CommStats, Compressor, NoneCompressor, get_compressor, reduce_async
from parlay.dp.buckets import BucketPlan, ParamInfo
from parlay.dp.hierarchical import make_reducer
from parlay.dp.ops import ReduceOp
from parlay.errors import ConfigError

__all__ = ["DistributedOptimizer"]

_MB = 1024 * 1024


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None
           ) -> list[tuple[str, torch.Tensor]]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not (isinstance(t, tuple) and len(t) == 2) for t in named):
        raise ConfigError("named_parameters should be a sequence of (name, parameter) tuples, "
                          "e.g. model.named_parameters().")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"parameter names in named_parameters must be unique; {dup!r} repeats.")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ConfigError(
            f"named_parameters was given, but {len(missing)} of the optimizer's parameters are "
            "not named in it. Hint: pass model.named_parameters() of the model whose "
            "parameters the optimizer holds.")
    return [(by_id[id(p)], p) for p in params]


def _hash(entry: Any) -> int:
    """A 60-bit hash of ``repr(entry)`` that is the same in every process (``hash`` is not)."""
    return int(hashlib.sha256(repr(entry).encode()).hexdigest()[:15], 16)


def _text(text: str, src: int, group: Any, size: int = 512) -> str:
    """Broadcast a short text from group rank ``src`` as UTF-8 bytes in a tensor (decoded as
    text, never unpickled)."""
    raw = text.encode()[:size]
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    comm.broadcast(buf, src=src, group=group)
    return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap any ``torch.optim`` optimizer so ``step()`` applies gradients averaged over ranks.

    The wrapper shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer,
    so LR schedulers and ``torch.amp.GradScaler`` work on it unchanged.

    Args:
        optimizer: The optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names make error messages readable and
            let ranks check they hold the same model. Default: positional names.
        op: ``parlay.Average`` (default) or ``parlay.Sum``.
        compression: A compressor name (``"fp16"``, ``"topk:0.01"``) or object; ``None``: none.
        backward_passes_per_step: Backward passes accumulated locally per communication.
        bucket_cap_mb: Bucket size in MiB.
        gradient_predivide_factor: With Average, gradients are scaled by ``1/f`` before the sum
            and by ``f/size`` after it (Horovod's semantics; helps fp16 range).
        process_group: Group to reduce over (default: the world).
        average_aggregated_gradients: With Average and ``backward_passes_per_step=k``, also
            divide by ``k`` so k passes of mean losses equal one pass over the k-times batch.
        check_consistency: Check at construction that all ranks hold the same parameters.
        gradient_as_bucket_view: Make each ``p.grad`` a view into its bucket, so autograd
            accumulates straight into the communication buffer and no gradient is copied in
            or out (as DDP's option of the same name). ``zero_grad()`` then zeroes the buckets
            in place instead of setting gradients to ``None``.
        overlap: Start each bucket's reduction as soon as it is full, during backward (the
            default). ``False`` starts them all in ``synchronize()``: on machines where
            communication and computation compete for the same few cores, overlapping can
            cost more than it hides (measure with ``benchmarks/dp_throughput.py``).
        hierarchical: ``True`` reduces inside each host first, then across hosts among one
            shard per local rank, then gathers inside the host: each host link carries
            ``2(n-1)/n`` of the model per step instead of a flat ring's share (see
            :mod:`parlay.dp.hierarchical`). ``"auto"`` does so when the group spans several
            hosts with several ranks on each (and the compressor is summable). Same sums.

    Raises:
        ConfigError: Bad arguments, or ranks disagree on parameter names, shapes or dtypes.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 op: int = ReduceOp.Average, compression: Any = None,
                 backward_passes_per_step: int = 1, bucket_cap_mb: float = 25,
                 gradient_predivide_factor: float = 1.0, process_group: Any = None, *,
                 average_aggregated_gradients: bool = True,
                 check_consistency: bool = True,
                 gradient_as_bucket_view: bool = True,
                 overlap: bool = True, hierarchical: bool | str = False) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}. Hint: build the optimizer first, "
                              "e.g. torch.optim.SGD(model.parameters(), lr=0.1).")
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("the optimizer is already a DistributedOptimizer; wrap it once.")
        try:
            op = ReduceOp(int(op))
        except (ValueError, TypeError):
            raise ConfigError(f"op must be parlay.Average or parlay.Sum, got {op!r}.") from None
        if op not in (ReduceOp.Average, ReduceOp.Sum):
            if op == ReduceOp.Adasum:
                raise ConfigError("op=Adasum is not supported by parlay's DistributedOptimizer. "
                                  "Hint: use op=parlay.Average (with the learning rate scaled "
                                  "by parlay.size()), which is what Adasum approximates.")
            raise ConfigError(f"DistributedOptimizer supports op=Average or Sum, got {op.name}.")
        if (not isinstance(backward_passes_per_step, int) or isinstance(backward_passes_per_step, bool)
                or backward_passes_per_step < 1):
            raise ConfigError(f"backward_passes_per_step must be an int >= 1, got "
                              f"{backward_passes_per_step!r}.")
        if not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}.")
        if not gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor must be positive, got "
                              f"{gradient_predivide_factor!r}.")
        if op == ReduceOp.Sum and gradient_predivide_factor != 1.0:
            raise ConfigError("gradient_predivide_factor only applies to op=Average.")
        if not dist.is_initialized():
            raise ConfigError("DistributedOptimizer needs a process group. "
                              "Hint: call parlay.init() first.")
        # Share containers with the wrapped optimizer instead of copying them: schedulers,
        # GradScaler and user code that edit param_groups see one truth.
        self._opt = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

        self.op = op
        self.overlap = bool(overlap)
        # SparseAdam and friends need sparse gradients back after the dense reduction (the
        # bucket views make autograd accumulate even sparse gradients densely).
        self._sparse_only = isinstance(optimizer, torch.optim.SparseAdam)
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.process_group = process_group
        self._world = comm.group_size(process_group)
        self.compression: Compressor = get_compressor(compression)
        self._hier = make_reducer(hierarchical, process_group, self.compression, self._world)
        #: Whether buckets are reduced host-first (decided at construction).
        self.hierarchical = self._hier is not None
        self._stats = CommStats()
        self._steps = 0
        named = _named(optimizer, named_parameters)
        self._params = [p for _, p in named if p.requires_grad]
        self._names = [n for n, p in named if p.requires_grad]
        if check_consistency and self._world > 1:
            self._check_consistency()
        self._plan = BucketPlan.build(
            [ParamInfo(n, p.numel(), p.dtype, str(p.device))
             for n, p in zip(self._names, self._params)],
            cap_bytes=max(1, int(bucket_cap_mb * _MB)))
        self._buffers = [torch.zeros(b.numel, dtype=b.dtype, device=torch.device(b.device))
                         for b in self._plan.buckets]
        # Shape-aware compressors (PowerSGD) view each tensor of a bucket as a matrix.
        set_layout = getattr(self.compression, "set_layout", None)
        if set_layout is not None:
            for b, bucket in enumerate(self._plan.buckets):
                set_layout(f"bucket{b}", [tuple(self._params[i].shape) for i in bucket.members])
        # Horovod's scaling split: prescale before the sum, postscale after it.
        if op == ReduceOp.Average:
            self._prescale = 1.0 / self.gradient_predivide_factor
            post = self.gradient_predivide_factor / self._world
            if average_aggregated_gradients:
                post /= backward_passes_per_step
            self._postscale = post
        else:
            self._prescale = self._postscale = 1.0
        self._passthrough = (self._world == 1 and isinstance(self.compression, NoneCompressor)
                             and self._prescale * self._postscale == 1.0)
        self._hooks: list[Any] = []
        self._views: list[torch.Tensor | None] = [None] * len(self._params)
        if gradient_as_bucket_view and not self._passthrough:
            for i, p in enumerate(self._params):
                b, slot = self._plan.where[i]
                off = self._plan.buckets[b].offsets[slot]
                view = self._buffers[b][off: off + p.numel()].view_as(p)
                if p.grad is not None and not p.grad.is_sparse:
                    view.copy_(p.grad)
                p.grad = view
                self._views[i] = view
        # By parameter identity, for zero_grad (which walks the optimizer's param_groups).
        self._view_of = {id(p): v for p, v in zip(self._params, self._views) if v is not None}
        self._reset_step_state()
        self._synchronized = False
        self._should_synchronize = True
        if not self._passthrough:
            for i, p in enumerate(self._params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    # ----------------------------------------------------------------- bookkeeping
    def _reset_step_state(self) -> None:
        n = len(self._plan.buckets)
        self._delay = [self.backward_passes_per_step] * len(self._params)
        self._filled = [False] * len(self._params)
        self._ready = [0] * n
        self._sparse: set[int] = set()
        self._handles: list[comm.Handle | None] = [None] * n
        self._next = 0

    def _check_consistency(self) -> None:
        # Integer tensors only (no pickled objects cross the network): one allreduce of hashes
        # when the ranks agree; on a mismatch a few more find and describe the first difference.
        g = self.process_group
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]
        hs = [_hash(e) for e in mine]
        total = _hash(tuple(hs))
        t = torch.tensor([len(mine), total, -len(mine), -total], dtype=torch.int64)
        comm.allreduce(t, "min", group=g)
        if int(t[0]) == -int(t[2]) and int(t[1]) == -int(t[3]):
            return
        longest = -int(t[2])
        own = torch.full((longest,), -1, dtype=torch.int64)
        own[:len(hs)] = torch.tensor(hs, dtype=torch.int64)
        ref = own.clone()
        comm.broadcast(ref, src=0, group=g)
        differs = (own != ref).nonzero()
        world, me = self._world, comm.group_rank(g)
        none = longest * world + world
        key = torch.tensor([int(differs[0]) * world + me if len(differs) else none])
        comm.allreduce(key, "min", group=g)
        k, r = divmod(int(key), world)
        entry = f"{mine[k] if k < len(mine) else None}|{len(mine)}"
        a, n0 = _text(entry, 0, g).rsplit("|", 1)
        b, nr = _text(entry, r, g).rsplit("|", 1)
        raise ConfigError(
            f"ranks hold different models: parameter #{k} is {a} on rank 0 but {b} on rank "
            f"{comm.to_global_rank(g, r)} (rank 0 has {n0} trainable parameters, rank {r} {nr}). "
            "Hint: build the same model on every rank, with the same requires_grad flags, "
            "before wrapping the optimizer.")

    # ----------------------------------------------------------------- hooks
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._on_grad(i, p)
        return hook

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._should_synchronize:
            return
        self._delay[i] -= 1
        if self._delay[i] > 0:
            return
        if self._delay[i] < 0 or self._filled[i]:
            warnings.warn(
                f"gradient of {self._names[i]!r} was computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before optimizer.step(); the extra pass "
                "is added locally after communication started and is lost. Hint: raise "
                "backward_passes_per_step or call step() after each group of passes.",
                stacklevel=3)
            return
        b, _ = self._plan.where[i]
        self._fill(i)
        self._ready[b] += 1
        if self.overlap:
            self._launch_ready()

    def _fill(self, i: int) -> None:
        b, slot = self._plan.where[i]
        bucket = self._plan.buckets[b]
        off = bucket.offsets[slot]
        p = self._params[i]
        dst = self._buffers[b][off: off + p.numel()]
        g = p.grad
        view = self._views[i]
        if g is not None and g.is_sparse:
            self._sparse.add(i)  # reduced densely in the bucket, handed back sparse
        if view is not None and g is not None and not g.is_sparse \
                and g.data_ptr() == view.data_ptr():
            # Autograd accumulated straight into the bucket: nothing to copy.
            if self._prescale != 1.0:
                view.mul_(self._prescale)
        elif g is None:
            dst.zero_()
        else:
            if g.is_sparse:
                g = g.to_dense()
            if self._prescale != 1.0:
                torch.mul(g.reshape(-1), self._prescale, out=dst)
            else:
                dst.copy_(g.reshape(-1))
        self._filled[i] = True

    def _launch_ready(self) -> None:
        buckets = self._plan.buckets
        while self._next < len(buckets) and self._ready[self._next] == len(buckets[self._next].members):
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        buf = self._buffers[b]
        if self._hier is not None:
            self._handles[b] = self._hier.reduce_async(buf, self.compression, key=f"bucket{b}",
                                                       stats=self._stats)
        elif self._world == 1 and isinstance(self.compression, NoneCompressor):
            self._handles[b] = comm.Handle(None, "allreduce", lambda: buf)
        else:
            self._handles[b] = reduce_async(buf, self.compression, key=f"bucket{b}",
                                            group=self.process_group, stats=self._stats,
                                            into=buf)

    # ----------------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Finish the gradient reduction now: launch what is left, wait, write gradients back.

        Parameters that produced no gradient this step contribute zeros, so ranks whose
        models take different branches never wait on each other.

        Raises:
            CommError: A peer was lost or timed out.
        """
        if self._passthrough:
            self._synchronized = True
            return
        buckets = self._plan.buckets
        for b in range(self._next, len(buckets)):
            for i in buckets[b].members:
                if not self._filled[i]:
                    self._fill(i)
            self._launch(b)
        self._next = len(buckets)
        for b, bucket in enumerate(buckets):
            h = self._handles[b]
            if h is None:
                continue
            out = h.wait()
            buf = self._buffers[b]
            if out is not buf:
                buf.copy_(out)
            if self._postscale != 1.0 and buf.dtype.is_floating_point:
                buf.mul_(self._postscale)
            for slot, i in enumerate(bucket.members):
                p = self._params[i]
                view = self._views[i]
                if view is not None:
                    if i in self._sparse or self._sparse_only:
                        p.grad = view.to_sparse(min(1, view.dim()))
                    elif p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                    continue
                off = bucket.offsets[slot]
                red = buf[off: off + p.numel()].view_as(p)
                if i in self._sparse or self._sparse_only:
                    p.grad = red.to_sparse(min(1, red.dim()))
                elif p.grad is None or p.grad.is_sparse:
                    p.grad = red.detach().clone()
                else:
                    p.grad.copy_(red)
        self._steps += 1
        self._reset_step_state()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call :meth:`synchronize` first).

        The clip-then-step pattern::

            loss.backward(); opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Synchronize gradients (unless inside :meth:`skip_synchronize`), then step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._opt.step(closure) if closure is not None else self._opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients; warns if called while a reduction is half done.

        Gradients that are views into buckets are zeroed in place (never set to ``None``);
        other parameters follow ``set_to_none``.
        """
        if any(self._filled) and not self._passthrough:
            warnings.warn(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.", stacklevel=2)
        views = self._view_of
        if views:
            for buf in self._buffers:
                buf.zero_()
        for group in self.param_groups:
            for p in group["params"]:
                v = views.get(id(p))
                if v is not None:
                    if p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != v.data_ptr():
                        p.grad = v  # re-attach after e.g. model.zero_grad(set_to_none=True)
                elif p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("add parameter groups to the optimizer before wrapping it in "
                          "DistributedOptimizer (its buckets are planned at construction).")

    def comm_stats(self) -> dict[str, float]:
        """Gradient bytes sent so far: dense (before compression) vs on the wire, per step."""
        d = self._stats.as_dict()
        steps = max(1, self._steps)
        d["steps"] = self._steps
        d["dense_bytes_per_step"] = d["dense_bytes"] / steps
        d["wire_bytes_per_step"] = d["wire_bytes"] / steps
        if self._hier is not None:  # what crossed host links (the rest stayed inside hosts)
            d["cross_host_bytes_per_step"] = self._hier.cross_bytes / steps
        return d

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, plus compression state (e.g. residuals)."""
        sd = self._opt.state_dict()
        comp = self.compression.state_dict()
        if comp:
            sd["parlay_compression"] = comp
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        comp = sd.pop("parlay_compression", None)
        self._opt.load_state_dict(sd)
        # load_state_dict may rebuild param_groups' dicts: keep sharing them.
        self.param_groups = self._opt.param_groups
        self.state = self._opt.state
        if comp:
            self.compression.load_state_dict(comp)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapper stops communicating)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan (read-only)."""
        return self._plan

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer cannot be pickled; save state_dict() instead.")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._opt).__name__}, op={self.op.name}, "
                f"compression={self.compression!r}, buckets={len(self._plan.buckets)}, "
                f"world={self._world})")
