"""DistributedOptimizer: bucketed gradient allreduce overlapped with backward.

Gradient hooks put each parameter's gradient into a fused bucket once it is final for the step
and start the bucket's compressed reduction as soon as the bucket is full, so communication
overlaps the rest of backward (:mod:`parlay.dp.hooks`). ``step()`` waits for every bucket,
writes the reduced gradients back and steps the wrapped optimizer. This is Horovod's
hook -> async allreduce -> wait-in-step design, with DDP's buckets and DDP's ``no_sync()``.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from parlay import comm
from parlay.compress.base import (CommStats, Compressor, NoneCompressor, check_state_writer,
                                  own_compressor)
from parlay.dp.buckets import BucketPlan, ParamInfo
from parlay.dp.hierarchical import HierarchicalReducer, host_topology, make_reducer
from parlay.dp.hooks import FlatReducer, GradientBuckets, LocalReducer, Reducer, zero_grad_of
from parlay.dp.shard import ShardedBuckets
from parlay.dp.shard_units import check_level, clip_chunks_, plan_units
from parlay.dp import checks, hooks
from parlay.dp.checks import check_arguments, check_passes
from parlay.dp.ops import ReduceOp
from parlay.dp.wrapped import WrappedOptimizer
from parlay.errors import ConfigError
from parlay.runinfo import stable_repr

__all__ = ["DistributedOptimizer", "WrappedOptimizer"]

_MB = 1024 * 1024


class DistributedOptimizer(WrappedOptimizer):
    """Wrap any ``torch.optim`` optimizer so ``step()`` applies gradients averaged over ranks.

    The wrapper shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer,
    so LR schedulers and ``torch.amp.GradScaler`` work on it (the scaler once the gradients are
    reduced: see :meth:`step`); it is built by ``torch.optim.Optimizer.__init__``, so step and
    state-dict hooks registered on it fire.

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
        gradient_as_bucket_view: After ``step()`` each ``p.grad`` is a view into its bucket,
            so reduced gradients are never copied out (as DDP's option of the same name).
            ``zero_grad()`` (``set_to_none=True``) then sets them to ``None``: autograd's
            fresh gradient is copied once into the bucket, as DDP does; with
            ``set_to_none=False`` the buckets are zeroed in place and autograd accumulates
            straight into them (a zeroing pass and an addition instead of one copy). Convert
            the model (dtype, memory format) before wrapping: a view it replaced is refused.
        overlap: Start each bucket's reduction as soon as it is full, during backward (the
            default). ``False`` starts them all in ``synchronize()``: on machines where
            communication and computation compete for the same few cores, overlapping can
            cost more than it hides (measure with ``benchmarks/dp_throughput.py``).
        hierarchical: ``True`` reduces inside each host first, then across hosts among one
            shard per local rank, then gathers inside the host: each host link carries
            ``2(n-1)/n`` of the model per step instead of a flat ring's share (see
            :mod:`parlay.dp.hierarchical`). ``"auto"`` does so when the group spans several
            hosts with several ranks on each (and the compressor is summable). Same sums.
        shard: Shard the training state over the group (ZeRO, :mod:`parlay.dp.shard`):
            ``"optimizer"`` keeps 1/N of the optimizer state on each rank, ``"gradients"``
            also 1/N of the gradients, ``"parameters"`` also 1/N of the parameters (each
            module's are gathered just before use and freed after). Gradients are
            reduce-scattered during backward and parameters all-gathered, each collective
            moving a ring's bytes. The wrapped optimizer then steps this rank's flat chunks:
            read gradients through :meth:`local_gradients` and clip with
            :meth:`clip_grad_norm_`, read whole parameters inside
            :meth:`gathered_parameters`; :meth:`state_dict` is this rank's shard. Gradients
            never carry over between steps: a step without backward applies zeros (without
            ``shard=``, the previous averaged gradients).
        model: The module (needed by ``shard="parameters"``, whose gathers hook its modules).

    Raises:
        ConfigError: Bad arguments, parameters another one hooks (see :meth:`remove_hooks`),
            or ranks disagree on parameter names, shapes or dtypes.

    Subclasses (``parlay.horovod.DistributedOptimizer``) extend it through two protected
    methods: :meth:`_make_reducer` (how a bucket is summed, or ``None`` to keep gradients
    local) and :meth:`_apply_update` (what ``step()`` does once gradients are reduced); the
    trainable parameters are ``_named`` (``(name, parameter)`` pairs).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 op: int = ReduceOp.Average, compression: Any = None,
                 backward_passes_per_step: int = 1, bucket_cap_mb: float = 25,
                 gradient_predivide_factor: float = 1.0, process_group: Any = None, *,
                 average_aggregated_gradients: bool = True, check_consistency: bool = True,
                 gradient_as_bucket_view: bool = True, overlap: bool = True,
                 hierarchical: bool | str = False, shard: str | None = None,
                 model: torch.nn.Module | None = None) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("the optimizer is already a DistributedOptimizer; wrap it once.")
        op = check_arguments(optimizer, op, backward_passes_per_step, bucket_cap_mb,
                              gradient_predivide_factor)
        super().__init__(optimizer)
        # SparseAdam and friends need sparse gradients back after the dense reduction (the
        # bucket views make autograd accumulate even sparse gradients densely).
        self._sparse_only = isinstance(optimizer, torch.optim.SparseAdam)
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.process_group = process_group
        self.overlap = bool(overlap)
        self.compression: Compressor = own_compressor(compression, self)
        #: The shard level (``None``: every rank holds the whole state).
        self.shard = check_level(shard, self.compression, optimizer)
        self._world = comm.group_size(process_group)
        self._named = [(n, p) for n, p in checks.named_parameters(optimizer, named_parameters)
                       if p.requires_grad]
        self._frozen = [p for g in optimizer.param_groups for p in g["params"]
                        if not p.requires_grad]
        hooks.check_unhooked(self._named)
        if check_consistency and self._world > 1:
            checks.check_consistency(self._named, process_group, {
                "shard": self.shard, "bucket_cap_mb": bucket_cap_mb, "op": int(op),
                "backward_passes_per_step": backward_passes_per_step,
                "hierarchical": hierarchical, "compression": stable_repr(self.compression),
                "gradient_predivide_factor": self.gradient_predivide_factor,
                "average_aggregated_gradients": self.average_aggregated_gradients})
        self._model = model
        if self.shard == "parameters" and model is None:
            raise ConfigError("shard='parameters' gathers each module's parameters just before "
                              "its forward; pass the module: DistributedOptimizer(..., "
                              "shard='parameters', model=model).")
        cap = max(1, int(bucket_cap_mb * _MB))
        self._plan = plan_units(self._named, optimizer, cap,
                                model if self.shard == "parameters" else None) \
            if self.shard else BucketPlan.build(
                [ParamInfo(n, p.numel(), p.dtype, str(p.device)) for n, p in self._named],
                cap_bytes=cap)
        self._as_views = bool(gradient_as_bucket_view)
        self._hierarchical_arg = hierarchical
        self._stats = CommStats()
        self._steps = 0
        self._synchronized, self._should_synchronize = False, True
        self._buckets: GradientBuckets | None = None
        self._install()
        self._held = sum(len(g["params"]) for g in self.param_groups)  # (chunks with shard=)

    # ----------------------------------------------------------------- construction steps
    def _scales(self) -> tuple[float, float]:
        """Horovod's scaling split: ``(prescale, postscale)`` around the sum."""
        if self.op != ReduceOp.Average:
            return 1.0, 1.0
        post = self.gradient_predivide_factor / self._world
        if self.average_aggregated_gradients:
            post /= self.backward_passes_per_step
        return 1.0 / self.gradient_predivide_factor, post

    def _bucket_scales(self) -> tuple[float, float]:
        """The factors the buckets apply: without a compressor the whole scale is applied on
        the way into the bucket (as DDP divides before its allreduce), which saves a pass over
        every gradient after the sum; a compressor sees Horovod's split."""
        pre, post = self._scales()
        # "homogeneous" compressors encode a*x as a times the encoding of x (a > 0): for them
        # scaling before the sum equals scaling after it (the identity, PowerSGD, "auto")
        if getattr(self.compression, "homogeneous", False):
            return pre * post, 1.0
        return pre, post

    def _make_reducer(self, hierarchical: bool | str) -> Reducer | None:
        """Extension point: how one bucket is summed over the group.

        Args:
            hierarchical: The constructor's ``hierarchical`` argument.

        Returns:
            A :class:`~parlay.dp.hooks.Reducer`, or ``None`` to keep gradients local: no
            hooks, no buckets, ``step()`` applies each rank's own gradients (this is also the
            answer for a group of one with nothing to scale or compress).
        """
        hier = make_reducer(hierarchical, self.process_group, self.compression, self._world)
        if hier is not None:
            return hier
        if self._world == 1 and isinstance(self.compression, NoneCompressor):
            pre, post = self._scales()
            return None if pre * post == 1.0 else LocalReducer()
        return FlatReducer(self.process_group)

    def _install(self) -> None:
        """Choose the reducer; unless gradients stay local, create the buckets and hooks."""
        if self.shard:
            pre, post = self._bucket_scales()
            self._reducer: Reducer | None = LocalReducer()
            hosts = host_topology(self._hierarchical_arg, self.process_group,
                                  self.compression, self._world)
            self.hierarchical = hosts is not None
            self._buckets = ShardedBuckets(
                self._named, self._plan, self._opt, self.shard, self.process_group,
                self.compression, self._stats, passes=self.backward_passes_per_step,
                prescale=pre, postscale=post, model=self._model,
                hosts=hosts.hosts if hosts is not None else None)
            return
        self._reducer = self._make_reducer(self._hierarchical_arg)
        #: Whether buckets are reduced host-first (decided at construction).
        self.hierarchical = isinstance(self._reducer, HierarchicalReducer)
        bind = getattr(self.compression, "bind", None)  # "auto" agrees its choices over the group
        if callable(bind):
            bind(self.process_group, summable_only=self.hierarchical)
        if self._reducer is None:
            return
        # Shape-aware compressors (PowerSGD) view each tensor of a bucket as a matrix.
        set_layout = getattr(self.compression, "set_layout", None)
        if set_layout is not None:
            for b, bucket in enumerate(self._plan.buckets):
                set_layout(f"bucket{b}", [tuple(self._named[i][1].shape) for i in bucket.members])
        pre, post = self._bucket_scales()
        self._buckets = GradientBuckets(
            self._named, self._plan, self._reducer, self.compression, self._stats,
            passes=self.backward_passes_per_step, prescale=pre, postscale=post,
            overlap=self.overlap, as_views=self._as_views, sparse_only=self._sparse_only)

    def _apply_update(self, closure: Callable[[], Any] | None) -> Any:
        """Extension point: step the wrapped optimizer on the (reduced) gradients."""
        out = self._opt.step(closure) if closure is not None else self._opt.step()
        if self.shard_engine is not None:
            self.shard_engine.gather_all()
        return out

    # ----------------------------------------------------------------- public API
    def synchronize(self) -> None:
        """Finish the gradient reduction now: launch what is left, wait, write gradients back.

        Parameters that produced no gradient this step contribute zeros, so ranks whose
        models take different branches never wait on each other.

        Raises:
            CommError: A peer was lost or timed out.
        """
        checks.check_still_frozen(self._frozen)
        if self._buckets is not None:
            self._buckets.finish()
            self._steps += 1
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call :meth:`synchronize` first).

        It changes ``step()`` only; backward passes inside it still communicate (use
        :meth:`no_sync` for that). The clip-then-step pattern::

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

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward passes do not communicate: gradients accumulate locally
        (as with DDP's ``no_sync``) and the next reduction, started by the first backward after
        the block or by ``step()``/``synchronize()``, carries the accumulated sum::

            for micro in batches[:-1]:
                with opt.no_sync():
                    loss_fn(model(micro)).backward()
            loss_fn(model(batches[-1])).backward()     # reduces every micro-batch's gradient
            opt.step()

        Passes inside the block do not count towards ``backward_passes_per_step``.
        """
        eng = self._buckets
        if eng is None:
            yield
            return
        if eng.in_flight and not eng.silent:
            warnings.warn(
                "optimizer.no_sync() entered after a backward pass had started this step's "
                "reduction; gradients computed inside the block miss it and are lost. Hint: "
                "run the no_sync() passes first, then the last pass outside, then step().",
                stacklevel=3)
        was, eng.silent = eng.silent, True
        try:
            yield
        finally:
            eng.silent = was

    #: ``torch.amp.GradScaler.step(opt)`` then leaves the overflow check's outcome and the
    #: scale to :meth:`step` (``found_inf``, ``grad_scale``), which can tell whether the
    #: gradients the scaler checked were already reduced.
    _step_supports_amp_scaling = True
    _own_sums = False  # True: each rank steps its own gradients (see unscale_)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize gradients (unless inside :meth:`skip_synchronize`), then step; with a
        ``closure`` (L-BFGS), after each of its calls too (see :func:`.hooks.reduced_closure`).

        Under ``torch.amp.GradScaler.step(opt)`` the gradients must have been reduced before
        the scaler checked them for overflows (each rank would otherwise skip on its own
        gradients): ``opt.synchronize()`` first, and with ``shard=``, ``opt.unscale_(scaler)``.

        Raises:
            ConfigError: GradScaler checked gradients still being reduced, a sharded
                optimizer's chunks without :meth:`unscale_`, or a group added after wrapping.
        """
        checks.check_still_held(self._opt, self._held)
        if "found_inf" in self.__dict__:
            return self._scaler_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.", stacklevel=2)
            idle = self._buckets is not None and self._buckets.untouched
            if not (idle and (self._synchronized or closure is not None)):
                self.synchronize()  # (a second finish() would reduce handed-back gradients)
        self._synchronized = False
        return self._apply_update(hooks.reduced_closure(self, closure))

    def _scaler_step(self, closure: Callable[[], Any] | None) -> Any:
        """``step()`` called by ``torch.amp.GradScaler.step`` (see :meth:`step`)."""
        eng, scale = self._buckets, self.__dict__["grad_scale"]
        pending = self._should_synchronize and not self._synchronized \
            and eng is not None and not eng.untouched
        if pending or (scale is not None and self.shard):
            del self.__dict__["found_inf"], self.__dict__["grad_scale"]  # its del is not reached
            raise ConfigError(
                "torch.amp.GradScaler checked the gradients for overflows before this "
                "optimizer reduced them, so each rank would decide alone and step with scaled "
                "gradients. Hint: loss.backward(); opt.synchronize(); opt.unscale_(scaler); "
                "with opt.skip_synchronize(): scaler.step(opt); then scaler.update().")
        if self._should_synchronize and not self._synchronized:
            self.synchronize()  # no backward since the last step: as step() would
        self._synchronized = False
        if bool(self.__dict__["found_inf"]):
            return None  # the overflow skip, the same on every rank (reduced gradients)
        if scale is not None:  # the scaler left them scaled: unscale the reduced gradients
            self._unscale_grads(scale)
        return self._apply_update(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients.

        Gradients that are views into buckets are zeroed in place (never set to ``None``);
        other parameters follow ``set_to_none``.

        Raises:
            ConfigError: A reduction or accumulation is under way (after a backward pass,
                before step/synchronize).
        """
        params = [p for _, p in self._named] if self.shard else \
            [p for group in self.param_groups for p in group["params"]]
        eng = self._buckets
        if eng is None:
            for p in params:
                zero_grad_of(p, set_to_none)
            return
        checks.check_untouched(eng.untouched, self.backward_passes_per_step)
        eng.zero_grad(params, set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change the number of backward passes per reduction (Horovod's method); the step in
        progress starts over."""
        self.backward_passes_per_step = check_passes(passes)
        if self._buckets is None:
            self._install()  # a group of one may now have an average to take
            return
        self._buckets.passes = passes
        self._buckets.prescale, self._buckets.postscale = self._bucket_scales()
        self._buckets.reset()

    @property
    def shard_engine(self) -> ShardedBuckets | None:
        """With ``shard=``: the engine holding this rank's chunks (:mod:`parlay.dp.shard`;
        :mod:`parlay.dp.shard_dcp` saves them in DCP form). ``None`` otherwise."""
        return self._buckets if isinstance(self._buckets, ShardedBuckets) else None

    @property
    def shard_rank(self) -> int:
        """The chunk of every unit this rank holds with ``shard=`` (its group rank, unless
        reduced host first)."""
        eng = self.shard_engine
        return eng.rank if eng is not None else comm.group_rank(self.process_group)

    def local_gradients(self) -> list[torch.Tensor]:
        """The averaged gradients this rank steps, after :meth:`synchronize`: with ``shard=``
        its flat chunks, else every parameter's gradient."""
        eng = self.shard_engine
        if eng is not None:
            return eng.local_grads()
        return [p.grad for _, p in self._named if p.grad is not None]

    def named_local_gradients(self) -> list[tuple[str, torch.Tensor]]:
        """:meth:`local_gradients` with names (a chunk's: the parameters it is part of)."""
        eng = self.shard_engine
        if eng is not None:
            return eng.named_local_grads()
        return [(n, p.grad) for n, p in self._named if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients to a global ``max_norm`` (after :meth:`synchronize`);
        with ``shard=`` the norm is summed over every rank's chunks. Returns the total norm
        before clipping, as ``torch.nn.utils.clip_grad_norm_`` does."""
        eng = self.shard_engine
        if eng is not None and eng.shards:
            return clip_chunks_(eng.local_grads(), max_norm, norm_type, self.process_group)
        return torch.nn.utils.clip_grad_norm_([p for _, p in self._named], max_norm, norm_type)

    def unscale_(self, scaler: torch.amp.GradScaler) -> None:
        """``scaler.unscale_(self)`` (after :meth:`synchronize`); with ``shard=`` the ranks then
        agree on overflows (each checks its chunks; unsharded, every rank sees the same sums)."""
        scaler.unscale_(self)
        found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        for t in found.values() if self.shard or self._own_sums else ():
            comm.allreduce(t, "max", group=self.process_group)

    def gathered_parameters(self) -> contextlib.AbstractContextManager[None]:
        """Inside this block every parameter holds its full value, to read (with
        ``shard="parameters"`` they are gathered on entry and freed on exit; writes to them
        are not kept). Every rank of the group must enter it together."""
        eng = self.shard_engine
        return eng.gathered() if eng is not None else contextlib.nullcontext()

    def comm_stats(self) -> dict[str, float]:
        """Gradient bytes sent so far: dense (before compression) vs on the wire, per step."""
        d = self._stats.as_dict()
        steps = max(1, self._steps)
        d["steps"] = self._steps
        d["dense_bytes_per_step"] = d["dense_bytes"] / steps
        d["wire_bytes_per_step"] = d["wire_bytes"] / steps
        if isinstance(self._reducer, HierarchicalReducer):  # what crossed host links
            d["cross_host_bytes_per_step"] = self._reducer.cross_bytes / steps
        return d

    def _state(self) -> dict[str, Any]:
        """The wrapped optimizer's state, plus compression state (e.g. residuals) and, with
        ``shard=``, the layout of this rank's chunks."""
        sd = self._opt.state_dict()
        comp = self.compression.state_dict()
        if comp:
            sd["parlay_compression"] = comp
            sd["parlay_compressor"] = repr(self.compression)
        if self.shard_engine is not None:
            sd["parlay_shard"] = self.shard_engine.layout()
        return sd

    def _load_state(self, sd: dict[str, Any]) -> None:
        comp = sd.pop("parlay_compression", None)
        check_state_writer(self.compression, comp, sd.pop("parlay_compressor", None))
        shard = sd.pop("parlay_shard", None)
        if self.shard_engine is not None:
            self.shard_engine.load_layout(shard)
        elif shard is not None:
            raise ConfigError(f"this optimizer state is rank {shard['rank']}'s shard of "
                              f"shard={shard['level']!r}; load it into a DistributedOptimizer "
                              "with the same shard level and number of ranks.")
        self._opt.load_state_dict(sd)
        if self._buckets is not None:  # a step interrupted before (an elastic restore) is over
            self._buckets.reset()
        if comp:
            self.compression.load_state_dict(comp)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (backward stops communicating): then wrap anew."""
        if self._buckets is not None:
            self._buckets.remove()

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
