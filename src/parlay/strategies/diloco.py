"""The ``"diloco"`` strategy: local inner steps, pseudo-gradients averaged every few steps.

Each replica trains alone on its batches with the user's optimizer (no collective per step:
the loss scale and the non-finite policy decide per replica); :class:`DiLoCoOptimizer` syncs
each fragment every ``sync_every`` inner steps through the outer optimizer. Evaluation uses
the shared (outer) weights, and training ends with a final sync, so every replica then holds
the same model. The Trainer scales the inner learning rate by the replica count as in data
parallel (with ``sync_every=1``, a plain inner SGD and an outer SGD of lr 1 without momentum
the mode then trains exactly as ``"allreduce"`` does).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import runtime
from parlay.local.diloco import DiLoCoOptimizer
from parlay.strategies.allreduce import WholeModelStrategy
from parlay.strategies.base import StepResult, register_strategy, reject_unknown
from parlay.strategies.template import batch_size_of

__all__ = ["DiLoCoStrategy"]


class DiLoCoStrategy(WholeModelStrategy):
    """Local-update data parallel (DiLoCo / Streaming DiLoCo) over every rank.

    Args:
        sync_every: Inner steps per round (``H``).
        fragments: Parameter groups synced at staggered steps (``P``).
        overlap: Inner steps an exchange may run before it is merged (``tau``).
        outer_optimizer: Outer optimizer class (default Nesterov SGD, lr 0.7, momentum 0.9).
        outer_optimizer_args: Its arguments.
        compression: Compressor of the pseudo-gradients.
        hierarchical: Sum the pseudo-gradients inside each host first (``True``, ``"auto"``).
        precision, grad_clip, loss_scale: As for the ``"allreduce"`` mode (clipping and the
            loss scale act on each replica's own gradients).

    Raises:
        ConfigError: Bad or unknown options.
    """

    name = "diloco"

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, sync_every: int = 100, fragments: int = 1,
                 overlap: int = 0, outer_optimizer: Any = torch.optim.SGD,
                 outer_optimizer_args: dict[str, Any] | None = None,
                 loss_scale: float | None = None, hierarchical: bool | str = False,
                 **unknown: Any) -> None:
        reject_unknown(DiLoCoStrategy, unknown)
        super().__init__(precision, grad_clip, loss_scale)
        self.compression = compression
        self.options = dict(sync_every=sync_every, fragments=fragments, overlap=overlap,
                            outer_optimizer=outer_optimizer,
                            outer_optimizer_args=outer_optimizer_args, hierarchical=hierarchical)
        self._alone: Any = None  # a group of this rank only: its inner steps decide alone

    @property
    def has_replicas(self) -> bool:
        return False  # replicas part between syncs

    @property
    def supports_snapshots(self) -> bool:
        return True

    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        model = self._place(model, loss_fn)
        inner = self._new_optimizer(optimizer_cls, model.parameters(), optimizer_args)
        self.optimizer = DiLoCoOptimizer(
            inner, model.named_parameters(), compression=self.compression,
            on_nonfinite=self.guard.policy, broadcast=False, **self.options)  # _place did
        if dist.is_initialized():
            self._alone = runtime.new_group([dist.get_rank()], use_local_synchronization=True)

    def train_step(self, x: Any, y: Any) -> StepResult:
        model, opt, loss, y = self._forward(x, y)
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

    def _eval_weights(self) -> contextlib.AbstractContextManager[Any]:
        _, opt, _ = self._ready()
        return cast(DiLoCoOptimizer, opt).shared_weights()

    def finish(self) -> None:
        if self.optimizer is not None:
            self.optimizer.sync_now()  # every replica ends with the shared weights


register_strategy("diloco", DiLoCoStrategy)
