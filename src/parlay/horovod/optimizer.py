"""``DistributedOptimizer`` with Horovod's signature, on parlay's bucketed optimizer.

This is the class ``parlay.DistributedOptimizer`` and ``parlay.horovod.DistributedOptimizer``
both name. It takes Horovod's arguments in Horovod's order, or parlay's documented order
(``optimizer, named_parameters, op, compression, backward_passes_per_step, bucket_cap_mb,
gradient_predivide_factor, process_group``) when the third positional argument is an op,
and reduces gradients with :class:`parlay.dp.optimizer.DistributedOptimizer`'s fused buckets
(overlapped with backward; see that class for the mechanics).
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Iterable
from typing import Any

import torch

from parlay.compress.base import Compressor, NoneCompressor, get_compressor
from parlay.dp.hooks import LocalReducer
from parlay.dp.optimizer import DistributedOptimizer as _BucketedOptimizer
from parlay.errors import ConfigError
from parlay.horovod import joining
from parlay.horovod.process_sets import global_process_set
from parlay.reduce_ops import ReduceOp, reduce_op

__all__ = ["DistributedOptimizer"]


class _HorovodCompressor(Compressor):
    """Adapts a Horovod-style compressor (``compress(tensor) -> (tensor, ctx)``,
    ``decompress(tensor, ctx)``) to parlay's bucket protocol; it is assumed summable, as
    Horovod applies it right before an allreduce."""

    name = "horovod"
    summable = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def compress(self, flat: torch.Tensor, key: str) -> tuple[list[torch.Tensor], Any]:
        sent, ctx = self.inner.compress(flat)
        return [sent], ctx

    def decompress(self, payload: list[torch.Tensor], ctx: Any,
                   out: torch.Tensor | None = None) -> torch.Tensor:  # no decodes_into: no out
        return self.inner.decompress(payload[0], ctx)

    def __repr__(self) -> str:
        return f"HorovodCompressor({self.inner!r})"


def _horovod_subclass(compression: Any) -> bool:
    """A class deriving from ``hvd.Compression.none`` (a parlay Compressor) whose own
    ``compress`` is Horovod's static ``compress(tensor)``, as Horovod's docs subclass it."""
    own = next((k.__dict__["compress"] for k in compression.__mro__ if "compress" in k.__dict__),
               None)
    return isinstance(own, staticmethod)


def _adapt_compression(compression: Any) -> Any:
    if isinstance(compression, type) and issubclass(compression, Compressor) \
            and _horovod_subclass(compression):
        return _HorovodCompressor(compression)
    if compression is None or isinstance(compression, (str, Compressor)) or (
            isinstance(compression, type) and issubclass(compression, Compressor)):
        return compression
    if isinstance(compression, int) and not isinstance(compression, bool):
        raise ConfigError("DistributedOptimizer's third positional argument is compression "
                          f"(Horovod's order), got the reduction op {compression!r}. Hint: "
                          "pass op= by keyword.")
    fn = getattr(compression, "compress", None)
    if not callable(fn) or not callable(getattr(compression, "decompress", None)):
        raise ConfigError(f"compression must be a name ('fp16'), a parlay Compressor or a "
                          f"Horovod-style compressor, got {compression!r}.")
    try:
        required = [p for p in inspect.signature(fn).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    if len(required) >= 2:       # compress(flat, key): parlay's protocol already
        return compression
    probe = torch.zeros(1)
    if compression.compress(probe)[0] is probe:   # Horovod's Compression.none
        return NoneCompressor()
    return _HorovodCompressor(compression)


def _check_groups(groups: Any, num_groups: Any) -> Any:
    if num_groups:
        if groups is not None:
            raise ConfigError("pass groups= or the deprecated num_groups=, not both.")
        groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, list) or
                                        (isinstance(groups, int) and groups > 0)):
        raise ConfigError("groups should be a positive integer or a list of lists of "
                          f"torch.Tensor, got {groups!r}.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ConfigError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ConfigError("A parameter can only appear once in groups.")
                seen.add(id(p))
    return groups


def _bucket_cap_mb(given: float | None) -> float:
    # Horovod fuses the optimizer's allreduces in its fusion buffer: the bucket is its analogue.
    if given is not None:
        return given
    if os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip():
        from parlay.horovod.collectives import fusion_bytes

        return fusion_bytes() / 2 ** 20
    return 25


def _is_adasum(op: Any) -> bool:
    try:
        return reduce_op(op) == ReduceOp.Adasum
    except ConfigError:
        return False


_HOROVOD_ORDER = ("compression", "backward_passes_per_step", "op", "gradient_predivide_factor",
                  "num_groups", "groups", "sparse_as_dense", "process_set")
_PARLAY_ORDER = ("op", "compression", "backward_passes_per_step", "bucket_cap_mb",
                 "gradient_predivide_factor", "process_group")


def _is_op(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class DistributedOptimizer(_BucketedOptimizer):
    """Wrap a ``torch.optim`` optimizer so ``step()`` applies gradients reduced over ranks.

    Horovod's ``hvd.DistributedOptimizer``: gradient hooks start fused, asynchronous
    reductions during backward and ``step()`` waits for them; ``synchronize()`` and
    ``skip_synchronize()`` work as in Horovod, as do its misuse warnings and its error for a
    backward pass beyond ``backward_passes_per_step`` before ``step()``.

    Args:
        optimizer: The optimizer to wrap.
        named_parameters: ``model.named_parameters()``; default: positional names.
        compression: ``hvd.Compression.none`` / ``.fp16`` (Horovod-style), a parlay
            compressor name (``"topk:0.01"``) or object; default none.
        backward_passes_per_step: Backward passes accumulated locally per reduction.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (Horovod's delta optimizer: each rank
            steps on its own gradients, its passes averaged as under Average, then each
            parameter's updates are combined with Adasum, Maleki et al. 2020, a parameter
            without a gradient adding zero; no compression, no overlap with backward).
        gradient_predivide_factor: Average as ``sum(g / f) * f / size`` (Horovod's split).
        num_groups: Deprecated alias of an integer ``groups``.
        groups: Horovod's fusion groups (an int or lists of parameters). Validated; parlay
            fuses by ``bucket_cap_mb`` instead, which gives the same result.
        sparse_as_dense: Accepted; sparse gradients are always reduced densely inside the
            buckets (the result is the same) and handed back sparse.
        process_set: Reduce over this process set; non-members step on local gradients.
        bucket_cap_mb: Bucket size in MiB (keyword, or 6th positional in parlay's order).
            Default: ``HOROVOD_FUSION_THRESHOLD`` (bytes, Horovod's fusion buffer) when set, read
            here at construction, else 25.
        process_group: A torch group instead of ``process_set`` (keyword, or 8th positional
            in parlay's order).
        **options: Further keywords of :class:`parlay.dp.optimizer.DistributedOptimizer`, e.g.
            ``average_aggregated_gradients`` (default True: with ``op=Average`` and
            ``backward_passes_per_step=k`` the k accumulated gradients are averaged; False sums
            them, as Horovod does; with ``op=Sum`` they are always summed).

    Raises:
        ConfigError: Bad arguments (a ``ValueError``), or ranks hold different models.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 *args: Any, **kwargs: Any) -> None:
        # Two positional orders, told apart by the third argument: a reduction op means
        # parlay's documented order (optimizer, named_parameters, op, compression,
        # backward_passes_per_step, bucket_cap_mb, gradient_predivide_factor, process_group);
        # anything else is Horovod's (..., compression, backward_passes_per_step, op, ...).
        names = _PARLAY_ORDER if args and _is_op(args[0]) else _HOROVOD_ORDER
        if len(args) > len(names):
            raise ConfigError(f"DistributedOptimizer takes at most {len(names) + 2} positional "
                              f"arguments in this order ({', '.join(names)}), got "
                              f"{len(args) + 2}. Hint: pass options by keyword.")
        for name, value in zip(names, args):
            if name in kwargs:
                raise ConfigError(f"DistributedOptimizer got two values for {name!r} "
                                  "(positional and keyword).")
            kwargs[name] = value
        self._init(optimizer, named_parameters, **kwargs)

    def _init(self, optimizer: torch.optim.Optimizer,
              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
              compression: Any = None, backward_passes_per_step: int = 1,
              op: Any = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
              num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
              process_set: Any = None, *, bucket_cap_mb: float | None = None,
              process_group: Any = None, **options: Any) -> None:
        named = list(named_parameters) if named_parameters is not None else None
        self.groups = _check_groups(groups, num_groups)
        self.sparse_as_dense = bool(sparse_as_dense)
        local_only = False
        if process_set is not None and process_set.process_set_id != 0:
            if process_group is not None:
                raise ConfigError("pass either process_set= or process_group=, not both.")
            if process_set.included():
                process_group = process_set.group()
            else:
                local_only = True      # Horovod: ranks outside the set train on their own
        self.process_set = process_set
        if local_only:
            options["check_consistency"] = False
        # Adasum combines parameter *updates*, not gradients (Horovod's delta optimizer): the
        # wrapped optimizer steps on local gradients, then the updates are Adasum-reduced.
        self._local_only = local_only
        self._adasum = _is_adasum(op) and not local_only
        self._adasum_group = ((process_set, None) if process_group is None or local_only
                              or process_set is not None else (None, process_group))
        comp = _adapt_compression(compression)
        if _is_adasum(op):
            if gradient_predivide_factor != 1.0:  # (Horovod refuses it too)
                raise ConfigError("gradient_predivide_factor only applies to op=Average, "
                                  "not op=Adasum.")
            if comp is not None and not isinstance(get_compressor(comp), NoneCompressor):
                raise ConfigError("op=Adasum does not combine with compression. Hint: "
                                  "compression=hvd.Compression.none (the default).")
            if options.get("shard"):  # each rank would step only its chunk: no update to combine
                raise ConfigError("op=Adasum does not combine with shard=: Adasum combines "
                                  "every rank's whole update. Hint: op=Average with shard=, or "
                                  "Adasum unsharded.")
            op = ReduceOp.Average
        super().__init__(optimizer, named, op=op, compression=comp,
                         backward_passes_per_step=backward_passes_per_step,
                         bucket_cap_mb=_bucket_cap_mb(bucket_cap_mb),
                         gradient_predivide_factor=gradient_predivide_factor,
                         process_group=process_group, **options)
        self._joins = not (local_only or self._adasum) and process_group is None \
            and self._buckets is not None
        self._own_sums = self._adasum and self._world > 1  # unscale_: the ranks agree
        if self._joins:
            joining.register(self)  # hvd.join() stands in for this rank's steps once joined
        if named is None:
            self._parameter_names = {p: f"allreduce.noname.{i}.{j}"
                                     for i, g in enumerate(optimizer.param_groups)
                                     for j, p in enumerate(g["params"])}
        else:
            self._parameter_names = {p: n for n, p in named}

    def synchronize(self) -> None:
        self._reduce()
        eng = global_process_set._engine
        if self._joins and self._world > 1 and (eng is None or eng.group is None):
            # A rank that runs out of batches joins on the global set's engine: connect it at
            # the first step, so the joined rank waits for one step, not for this rank's join.
            from parlay.horovod import collectives

            collectives.target(None)._connect(block=True)

    def _reduce(self) -> None:
        super().synchronize()
        joining.note_round(self)

    def _mirror_round(self) -> None:
        """A joined rank's stand-in for a step: the same reductions from zero gradients, the
        result dropped (the weights stay; see :mod:`parlay.horovod.joining`)."""
        self.zero_grad(set_to_none=True)
        self._reduce()
        self._synchronized = False

    def _scales(self) -> tuple[float, float]:
        if self._adasum:  # the buckets only average the k passes; step() combines the updates
            return 1.0, 1.0 / (self.backward_passes_per_step
                               if self.average_aggregated_gradients else 1)
        return super()._scales()

    def _make_reducer(self, hierarchical: bool | str) -> Any:
        # Ranks outside the process set keep their gradients local: no hooks, no buckets.
        # Adasum (which reduces updates in step()) keeps them local in buckets that count the
        # passes, average them and give a parameter without a gradient zeros.
        if self._local_only:
            return None
        return LocalReducer() if self._adasum else super()._make_reducer(hierarchical)

    def _scaler_step(self, closure: Any) -> Any:
        if self._adasum and self._should_synchronize and not self._synchronized:
            self.synchronize()  # local (averages the passes): the scaler saw local gradients
        if self._adasum and self._world > 1:
            # GradScaler checked this rank's own gradients (Adasum combines updates, in step()):
            # the ranks skip together, or one skipping alone leaves the others in the Adasum.
            from parlay.horovod import collectives

            found = self.__dict__["found_inf"].detach().float().reshape(1).clone()
            pset, pg = self._adasum_group
            collectives.allreduce_async([found], True, None, ReduceOp.Max, 1.0, 1.0, pset, pg,
                                        False).wait()
            self.__dict__["found_inf"] = found
        return super()._scaler_step(closure)

    def _apply_update(self, closure: Any) -> Any:
        """Step the wrapped optimizer; with ``op=Adasum``, on the local gradients, then
        replace each parameter's update by the Adasum of every rank's update."""
        if not self._adasum:
            return super()._apply_update(closure)
        from parlay.horovod import collectives

        params = [p for _, p in self._named]  # every rank, every parameter: paired by name
        starts = [p.detach().clone() for p in params]
        loss = super()._apply_update(closure)
        if params:
            pset, pg = self._adasum_group
            deltas = [p.detach() - s for p, s in zip(params, starts)]
            reduced = collectives.allreduce_async(deltas, True, None, ReduceOp.Adasum, 1.0, 1.0,
                                                  pset, pg, False).wait()
            with torch.no_grad():
                for p, s, d in zip(params, starts, reduced):
                    p.copy_(s + d)
        return loss
