"""The ``"diloco"`` strategy: local inner steps, pseudo-gradients averaged every few steps.

Each replica trains alone on its batches with the user's optimizer (no collective per step:
the loss scale and the non-finite policy decide per replica); :class:`DiLoCoOptimizer` syncs
each fragment every ``sync_every`` inner steps through the outer optimizer. Evaluation uses
the shared model (outer weights, buffers as at the last sync), and training ends with a final
sync, so every replica then holds the same model. The Trainer scales the inner learning rate
by the replica count as in data parallel (with ``sync_every=1``, a plain inner SGD and an
outer SGD of lr 1 without momentum the mode then trains exactly as ``"allreduce"`` does).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from parlay import runtime
from parlay.dp.hierarchical import host_groups
from parlay.dp.optimizer import DistributedOptimizer
from parlay.errors import ConfigError
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
        shard: Train data parallel inside each host, with the state sharded over its ranks
            (``"optimizer"``, ``"gradients"``, ``"parameters"``; see :mod:`parlay.dp.shard`):
            every host is then one replica, and each rank syncs only its chunks across hosts.
        precision, grad_clip, loss_scale: As for the ``"allreduce"`` mode (clipping and the
            loss scale act on each replica's own gradients).

    Raises:
        ConfigError: Bad or unknown options.
    """

    name = "diloco"
    skips_together = False  # each replica's inner steps decide alone

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, sync_every: int = 100, fragments: int = 1,
                 overlap: int = 0, outer_optimizer: Any = torch.optim.SGD,
                 outer_optimizer_args: dict[str, Any] | None = None,
                 loss_scale: float | None = None, hierarchical: bool | str = False,
                 shard: str | None = None, **unknown: Any) -> None:
        reject_unknown(DiLoCoStrategy, unknown)
        if shard is not None and hierarchical:
            raise ConfigError("shard= already makes each host one replica (data parallel "
                              "inside it); hierarchical= does not apply. Hint: drop one.")
        super().__init__(precision, grad_clip, loss_scale)
        self.shard = shard
        self.compression = compression
        self.options = dict(sync_every=sync_every, fragments=fragments, overlap=overlap,
                            outer_optimizer=outer_optimizer,
                            outer_optimizer_args=outer_optimizer_args, hierarchical=hierarchical)
        self._alone: Any = None  # a group of this rank only: its inner steps decide alone
        self._shared_buffers: list[torch.Tensor] = []  # the buffers as at the last sync

    @property
    def has_replicas(self) -> bool:
        return False  # replicas part between syncs

    @property
    def supports_snapshots(self) -> bool:
        return True

    @property
    def resumes_apart(self) -> bool:
        return True  # replicas meet only at syncs, evaluations and checkpoints

    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        model = self._place(model, loss_fn)
        inner = self._new_optimizer(optimizer_cls, model.parameters(), optimizer_args)
        replicas = None
        if self.shard is not None:  # data parallel inside each host, local updates across
            self._alone, replicas = host_groups(self.process_group)
            inner = DistributedOptimizer(inner, model.named_parameters(), shard=self.shard,
                                         model=model, process_group=self._alone)
            if self.scaler is not None:  # the host's ranks check different chunks
                self.scaler.group, self.scaler.agree = self._alone, True
        elif dist.is_initialized():
            self._alone = runtime.new_group([dist.get_rank()], use_local_synchronization=True)
        self.optimizer = DiLoCoOptimizer(
            inner, model.named_parameters(), compression=self.compression,
            process_group=replicas, on_nonfinite=self.guard.policy, broadcast=False,
            **self.options)  # _place did
        self._shared_buffers = [b.detach().clone() for b in model.buffers()]

    def train_step(self, x: Any, y: Any) -> StepResult:
        model, opt, loss, y = self._forward(x, y)
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()
        inner = opt.inner if self.shard is not None else None
        if inner is not None:
            inner.synchronize()  # the host's averaged gradients, each rank its chunks
            named = inner.named_local_gradients()
        else:
            named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        value = float(loss.detach().float().item())
        if self.scaler is not None:  # an overflow; a loss not finite is bad data (the policy's)
            skipped = self.scaler.unscale_([g for _, g in named])
            bad_data = skipped and self.guard.must_skip(value, named, self._alone, grads=False)
        else:
            skipped = bad_data = self.guard.must_skip(value, named, self._alone)
        merges = opt.merges
        if skipped:
            opt.zero_grad(set_to_none=True)
            opt.step_without_update()
        else:
            if self.grad_clip is not None and inner is not None:
                inner.clip_grad_norm_(float(self.grad_clip))  # over the host's chunks
            elif self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(self.grad_clip))
            with inner.skip_synchronize() if inner is not None else contextlib.nullcontext():
                opt.step()
        if opt.merges != merges:  # an outer sync completed (at the same step on every rank):
            # buffers follow rank 0's, as the "allreduce" mode's do after every step
            self._synced_buffers()
        if self.scaler is not None and not bad_data:
            self.scaler.update(skipped)
        return StepResult(loss=value, samples=batch_size_of(y), skipped=skipped)

    def _synced_buffers(self) -> None:
        """Buffers follow rank 0's at a sync; evaluation uses these until the next one."""
        self._sync_buffers()
        self._shared_buffers = [b.detach().clone() for b in self._ready()[0].buffers()]

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """An evaluation runs on the shared model: the outer weights and the buffers as at the
        last sync (the same on every replica; each replica's own are back after it)."""
        model, opt, _ = self._ready()
        own = [b.detach().clone() for b in model.buffers()]
        with cast(DiLoCoOptimizer, opt).shared_weights(), torch.no_grad():
            try:
                for b, shared in zip(model.buffers(), self._shared_buffers):
                    b.copy_(shared)
                yield
            finally:
                for b, mine in zip(model.buffers(), own):
                    b.copy_(mine)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "shared_buffers": self._shared_buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "shared_buffers" in state:  # older checkpoints: evaluation uses the resumed ones
            self._shared_buffers = [b.detach().clone() for b in state["shared_buffers"]]

    def finish(self) -> None:
        if self.optimizer is not None:
            self.optimizer.sync_now()  # every replica ends with the shared weights
            self._synced_buffers()


register_strategy("diloco", DiLoCoStrategy)
