"""The ``"allreduce"`` strategy: data parallel training with :class:`DistributedOptimizer`.

Every rank holds the whole model; gradients are averaged (optionally compressed) by the
bucketed, overlapped engine of :mod:`parlay.dp.optimizer`. Mixed precision follows PyTorch's
recipe with one distributed twist for fp16: the gradients are reduced *before*
``GradScaler.unscale_`` looks for inf/NaN, so every rank sees the same reduced gradients, finds
the same overflow and skips the same steps::

    scaler.scale(loss).backward()
    opt.synchronize()                 # average over ranks first
    scaler.unscale_(opt)              # identical on every rank from here on
    clip_grad_norm_(params, max_norm)
    with opt.skip_synchronize():
        scaler.step(opt)              # skipped on all ranks or on none
    scaler.update()
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn

from parlay import comm, runtime
from parlay.dp.functions import broadcast_parameters
from parlay.dp.optimizer import DistributedOptimizer
from parlay.errors import ConfigError
from parlay.nonfinite import NonFiniteGuard
from parlay.strategies import StepResult, Strategy, register_strategy

__all__ = ["AllreduceStrategy", "PRECISIONS", "autocast_context"]

#: precision name -> autocast dtype (None: no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device`` (a no-op context for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_precision(precision: str) -> str:
    """Validate a precision name.

    Raises:
        ConfigError: Unknown name.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}. "
                          "Hint: 'bf16' needs no loss scaling; 'fp16' uses a GradScaler.")
    return precision


