"""The ``"allreduce"`` strategy: data parallel training with :class:`DistributedOptimizer`.

Every rank holds the whole model; gradients are averaged (optionally compressed) by the
bucketed, overlapped engine of :mod:`parlay.dp.optimizer`. Precision, the fp16 loss scale,
clipping and the order of the update are the shared template's
(:mod:`parlay.strategies.template`): gradients are averaged *before* the overflow check, so
every rank sees the same averaged gradients, finds the same overflow and skips the same steps
without a message.
"""
from __future__ import annotations


from typing import Any
from collections.abc import Callable

import torch
import torch.nn as nn

from parlay import comm, runtime
from parlay.dp.functions import broadcast_parameters, coalesced_broadcast
from parlay.dp.optimizer import DistributedOptimizer
from parlay.errors import ConfigError
from parlay.strategies.base import StepResult, register_strategy, reject_unknown
from parlay.strategies.template import (StepTemplate, autocast_context, batch_size_of,
                                        micro_batches, replicated_part, to_device)

__all__ = ["AllreduceStrategy"]


class WholeModelStrategy(StepTemplate):
    """What the modes that hold the whole model on every rank share (``"allreduce"``,
    ``"diloco"``): placing it, its readiness, evaluation, state and byte counts.

    Args:
        precision, grad_clip, loss_scale: See :class:`StepTemplate`.
        process_group: Group to train over (default: the world).
        scaler_agree: Whether ranks check different gradients (see :class:`StepTemplate`).
    """

    #: The shard level of the training state (``None``: every rank holds all of it).
    shard: str | None = None

    def __init__(self, precision: str, grad_clip: float | None, loss_scale: float | None,
                 process_group: Any = None, scaler_agree: bool = False) -> None:
        super().__init__(precision, grad_clip, loss_scale, scaler_group=process_group,
                         scaler_agree=scaler_agree)
        self.process_group = process_group
        self.model: nn.Module | None = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._device = torch.device("cpu")
        self._buffers: list[torch.Tensor] = []

    @property
    def dp_size(self) -> int:
        return comm.group_size(self.process_group)

    @property
    def dp_rank(self) -> int:
        return comm.group_rank(self.process_group)

    @property
    def dp_group(self) -> Any:
        return self.process_group

    @property
    def train_group(self) -> Any:
        return self.process_group

    def _place(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> nn.Module:
        """Put the model on this rank's device, identical on every rank (rank 0's weights,
        even if the ranks built it with different seeds)."""
        self._refuse_servers()
        self._device = runtime.device() if runtime.is_initialized() else torch.device("cpu")
        self.model = model.to(self._device)
        self._loss_fn = loss_fn
        broadcast_parameters(self.model.state_dict(), root_rank=0, process_group=self.process_group)
        # Buffers (BatchNorm's running statistics) follow rank 0's (:meth:`_sync_buffers`), as
        # under DDP's broadcast_buffers: every rank then evaluates, checks and saves one model.
        self._buffers = list(self.model.buffers()) \
            if torch.distributed.is_initialized() and self.dp_size > 1 else []
        return self.model

    def _sync_buffers(self) -> None:
        """Copy rank 0's buffers to every rank (one unchecked message per dtype: they were
        the same on every rank after :meth:`_place`)."""
        if self._buffers:
            coalesced_broadcast(self._buffers, 0, self.process_group, check=False)

    def _ready(self) -> tuple[nn.Module, Any, Callable[..., torch.Tensor]]:
        if self.model is None or self.optimizer is None or self._loss_fn is None:
            raise ConfigError(f"{type(self).__name__}.setup(...) must run before training.")
        return self.model, self.optimizer, self._loss_fn

    def _forward(self, x: Any, y: Any, zero: bool = True) -> tuple[nn.Module, Any, torch.Tensor,
                                                                   Any]:
        """A training step's start: gradients cleared (unless ``zero`` is False), the loss of
        this rank's batch (autocast as ``precision`` says); ``(model, optimizer, loss, targets
        on device)``."""
        model, opt, loss_fn = self._ready()
        model.train()
        x, y = to_device(x, self._device), to_device(y, self._device)
        if zero:
            opt.zero_grad(set_to_none=True)
        with autocast_context(self.precision, self._device):
            return model, opt, loss_fn(model(x), y), y

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor:
        model, _, _ = self._ready()
        was_training = model.training
        model.eval()
        try:
            with autocast_context(self.precision, self._device):
                return model(to_device(x, self._device))
        finally:
            model.train(was_training)

    def set_lr_factor(self, factor: float) -> None:
        self._ready()
        super().set_lr_factor(factor)

    def state_dict(self) -> dict[str, Any]:
        model, opt, _ = self._ready()
        sd = model.state_dict()
        if self.shard:  # the trainable parameters are in the optimizer state's chunks
            sd = replicated_part(sd, model.named_parameters())
        return self._scaler_state({"model": sd, "optimizer": opt.state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model, opt, _ = self._ready()
        model.load_state_dict(state["model"], strict=not self.shard)
        opt.load_state_dict(state["optimizer"])
        self._load_scaler_state(state)

    @property
    def sharded_checkpoint(self) -> tuple[Any, str] | None:
        opt = self._ready()[1]  # (diloco's wraps the sharded one: its chunks stay in its file)
        return (opt, "") if getattr(opt, "shard_engine", None) is not None else None

    @property
    def eval_in_lockstep(self) -> bool:
        return self.shard == "parameters"

    def comm_stats(self) -> dict[str, float]:
        """Bytes per step before and after compression."""
        _, opt, _ = self._ready()
        return dict(opt.comm_stats())


class AllreduceStrategy(WholeModelStrategy):
    """Data parallel over every rank of the world (or ``process_group``).

    Args:
        compression: Gradient compressor name or object (see :mod:`parlay.compress`).
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and a dynamic
            loss scale, :class:`~parlay.strategies.template.LossScaler`).
        grad_clip: Clip the global gradient norm to this value after averaging (None: off).
        backward_passes_per_step: Each step runs this rank's batch as this many micro-batches
            whose gradients are accumulated before one reduction (less activation memory; the
            same step up to rounding, as the passes are weighted by their sizes).
        bucket_cap_mb: Passed to :class:`DistributedOptimizer`.
        hierarchical: Passed to :class:`DistributedOptimizer`: ``True`` reduces inside each
            host first (``"auto"``: when the ranks span hosts with several ranks each).
        process_group: Group to train over (default: the world).
        loss_scale: Initial fp16 loss scale (default 2**16).
        shard: Shard the training state over the ranks: ``"optimizer"``, ``"gradients"`` or
            ``"parameters"`` (ZeRO 1-3, see :mod:`parlay.dp.shard`); ``None``: replicas.

    Raises:
        ConfigError: Bad precision, clip value, or an unknown option.
    """

    name = "allreduce"

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, backward_passes_per_step: int = 1,
                 bucket_cap_mb: float = 25, process_group: Any = None,
                 loss_scale: float | None = None, hierarchical: bool | str = False,
                 shard: str | None = None, **unknown: Any) -> None:
        reject_unknown(AllreduceStrategy, unknown)
        # The scaler checks gradients averaged over the whole group, identical on every rank:
        # each rank finds the same overflow without a message (sharded: each rank checks its
        # own chunks, so one flag is agreed).
        super().__init__(precision, grad_clip, loss_scale, process_group,
                         scaler_agree=shard is not None)
        self.shard = shard
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.bucket_cap_mb = bucket_cap_mb
        self.loss_scale = loss_scale
        self.hierarchical = hierarchical

    # ------------------------------------------------------------------ life cycle
    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        model = self._place(model, loss_fn)
        # The optimizer was just built from the same arguments on every rank and holds no state
        # yet, so there is nothing of it to broadcast (broadcast_optimizer_state would also
        # send a pickled skeleton, which the training path never unpickles).
        opt = self._new_optimizer(optimizer_cls, model.parameters(), optimizer_args)
        self.optimizer = DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=self.compression,
            backward_passes_per_step=self.backward_passes_per_step,
            average_aggregated_gradients=False,  # train_step weighs each pass by its share
            bucket_cap_mb=self.bucket_cap_mb, process_group=self.process_group,
            hierarchical=self.hierarchical, shard=self.shard, model=model)

    def train_step(self, x: Any, y: Any) -> StepResult:
        k, n = self.backward_passes_per_step, batch_size_of(y)
        parts = [(x, y)] if k == 1 else list(zip(micro_batches(x, n, k), micro_batches(y, n, k)))
        saved = self._saved_compression()
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for xi, yi in parts:
            m = batch_size_of(yi)
            if not m:  # a batch of fewer than k samples: fewer passes (reduced at the step)
                continue
            model, opt, part_loss, _ = self._forward(xi, yi, zero=False)
            # Each pass weighed by its share of the batch: the sum is the batch's gradient, and
            # every backward sees k=1's scale (an fp16 loss scale overflows no sooner).
            part = part_loss * (m / n) if m != n else part_loss
            if self.scaler is not None:
                self.scaler.scale_loss(part).backward()
            else:
                self.guard.mark(part).backward()
            loss += float(part_loss.detach().float().item()) * m / n

        def nonfinite(grads: bool) -> bool:
            named = opt.named_local_gradients()
            return self._skip_nonfinite(loss, named, self.process_group, marked=not self.shard,
                                        grads=grads)

        skipped = self._update(opt.local_gradients, nonfinite, opt.clip_grad_norm_, saved)
        self._sync_buffers()  # after every step
        return StepResult(loss=loss, samples=n, skipped=skipped)

    @property
    def has_replicas(self) -> bool:
        return not self.shard  # sharded ranks each hold their own chunks


register_strategy("allreduce", AllreduceStrategy)
