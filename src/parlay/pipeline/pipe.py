"""``Pipeline``: a model split into stages, run by a schedule, replicated data-parallel.

Loss contract (read this before comparing numbers with a single-process run). ``loss_fn(output,
target)`` is called once per micro-batch and must return that micro-batch's *mean* loss
(``reduction="mean"``, the PyTorch default). A batch of ``B`` samples is cut into ``m`` equal
micro-batches and every micro-batch loss is multiplied by ``1/m`` before its backward, so

* the loss parlay reports is the mean over the batch, and
* the gradient equals the gradient of the full-batch mean loss,

exactly as one process running ``loss_fn(model(x), y).backward()`` on the whole batch (up to
summation order). This is ``torch.distributed.pipelining``'s ``scale_grads=True`` done before
the backward instead of after it, which also keeps the data-parallel hooks free to start their
allreduce during the last micro-batch's backward. With ``loss_reduction="sum"`` nothing is
scaled (sum losses add up across micro-batches). When ``B`` is not a multiple of ``chunks``, the
largest divisor of ``B`` not above ``chunks`` is used, so micro-batches stay equal and the
contract stays exact; a schedule that cannot run that many micro-batches (1F1B needs
``chunks >= stages``) falls back to one with the same mathematics (GPipe).

Every rank of a pipeline calls :meth:`Pipeline.step` with the same batch: stage 0 reads ``x``,
the last stage ``target``, and every stage derives the micro-batch plan from the batch size.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from parlay import comm, runtime
from parlay.errors import ConfigError
from parlay.dp.checks import check_consistency
from parlay.pipeline.hybrid import HybridMesh, build_mesh, mean_over, positive
from parlay.pipeline.partition import Partition, check_boundaries, partition
from parlay.pipeline.schedule import (
    InstrumentedStage,
    ScheduleSpec,
    StageMeter,
    StageModule,
    tensor_dtypes,
    get_schedule,
    theoretical_bubble,
    wire_dtype,
)
from parlay.pipeline.step import (
    ScaledLoss,
    StepOutput,
    batch_args,
    p2p_errors,
    plan_chunks,
)
from parlay.pipeline.trace import as_sequential, original_name

__all__ = ["Pipeline", "StepOutput"]


def _check_args(chunks: Any, loss_reduction: str, loss_fn: Any) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks (micro-batches per batch) must be an int >= 1, got {chunks!r}.")
    if loss_reduction not in ("mean", "sum"):
        raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}.")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError("loss_fn must be callable(output, target), got "
                          f"{type(loss_fn).__name__}.")


def _virtual_stages(virtual_stages: Any, spec: ScheduleSpec, schedule: str) -> int:
    v = virtual_stages if virtual_stages is not None else (2 if spec.multi_stage else 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"virtual_stages must be an int >= 1, got {v!r}.")
    if v > 1 and not spec.multi_stage:
        raise ConfigError(f"virtual_stages={v} needs schedule='interleaved', got "
                          f"schedule={schedule!r}.")
    return v


def _ranks_per_pipeline(stages: int | None, dp: int | None, mesh: HybridMesh | None) -> int:
    if not dist.is_initialized():
        raise ConfigError("the pipeline needs a process group. Hint: call parlay.init() first.")
    if mesh is not None:
        return mesh.pp
    if stages is None:
        world = dist.get_world_size()
        stages = world // dp if dp else world
    return positive("pp (stages)", stages)


class Pipeline:
    """Split ``model`` into pipeline stages across ranks, optionally replicated data-parallel.

    Example (4 ranks: 2 replicas x 2 stages)::

        pipe = parlay.pipeline.Pipeline(model, nn.functional.cross_entropy, stages=2, chunks=4)
        opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        for x, y in loader:                # the same batch on both stages of a replica
            opt.zero_grad()
            out = pipe.step(x, y)          # out.loss on the last stage, None elsewhere
            opt.step()                     # stage gradients averaged over the replicas

    Args:
        model: An ``nn.Sequential`` (every rank builds the same full model; each keeps its
            stage's layers).
        loss_fn: ``loss_fn(output, target) -> scalar`` mean over a micro-batch (see the module
            docstring); ``None`` for an inference-only pipeline.
        stages: Ranks per pipeline (``pp``); default: the whole world (``dp=1``) or
            ``world // dp``.
        chunks: Micro-batches per batch (``m``).
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleaved"``.
        balance: Layers per *model* stage (``stages * virtual_stages`` entries), or ``None``.
        split_points: Names of the layers that start model stages 1.. (instead of balance).
        sample: Example input (one micro-batch); enables balancing by profiled time and the
            construction-time check that stage boundaries carry tensors (without it, the
            check runs on the first micro-batch of the first step, on every rank alike).
            A traced model is traced with it, and shapes its forward computes from the input
            are frozen there: after ``x.view(x.size(0), -1)`` it takes only micro-batches of
            the sample's row count, and a batch that makes others is refused (use ``chunks``
            x that many rows per batch with ``drop_last=True``, or ``x.flatten(1)`` /
            ``nn.Flatten``, which trace for any row count).
        by: ``"auto"`` | ``"time"`` | ``"params"``: what to balance (see :func:`partition`).
        activation_dtype: ``"bf16"``/``"fp16"`` (or a dtype) to send activations and their
            gradients between stages in; ``None`` sends them as computed.
        virtual_stages: Model stages per rank (interleaved only; default 2 there, else 1).
        dp: Data-parallel replicas; default ``world // stages``.
        loss_reduction: ``"mean"`` (default) or ``"sum"``: what ``loss_fn`` returns.
        sync_parameters: Broadcast each stage's parameters from replica 0 at construction.
        autocast_dtype: Mixed precision: run every stage and the loss under
            ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``).
        mesh: An existing :class:`HybridMesh` to run on (then ``dp``/``stages`` come from it).

    Raises:
        ConfigError: Bad arguments (see :func:`parlay.pipeline.partition` for the partition
            errors), a world that is not ``dp x stages`` ranks, or ranks apart on a setting
            that shapes the schedule (compared at construction, refused on every rank).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None = None, *,
                 stages: int | None = None, chunks: int = 4, schedule: str = "1f1b",
                 balance: list[int] | None = None, split_points: list[str] | None = None,
                 sample: Any = None, by: str = "auto", activation_dtype: Any = None,
                 virtual_stages: int | None = None, dp: int | None = None,
                 loss_reduction: str = "mean", sync_parameters: bool = True,
                 autocast_dtype: torch.dtype | None = None,
                 mesh: HybridMesh | None = None) -> None:
        _check_args(chunks, loss_reduction, loss_fn)
        self.spec: ScheduleSpec = get_schedule(schedule)
        v = _virtual_stages(virtual_stages, self.spec, schedule)
        self.wire_dtype = wire_dtype(activation_dtype)
        pp = _ranks_per_pipeline(stages, dp, mesh)
        self.chunks, self.virtual_stages = chunks, v
        self.loss_reduction = loss_reduction
        self.num_stages = pp * v
        self.device = runtime.device() if runtime.is_initialized() else torch.device("cpu")
        self.traced = not isinstance(model, nn.Sequential)
        self.seq = as_sequential(model, split_points, sample)
        self.partition: Partition = self._cut(balance, split_points, sample, by)
        # Compared before the mesh is built (ranks apart on stages would build other groups).
        timed = self.partition.method == "time"  # each rank's own profile: agreed below
        settings = {"stages": pp, "virtual_stages": v, "schedule": self.spec.name,
                    "chunks": chunks, "layers": len(self.partition.names),
                    "balance": "by time" if timed else self.partition.balance,
                    "loss_reduction": loss_reduction, "trains": loss_fn is not None,
                    "activation_dtype": self.wire_dtype, "dp": mesh.dp if mesh else dp,
                    "autocast_dtype": autocast_dtype, "sync_parameters": sync_parameters}
        check_consistency([], None, settings, what="build their Pipeline with")
        if timed and dist.get_world_size() > 1:
            # Profiles differ between ranks; everyone must cut the model the same way. Only
            # numbers travel (tensors, never a pickle): the layer names are the same model's.
            self.partition = _agree_on_partition(self.partition, comm.group_device())
        _check_untied(self.seq, self.partition)
        self.mesh = mesh = mesh if mesh is not None else build_mesh(pp, dp)
        self.stage_ids = [mesh.pp_rank + k * mesh.pp for k in range(v)]
        self.modules: list[StageModule] = [
            StageModule(self.partition.build(self.seq, s), self.wire_dtype, s == 0,
                        s == self.num_stages - 1, autocast_dtype) for s in self.stage_ids]
        self.meter = StageMeter()
        self._loss = (ScaledLoss(loss_fn, self.meter, autocast_dtype, self.device.type)
                      if loss_fn is not None else None)
        self._cache: OrderedDict[Any, tuple[Any, str]] = OrderedDict()
        self._checked = False
        self._traced_rows: int | None = None  # the only micro-batch rows a traced model takes
        #: Loss scaling (fp16): the loss, hence every gradient, is multiplied by this (in float32)
        #: before backward; the reported loss is unscaled. Equal on every rank of a pipeline.
        self.loss_scale = 1.0
        if sample is not None:
            self._check(sample)  # before the move: every stage's layers on one device
        for mod in self.modules:
            mod.to(self.device)
        if sync_parameters and mesh.dp > 1:
            from parlay.dp.functions import broadcast_parameters

            broadcast_parameters(self.state_dict(), root_rank=0, process_group=mesh.dp_group)

    def _cut(self, balance: list[int] | None, split_points: list[str] | None, sample: Any,
             by: str) -> Partition:
        """The partition of ``self.seq`` into stages (this rank's profile when timed)."""
        explicit = balance is not None or split_points is not None
        by_time = not explicit and (by == "time" or (by == "auto" and sample is not None))
        known = by in ("auto", "time", "params")  # else partition() refuses it by name
        if self.traced:  # the traced pieces: one starts at each split point
            split_points = list(self.seq._modules)[1:] if balance is None else None
        return partition(self.seq, self.num_stages, balance=balance,
                         split_points=split_points,
                         sample=sample if by_time else None,
                         by="time" if by_time else "params" if known else by)

    # ------------------------------------------------------------------ structure
    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (it reads the input)."""
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss and the output)."""
        return self.num_stages - 1 in self.stage_ids

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the full model (e.g. ``"2.weight"``)."""
        for mod in self.modules:
            for name, p in mod.layers.named_parameters():
                yield original_name(name, self.traced), p

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under their full-model names."""
        out: dict[str, torch.Tensor] = {}
        for mod in self.modules:
            out.update({original_name(k, self.traced): v
                        for k, v in mod.layers.state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Restore :meth:`state_dict` (the keys must be this rank's: all of them if
        ``strict``, else a subset, e.g. no parameters where a sharded optimizer holds them)."""
        mine = set(self.state_dict())
        if set(state) != mine if strict else not set(state) <= mine:
            raise ConfigError(f"state for this pipeline rank holds {sorted(state)[:4]}..., "
                              f"expected {'exactly ' if strict else ''}the keys of stages "
                              f"{self.stage_ids}.")
        for mod in self.modules:
            keys = [k for k in mod.layers.state_dict() if original_name(k, self.traced) in state]
            mod.layers.load_state_dict({k: state[original_name(k, self.traced)] for k in keys},
                                       strict=strict)

    def train(self, mode: bool = True) -> Pipeline:
        """Set the stage modules' training mode."""
        for mod in self.modules:
            mod.train(mode)
        return self

    # ------------------------------------------------------------------ schedules
    def _check(self, sample: Any) -> None:
        seq = nn.Sequential(OrderedDict((n, _OnItsDevice(m)) for n, m in self.seq._modules.items()))
        outs = check_boundaries(seq, self.partition, sample)
        for mod, s in zip(self.modules, self.stage_ids):
            if s > 0:
                mod.in_dtypes = tensor_dtypes(outs[s - 1])
        if self.traced:  # does the trace take other row counts? (x.view(x.size(0), -1) not)
            try:
                check_boundaries(seq, self.partition,
                                 tree_map_only(torch.Tensor, lambda t: torch.cat([t, t]), sample))
            except Exception:  # noqa: BLE001 - any failure: shapes were frozen by the trace
                self._traced_rows = int(batch_args(sample)[0].shape[0])
        self._checked = True

    def _schedule(self, x: tuple[torch.Tensor, ...], m: int, train: bool) -> tuple[Any, str]:
        key = (train, m, tuple((tuple(t.shape), t.dtype) for t in x))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        spec = self.spec
        if not spec.accepts(m, self.mesh.pp):
            spec = get_schedule(spec.fallback) if spec.fallback else spec
        stages = [InstrumentedStage(mod, s, self.num_stages, self.device, self.mesh.pp_group,
                                    self.meter) for mod, s in zip(self.modules, self.stage_ids)]
        arg = stages if spec.multi_stage else stages[0]
        if train:
            sched = spec.cls(arg, m, loss_fn=self._loss, scale_grads=False)
        else:
            sched = spec.eval_cls(arg, m, scale_grads=False)  # leave .grad alone
        self._cache[key] = (sched, spec.name)
        while len(self._cache) > 8:
            self._cache.popitem(last=False)
        return sched, spec.name

    def _run(self, x: Any, target: Any, train: bool, return_outputs: bool) -> StepOutput:
        args = batch_args(x)
        batch = int(args[0].shape[0])
        if batch < 1:
            raise ConfigError("the batch is empty.")
        m = plan_chunks(batch, self.chunks)
        rows = self._traced_rows
        if rows is not None and batch // m != rows:
            raise ConfigError(
                f"the traced model takes only micro-batches of {rows} rows (those of sample=): "
                "its forward computes a shape from the input, e.g. x.view(x.size(0), -1), "
                f"which the trace froze; a batch of {batch} makes micro-batches of {batch // m}. "
                f"Fix: use batches of {rows * self.chunks} (chunks x {rows}) with drop_last=True, "
                "validation batches too, or x.flatten(1) / nn.Flatten() in the model, which "
                "trace for any batch.")
        if not self._checked:
            self._check(args[0][: batch // m] if len(args) == 1
                        else tuple(a[: batch // m] for a in args))
        sched, name = self._schedule(args, m, train)
        if self._loss is not None:
            self._loss.factor = 1.0 / m if self.loss_reduction == "mean" else 1.0
            self._loss.loss_scale, self._loss.losses = self.loss_scale, []
        self.meter.reset()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self._loss is not None:
            tensor = isinstance(target, torch.Tensor) or target is None
            self._loss.targets = None if tensor else target
            target = target if tensor else torch.arange(batch)
        if train:
            kwargs = {"target": target if self.is_last else None,
                      "losses": losses if self.is_last else None}
        t0 = time.perf_counter()
        out = sched.step(*(args if self.is_first else ()), return_outputs=return_outputs,
                         **kwargs)
        wall = time.perf_counter() - t0
        mt = self.meter
        # The unscaled losses (a finite loss reported finite) of the schedule's micro-batches:
        # the last ones (a new schedule first calls the loss on its shape inference's output).
        raw = self._loss.losses[-len(losses):] if self._loss is not None and losses else []
        loss = torch.stack(raw).sum() if raw else None
        return StepOutput(loss, out if self.is_last and return_outputs else None, m, name,
                          wall, mt.compute_s, mt.compute_cpu_s, mt.fwd_bytes, mt.bwd_bytes,
                          mt.fwd_dense_bytes, mt.bwd_dense_bytes, mt.messages)

    # ------------------------------------------------------------------ running
    def step(self, x: Any, target: Any = None, *, return_outputs: bool = False) -> StepOutput:
        """Forward and backward of one batch through the pipeline.

        Gradients accumulate into this rank's parameters (``.grad``): the gradient of the
        batch's mean loss (see the module docstring). With :meth:`distributed_optimizer`, their
        average over the replicas starts during the last micro-batch's backward and completes
        in ``optimizer.step()``.

        Args:
            x: The batch input (tensor or tuple of tensors), on every rank of the pipeline.
            target: The batch target; required on the last stage.
            return_outputs: Also return the model output on the last stage.

        Returns:
            A :class:`StepOutput` (loss on the last stage).

        Raises:
            ConfigError: No loss_fn, a missing target on the last stage, or a bad input.
            CommError: A neighbouring stage failed or timed out.
        """
        if self._loss is None:
            raise ConfigError("this pipeline has no loss_fn; use forward() for inference, or "
                              "pass loss_fn to Pipeline(...) to train.")
        if self.is_last and target is None:
            raise ConfigError("the last pipeline stage needs the target: call step(x, target) "
                              "on every rank of the pipeline with the same batch.")
        with p2p_errors("pipeline step", self.mesh.pp_group):
            return self._run(x, target, train=True, return_outputs=return_outputs)

    @torch.no_grad()
    def forward(self, x: Any) -> Any:
        """Inference through the pipeline (no gradients): the output on the last stage, else
        ``None``. Every rank of the pipeline calls it with the same batch."""
        with p2p_errors("pipeline forward", self.mesh.pp_group):
            return self._run(x, None, train=False, return_outputs=True).output

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, *, compression: Any = None,
                              bucket_cap_mb: float = 25.0, shard: str | None = None) -> Any:
        """Wrap ``optimizer`` (built over :meth:`parameters`) so each stage's gradients are
        averaged over its replicas with parlay's bucketed, overlapped engine.

        Args:
            optimizer: A ``torch.optim`` optimizer over this rank's parameters.
            compression: Gradient compression for the data-parallel allreduce (``"fp16"``,
                ``"topk:0.01"``, ...).
            bucket_cap_mb: Bucket size.
            shard: Shard each stage's state over its replicas (see :mod:`parlay.dp.shard`).

        Returns:
            A :class:`parlay.DistributedOptimizer` over ``dp_group``.
        """
        from parlay.dp.optimizer import DistributedOptimizer

        mine = {id(p) for p in self.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
        if foreign:
            raise ConfigError(f"the optimizer holds {len(foreign)} parameter(s) that are not in "
                              "this rank's stages. Hint: build it over pipe.parameters().")
        dopt = DistributedOptimizer(optimizer, named_parameters=list(self.named_parameters()),
                                    compression=compression, bucket_cap_mb=bucket_cap_mb,
                                    process_group=self.mesh.dp_group, shard=shard,
                                    model=nn.ModuleList(self.modules))
        # Hooks stay silent for every backward but a stage's last one in a step.
        self.meter.defer_grad_sync = dopt.no_sync
        return dopt

    def clip_grad_norm_(self, max_norm: float, shards: list[torch.Tensor] | None = None) -> float:
        """Clip the gradients of the *whole model* to ``max_norm`` (2-norm over every stage).

        Call after the data-parallel average (``optimizer.synchronize()``); returns the norm
        before clipping. A collective over the pipeline group; given ``shards`` (a sharded
        optimizer's :meth:`~parlay.DistributedOptimizer.local_gradients`), over the replicas
        too, each of which holds its own part of the stage's gradients.
        """
        sq = torch.zeros(1, dtype=torch.float64)
        grads = shards if shards is not None else \
            [p.grad for p in self.parameters() if p.grad is not None]
        for g in grads:
            sq += g.detach().double().pow(2).sum().cpu()
        groups = [self.mesh.pp_group] + ([self.mesh.dp_group] if shards is not None else [])
        for group in groups:
            sq = comm.allreduce(sq.to(comm.group_device(group)), "sum", group=group).cpu()
        norm = float(sq.sqrt().item())
        if norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
        return norm

    def mean_over_replicas(self, value: float | torch.Tensor) -> float:
        """Average a metric over the replicas (``dp_group``; every member must call)."""
        return mean_over(value, self.mesh.dp_group)

    def theoretical_bubble(self, chunks: int | None = None) -> float:
        """``(S-1)/(v*m + S-1)`` for this pipeline."""
        return theoretical_bubble(self.mesh.pp, chunks or self.chunks, self.virtual_stages)

    def __repr__(self) -> str:
        return (f"Pipeline(stages={self.mesh.pp}, dp={self.mesh.dp}, schedule={self.spec.name!r}, "
                f"chunks={self.chunks}, balance={list(self.partition.balance)}, "
                f"local_stages={self.stage_ids}, wire_dtype={self.wire_dtype})")


class _OnItsDevice(nn.Module):
    """A layer run on the device of its own tensors (a lazy boundary check runs the whole model
    after only this rank's stages moved to the compute device)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Any) -> Any:
        t = next(iter([*self.layer.parameters(), *self.layer.buffers()]), None)
        if t is not None:
            x = tree_map_only(torch.Tensor, lambda v: v.to(t.device), x)
        return self.layer(x)


def _agree_on_partition(part: Partition, device: torch.device) -> Partition:
    """Rank 0's split and costs on every rank, sent as two tensors (no pickled objects)."""
    import dataclasses

    balance = torch.tensor(part.balance, dtype=torch.int64, device=device)
    costs = torch.tensor(part.costs or [0.0] * len(part.names), dtype=torch.float64, device=device)
    comm.broadcast(balance, src=0)
    comm.broadcast(costs, src=0)
    return dataclasses.replace(part, balance=tuple(int(b) for b in balance.tolist()),
                               costs=tuple(float(c) for c in costs.tolist()))


def _check_untied(seq: nn.Sequential, part: Partition) -> None:
    """Refuse a parameter shared by layers of two stages: each stage would train its own copy.

    Raises:
        ConfigError: Naming the parameter and the stages.
    """
    children = seq._modules
    owner: dict[int, tuple[int, str]] = {}
    for s in range(part.num_stages):
        for name in part.stage_names(s):
            for pname, p in children[name].named_parameters():
                first = owner.setdefault(id(p), (s, f"{name}.{pname}"))
                if first[0] != s:
                    raise ConfigError(
                        f"parameter {first[1]} is shared by stage {first[0]} and stage {s} "
                        f"({name}.{pname}): each stage would train its own copy and the tie "
                        "would silently break. Hint: move the boundary (balance=[...] or "
                        "split_points=[...]) so the layers sharing it are in one stage.")