class AllreduceStrategy(Strategy):
    """Data parallel over every rank of the world (or ``process_group``).

    Args:
        compression: Gradient compressor name or object (see :mod:`parlay.compress`).
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        grad_clip: Clip the global gradient norm to this value after averaging (None: off).
        backward_passes_per_step: Passed to :class:`DistributedOptimizer`.
        bucket_cap_mb: Passed to :class:`DistributedOptimizer`.
        hierarchical: Passed to :class:`DistributedOptimizer`: ``True`` reduces inside each
            host first (``"auto"``: when the ranks span hosts with several ranks each).
        process_group: Group to train over (default: the world).
        loss_scale: Initial fp16 loss scale (``GradScaler(init_scale=...)``; default 2**16).

    Raises:
        ConfigError: Bad precision, clip value, or an unknown option.
    """

    name = "allreduce"

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, backward_passes_per_step: int = 1,
                 bucket_cap_mb: float = 25, process_group: Any = None,
                 loss_scale: float | None = None, hierarchical: bool | str = False,
                 **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"mode 'allreduce' got unknown option(s) {sorted(unknown)}; it "
                              "takes compression, precision, grad_clip, "
                              "backward_passes_per_step, bucket_cap_mb, process_group, "
                              "loss_scale, hierarchical.")
        self.precision = check_precision(precision)
        if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
            raise ConfigError(f"grad_clip must be a positive number or None, got {grad_clip!r}.")
        self.compression = compression
        self.grad_clip = grad_clip
        self.backward_passes_per_step = backward_passes_per_step
        self.bucket_cap_mb = bucket_cap_mb
        self.process_group = process_group
        self.loss_scale = loss_scale
        self.hierarchical = hierarchical
        self.model: nn.Module | None = None
        self.optimizer: DistributedOptimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._base_lrs: list[float] = []
        self._device = torch.device("cpu")
        #: The non-finite policy (the Trainer sets it from ``Trainer(nonfinite=...)``); fp16
        #: steps keep GradScaler's own overflow skipping.
        self.guard = NonFiniteGuard("raise")

    # ------------------------------------------------------------------ topology
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

    # ------------------------------------------------------------------ life cycle
    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        self._device = runtime.device() if runtime.is_initialized() else torch.device("cpu")
        self.model = model.to(self._device)
        self._loss_fn = loss_fn
        try:
            opt = optimizer_cls(self.model.parameters(), **optimizer_args)
        except TypeError as e:
            raise ConfigError(f"could not build {getattr(optimizer_cls, '__name__', optimizer_cls)}"
                              f" with optimizer_args={optimizer_args}: {e}") from e
        # Identical start on every rank, even if the model was built with different seeds.
        # The optimizer was just built from the same arguments on every rank and holds no state
        # yet, so there is nothing of it to broadcast (broadcast_optimizer_state would also
        # send a pickled skeleton, which the training path never unpickles).
        broadcast_parameters(self.model.state_dict(), root_rank=0, process_group=self.process_group)
        self.optimizer = DistributedOptimizer(
            opt, named_parameters=self.model.named_parameters(), compression=self.compression,
            backward_passes_per_step=self.backward_passes_per_step,
            bucket_cap_mb=self.bucket_cap_mb, process_group=self.process_group,
            hierarchical=self.hierarchical)
        self._base_lrs = [float(g["lr"]) for g in opt.param_groups]
        if self.precision == "fp16":
            scale = 2.0 ** 16 if self.loss_scale is None else float(self.loss_scale)
            self.scaler = torch.amp.GradScaler(self._device.type, init_scale=scale)

    def _ready(self) -> tuple[nn.Module, DistributedOptimizer, Callable[..., torch.Tensor]]:
        if self.model is None or self.optimizer is None or self._loss_fn is None:
            raise ConfigError("AllreduceStrategy.setup(...) must run before training.")
        return self.model, self.optimizer, self._loss_fn

    def _to(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.to(self._device, non_blocking=True)
        if isinstance(t, (list, tuple)):
            return type(t)(self._to(v) for v in t)
        if isinstance(t, dict):
            return {k: self._to(v) for k, v in t.items()}
        return t

    def train_step(self, x: Any, y: Any) -> StepResult:
        model, opt, loss_fn = self._ready()
        model.train()
        x, y = self._to(x), self._to(y)
        opt.zero_grad(set_to_none=True)
        with autocast_context(self.precision, self._device):
            loss = loss_fn(model(x), y)
        skipped = False
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            opt.synchronize()
            self.scaler.unscale_(opt)
            self._clip(model)
            before = self.scaler.get_scale()
            with opt.skip_synchronize():
                self.scaler.step(opt)
            self.scaler.update()
            skipped = self.scaler.get_scale() < before
        else:
            saved = self.guard.snapshot(opt.compression)
            self.guard.mark(loss).backward()
            opt.synchronize()
            if self._nonfinite(model, opt, loss, saved):
                skipped = True
            else:
                self._clip(model)
                with opt.skip_synchronize():
                    opt.step()
        n = len(y) if hasattr(y, "__len__") else 1
        return StepResult(loss=float(loss.detach().float().item()), samples=n, skipped=skipped)

    def _nonfinite(self, model: nn.Module, opt: DistributedOptimizer, loss: torch.Tensor,
                   saved: dict[str, Any] | None) -> bool:
        """Agree with every rank whether this step went non-finite; raise or undo it."""
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        if not self.guard.must_skip(float(loss.detach().float().item()), named,
                                    self.process_group, marked=True):
            return False
        if saved is not None:  # the residuals took in this step's NaNs: put them back
            opt.compression.load_state_dict(saved)
        opt.zero_grad(set_to_none=True)
        return True

    def _clip(self, model: nn.Module) -> None:
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(self.grad_clip))

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor:
        model, _, _ = self._ready()
        was_training = model.training
        model.eval()
        try:
            with autocast_context(self.precision, self._device):
                return model(self._to(x))
        finally:
            model.train(was_training)

    def set_lr_factor(self, factor: float) -> None:
        _, opt, _ = self._ready()
        for g, base in zip(opt.param_groups, self._base_lrs):
            g["lr"] = base * factor

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        model, opt, _ = self._ready()
        sd: dict[str, Any] = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model, opt, _ = self._ready()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def comm_stats(self) -> dict[str, float]:
        """Gradient bytes per step before and after compression."""
        _, opt, _ = self._ready()
        return opt.comm_stats()


register_strategy("allreduce", AllreduceStrategy)
