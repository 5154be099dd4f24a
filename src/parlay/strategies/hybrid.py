"""The ``"hybrid"`` strategy: pipeline stages x data-parallel replicas under the Trainer.

``Trainer(..., mode="hybrid", strategy_options={"pp": 2, "chunks": 4})`` on ``dp * pp`` ranks
builds a :class:`~parlay.pipeline.Pipeline` of the model returned by ``build_training_func``
(an ``nn.Sequential``). Global rank ``r`` is stage ``r % pp`` of replica ``r // pp``; every
stage of a replica reads the same batch (``dp_rank`` is the replica index), the last stage
computes and reports the loss, and metrics are reduced over the last stages' ``dp_group``.
"""
from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import runtime
from parlay.dp.functions import coalesced_broadcast
from parlay.errors import ConfigError
from parlay.pipeline.pipe import Pipeline
from parlay.strategies.base import StepResult, register_strategy, reject_unknown
from parlay.strategies.template import (PRECISIONS, StepTemplate, batch_size_of,
                                        replicated_part, to_device)

__all__ = ["HybridStrategy"]


class HybridStrategy(StepTemplate):
    """Pipeline parallel within a replica, data parallel across replicas.

    Args:
        compression: Compressor for the data-parallel gradient allreduce (``"fp16"``, ...).
        precision: ``"fp32"``, ``"bf16"`` (autocast inside every stage) or ``"fp16"``
            (autocast plus the dynamic loss scale of
            :class:`~parlay.strategies.template.LossScaler`, whose overflow/skip decision is
            agreed by every rank of the world, so all stages skip the same steps).
        grad_clip: Clip the whole model's gradient norm (over every stage) after averaging.
        pp: Ranks per pipeline. Default: the stage count the launch was given
            (``parlay run --pp P``, i.e. ``runtime.cluster().pipeline_stages``), else 2.
        chunks: Micro-batches per batch.
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"``.
        balance / split_points / sample / by / virtual_stages / activation_dtype: See
            :class:`~parlay.pipeline.Pipeline` (a model that is not an ``nn.Sequential`` is
            traced at its ``split_points``, with ``sample``, an example micro-batch input).
        loss_reduction: ``"mean"`` (default) or ``"sum"``: the reduction of the loss
            ``build_training_func`` returns. Micro-batch losses are averaged for ``"mean"``
            and added up for ``"sum"``, so the loss and gradients equal the unsplit batch's.
        bucket_cap_mb: Gradient bucket size of the data-parallel engine.
        loss_scale: Initial fp16 loss scale (default 2**16).
        shard: Shard each stage's training state over its replicas (``"optimizer"``,
            ``"gradients"``, ``"parameters"``; see :mod:`parlay.dp.shard`).

    Raises:
        ConfigError: Unknown options or values this mode cannot honour.
    """

    name = "hybrid"

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, pp: int | None = None, chunks: int = 4,
                 schedule: str = "1f1b", balance: list[int] | None = None,
                 split_points: list[str] | None = None, sample: Any = None, by: str = "auto",
                 virtual_stages: int | None = None, activation_dtype: Any = None,
                 loss_reduction: str = "mean", bucket_cap_mb: float = 25.0,
                 loss_scale: float | None = None, shard: str | None = None,
                 **unknown: Any) -> None:
        reject_unknown(HybridStrategy, unknown)
        # Stages hold different gradients: the overflow flag is agreed over the world.
        super().__init__(precision, grad_clip, loss_scale, scaler_group=None, scaler_agree=True)
        self.compression = compression
        self._pp = pp
        self.options = dict(chunks=chunks, schedule=schedule, balance=balance,
                            split_points=split_points, sample=sample, by=by,
                            virtual_stages=virtual_stages, activation_dtype=activation_dtype,
                            loss_reduction=loss_reduction)
        self.bucket_cap_mb = bucket_cap_mb
        self.shard = shard
        self.pipe: Pipeline | None = None
        self._buffers: list[torch.Tensor] = []
        self._bytes = {"fwd_bytes": 0, "bwd_bytes": 0, "fwd_dense_bytes": 0,
                       "bwd_dense_bytes": 0, "steps": 0}

    # ------------------------------------------------------------------ topology
    @property
    def pp(self) -> int:
        """Ranks per pipeline: the ``pp`` option, else the launch's ``--pp``, else 2."""
        if self._pp is not None:
            return self._pp
        launched = runtime.cluster().pipeline_stages if runtime.is_initialized() else None
        return launched or 2

    def _world(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_size(self) -> int:
        return self.pipe.mesh.dp if self.pipe else max(1, self._world() // max(1, self.pp))

    @property
    def dp_rank(self) -> int:
        if self.pipe:
            return self.pipe.mesh.dp_rank
        return (dist.get_rank() if dist.is_initialized() else 0) // max(1, self.pp)

    @property
    def dp_group(self) -> Any:
        return self._ready().mesh.dp_group

    @property
    def has_replicas(self) -> bool:
        return not self.shard  # sharded replicas each hold their own chunks

    @property
    def metrics_group(self) -> Any:
        return self._ready().mesh.pp_group if self.pp > 1 else None

    @property
    def sharded_checkpoint(self) -> tuple[Any, str] | None:
        """Each stage's replicas write their own DCP checkpoint (``stage<k>``)."""
        return (self.optimizer, f"stage{self._ready().mesh.pp_rank}") if self.shard else None

    @property
    def reports_loss(self) -> bool:
        return self._ready().is_last

    @property
    def model(self) -> nn.Module | None:
        """This rank's stage modules (an ``nn.ModuleList``), once set up."""
        return nn.ModuleList(self.pipe.modules) if self.pipe else None

    def _ready(self) -> Pipeline:
        if self.pipe is None:
            raise ConfigError("HybridStrategy.setup(...) must run before training.")
        return self.pipe

    # ------------------------------------------------------------------ life cycle
    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        self._refuse_servers()
        self.pipe = Pipeline(model, loss_fn, stages=self.pp,
                             autocast_dtype=PRECISIONS[self.precision], **self.options)
        part, layers = self.pipe.partition, self.pipe.seq._modules
        empty = [f"stage {s} ({', '.join(f'{n}: {type(layers[n]).__name__}' for n in names)})"
                 for s, names in enumerate(map(part.stage_names, range(part.num_stages)))
                 if not any(True for n in names for _ in layers[n].parameters())]
        if empty:  # every rank knows the partition: refused on every rank alike
            raise ConfigError(f"{'; '.join(empty)} holds no parameters, but every stage "
                              "steps an optimizer. Hint: pass strategy_options={'balance': "
                              "[...]} so every stage holds a layer with parameters, or fewer "
                              "stages (pp).")
        # Buffers (BatchNorm's running statistics) follow the first replica's after every
        # step, as in mode="allreduce": every replica then evaluates and saves one model.
        self._buffers = [b for m in self.pipe.modules for b in m.buffers()] \
            if self.pipe.mesh.dp > 1 else []
        opt = self._new_optimizer(optimizer_cls, self.pipe.parameters(), optimizer_args)
        self.optimizer = self.pipe.distributed_optimizer(
            opt, compression=self.compression, bucket_cap_mb=self.bucket_cap_mb, shard=self.shard)

    def _to(self, t: Any) -> Any:
        return to_device(t, self._ready().device)

    def train_step(self, x: Any, y: Any) -> StepResult:
        pipe, opt = self._ready(), self.optimizer
        pipe.train(True)
        opt.zero_grad(set_to_none=True)
        saved = self._saved_compression()
        if self.scaler is not None:
            pipe.loss_scale = self.scaler.scale    # the pipeline scales its own backward
        out = pipe.step(self._to(x), self._to(y))

        def nonfinite(grads: bool) -> bool:
            # Over every stage of every replica (the world): stages hold different gradients.
            named = opt.named_local_gradients()
            loss = float(out.loss.detach().float().item()) if out.loss is not None else None
            return self._skip_nonfinite(loss, named, grads=grads)

        skipped = self._update(
            opt.local_gradients, nonfinite,
            lambda norm: pipe.clip_grad_norm_(norm, opt.local_gradients() if self.shard else None),
            saved)
        if self._buffers:  # one unchecked message per dtype: the replicas built one model
            coalesced_broadcast(self._buffers, 0, pipe.mesh.dp_group, check=False)
        b = self._bytes
        for k in ("fwd_bytes", "bwd_bytes", "fwd_dense_bytes", "bwd_dense_bytes"):
            b[k] += getattr(out, k)
        b["steps"] += 1
        loss = float(out.loss.item()) if out.loss is not None else None
        return StepResult(loss=loss, samples=batch_size_of(y), skipped=skipped)

    def evaluating(self) -> contextlib.AbstractContextManager[Any]:
        # Micro-batches make the number of forwards differ between replicas: a sharded stage
        # holds its parameters gathered for the whole evaluation instead.
        return self.optimizer.gathered_parameters() if self.shard == "parameters" \
            else contextlib.nullcontext()

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor | None:
        pipe = self._ready()
        was = [m.training for m in pipe.modules]
        pipe.train(False)
        try:
            return pipe.forward(self._to(x))
        finally:
            for m, w in zip(pipe.modules, was):
                m.train(w)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        pipe = self._ready()
        model = pipe.state_dict()
        if self.shard:  # the trainable parameters are in the optimizer state's chunks
            model = replicated_part(model, pipe.named_parameters())
        return self._scaler_state({"model": model,
                                   "optimizer": self.optimizer.state_dict(),
                                   "stages": list(pipe.stage_ids),
                                   "balance": list(pipe.partition.balance)})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pipe = self._ready()
        got = (list(state.get("stages", [])), list(state.get("balance", [])))
        want = (list(pipe.stage_ids), list(pipe.partition.balance))
        if got != want:
            raise ConfigError(f"checkpoint holds stages {got[0]} with balance {got[1]}, this rank "
                              f"runs stages {want[0]} with balance {want[1]}. Hint: resume with "
                              "the same pp, schedule and balance (a split by profiled time is "
                              "measured anew at each start: pin it with strategy_options "
                              "balance=[...] from a run's first start on).")
        pipe.load_state_dict(state["model"], strict=not self.shard)
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_scaler_state(state)

    def comm_stats(self) -> dict[str, float]:
        """Bytes between stages per step (wire and dense) and the data-parallel gradient bytes."""
        b = self._bytes
        steps = max(1, b["steps"])
        out: dict[str, float] = {f"pipeline_{k}_per_step": v / steps for k, v in b.items()
                                 if k != "steps"}
        out.update({f"dp_{k}": v for k, v in self.optimizer.comm_stats().items()})
        return out


register_strategy("hybrid", HybridStrategy)
