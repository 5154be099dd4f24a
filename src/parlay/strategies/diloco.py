"""The ``"diloco"`` strategy: local inner steps, pseudo-gradients averaged every few steps.

Each replica trains alone on its batches with the user's optimizer (no collective per step:
the loss scale and the non-finite policy decide per replica); :class:`DiLoCoOptimizer` syncs
each fragment every ``sync_every`` inner steps through the outer optimizer. Evaluation uses
the shared (outer) weights, and training ends with a final sync, so every replica then holds
the same model. The learning rate is not scaled by the replica count (each replica takes its
own steps on its own batch size).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import comm, runtime
from parlay.dp.functions import broadcast_parameters
from parlay.errors import ConfigError
from parlay.local.diloco import DiLoCoOptimizer
from parlay.strategies.base import StepResult, register_strategy, reject_unknown
from parlay.strategies.template import StepTemplate, autocast_context, batch_size_of, to_device

__all__ = ["DiLoCoStrategy"]


class DiLoCoStrategy(StepTemplate):
    """Local-update data parallel (DiLoCo / Streaming DiLoCo) over every rank.

    Args:
        sync_every: Inner steps per round (``H``).
        fragments: Parameter groups synced at staggered steps (``P``).
        overlap: Inner steps an exchange may run before it is merged (``tau``).
        outer_optimizer: Outer optimizer class (default Nesterov SGD, lr 0.7, momentum 0.9).
        outer_optimizer_args: Its arguments.
        compression: Compressor of the pseudo-gradients.
        precision, grad_clip, loss_scale: As for the ``"allreduce"`` mode (clipping and the
            loss scale act on each replica's own gradients).

    Raises:
        ConfigError: Bad or unknown options.
    """

    name = "diloco"
    scales_lr = False

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, sync_every: int = 100, fragments: int = 1,
                 overlap: int = 0, outer_optimizer: Any = torch.optim.SGD,
                 outer_optimizer_args: dict[str, Any] | None = None,
                 loss_scale: float | None = None, **unknown: Any) -> None:
        reject_unknown(DiLoCoStrategy, unknown)
        super().__init__(precision, grad_clip, loss_scale, scaler_agree=False)
        self.compression = compression
        self.options = dict(sync_every=sync_every, fragments=fragments, overlap=overlap,
                            outer_optimizer=outer_optimizer,
                            outer_optimizer_args=outer_optimizer_args)
        self.model: nn.Module | None = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._device = torch.device("cpu")
        self._alone: Any = None  # a group of this rank only: its inner steps decide alone

    @property
    def dp_size(self) -> int:
        return comm.group_size() if dist.is_initialized() else 1

    @property
    def dp_rank(self) -> int:
        return comm.group_rank() if dist.is_initialized() else 0

    @property
    def has_replicas(self) -> bool:
        return False  # replicas part between syncs

    @property
    def supports_snapshots(self) -> bool:
        return True

    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        self._device = runtime.device() if runtime.is_initialized() else torch.device("cpu")
        self.model = model.to(self._device)
        self._loss_fn = loss_fn
        broadcast_parameters(self.model.state_dict(), root_rank=0)  # buffers too
        inner = self._new_optimizer(optimizer_cls, self.model.parameters(), optimizer_args)
        self.optimizer = DiLoCoOptimizer(
            inner, self.model.named_parameters(), compression=self.compression,
            on_nonfinite=self.guard.policy, **self.options)
        if dist.is_initialized():
            me = dist.get_rank()
            self._alone = dist.new_group([me], use_local_synchronization=True)

    def _ready(self) -> tuple[nn.Module, DiLoCoOptimizer, Callable[..., torch.Tensor]]:
        if self.model is None or self.optimizer is None or self._loss_fn is None:
            raise ConfigError("DiLoCoStrategy.setup(...) must run before training.")
        return self.model, self.optimizer, self._loss_fn

    def train_step(self, x: Any, y: Any) -> StepResult:
        model, opt, loss_fn = self._ready()
        model.train()
        x, y = to_device(x, self._device), to_device(y, self._device)
        opt.zero_grad(set_to_none=True)
        with autocast_context(self.precision, self._device):
            loss = loss_fn(model(x), y)
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        if self.scaler is not None:
            skipped = self.scaler.unscale_([g for _, g in named])
        else:
            skipped = self.guard.must_skip(float(loss.detach().float().item()), named,
                                           self._alone)
        if skipped:
            opt.zero_grad(set_to_none=True)
            opt.step_without_update()
        else:
            if self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(self.grad_clip))
            opt.step()
        if self.scaler is not None:
            self.scaler.update(skipped)
        return StepResult(loss=float(loss.detach().float().item()), samples=batch_size_of(y),
                          skipped=skipped)

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor:
        model, opt, _ = self._ready()
        was = model.training
        model.eval()
        try:
            with opt.shared_weights(), autocast_context(self.precision, self._device):
                return model(to_device(x, self._device))
        finally:
            model.train(was)

    def finish(self) -> None:
        if self.optimizer is not None:
            self.optimizer.sync_now()  # every replica ends with the shared weights

    def state_dict(self) -> dict[str, Any]:
        model, opt, _ = self._ready()
        return self._scaler_state({"model": model.state_dict(), "optimizer": opt.state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model, opt, _ = self._ready()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        self._load_scaler_state(state)

    def comm_stats(self) -> dict[str, float]:
        """Pseudo-gradient bytes per inner step, dense and on the wire."""
        _, opt, _ = self._ready()
        return opt.comm_stats()


register_strategy("diloco", DiLoCoStrategy)
