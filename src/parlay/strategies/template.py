"""The step every mode shares, written once: precision, the fp16 loss scaler, gradient
clipping, optimizer construction, learning-rate factors and the order of a data-parallel update.

Mixed precision follows PyTorch's recipe (``torch.autocast``; fp16 with a dynamic loss scale)
with one distributed twist: gradients are reduced *before* the overflow check, and the check
is agreed by every rank that steps together, so all of them skip the same steps::

    scaler.scale(loss).backward()       # or the pipeline's own scaled backward
    opt.synchronize()                   # average over replicas first
    skipped = scaler.unscale_(grads)    # overflow agreed; grads divided by the scale if not
    clip_grad_norm_(params, max_norm)   # on unscaled, averaged gradients
    with opt.skip_synchronize():
        opt.step()                      # skipped on all ranks or on none
    scaler.update(skipped)

:class:`StepTemplate` is that ladder for the strategies whose ranks step together
(``"allreduce"``, ``"hybrid"``); the ``"ps"`` strategy uses the precision table only.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any
from collections.abc import Callable, Iterable, Sequence

import torch

from parlay import _tree, comm, runtime
from parlay.errors import ConfigError
from parlay.nonfinite import NonFiniteGuard, all_finite
from parlay.strategies.base import Strategy

__all__ = ["PRECISIONS", "check_precision", "autocast_context", "check_grad_clip",
           "build_optimizer", "to_device", "batch_size_of", "micro_batches", "replicated_part",
           "LossScaler", "StepTemplate", "checked_loss"]

#: precision name -> autocast dtype (None: no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}

#: Initial fp16 loss scale (GradScaler's default).
DEFAULT_LOSS_SCALE = 2.0 ** 16


def check_precision(precision: str, mode: str | None = None,
                    supported: Sequence[str] = tuple(PRECISIONS)) -> str:
    """Validate a precision name.

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        mode: The mode asking, when it supports fewer than all (named in the error).
        supported: The names the mode supports.

    Raises:
        ConfigError: Unknown name, or one the mode does not support.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}. "
                          "Hint: 'bf16' needs no loss scaling; 'fp16' uses a dynamic loss scale.")
    if precision not in supported:
        raise ConfigError(f"mode {mode!r} supports precision "
                          f"{' or '.join(repr(p) for p in supported)}, got {precision!r}. "
                          "Hint: bf16 needs no loss scaling.")
    return precision


def autocast_context(precision: str,
                     device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device`` (a no-op context for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_grad_clip(grad_clip: Any) -> float | None:
    """Validate a gradient-norm clip value (``None``: off).

    Raises:
        ConfigError: Not a positive number.
    """
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise ConfigError(f"grad_clip must be a positive number or None, got {grad_clip!r}.")
    return grad_clip


def build_optimizer(optimizer_cls: type[torch.optim.Optimizer], params: Iterable[Any],
                    optimizer_args: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimizer_cls(params, **optimizer_args)``, with the user's arguments in the error.

    Raises:
        ConfigError: The class refused the arguments.
    """
    try:
        return optimizer_cls(params, **optimizer_args)
    except (TypeError, ValueError) as e:  # unknown arguments; values it refuses (lr < 0)
        raise ConfigError(f"could not build {getattr(optimizer_cls, '__name__', optimizer_cls)}"
                          f" with optimizer_args={optimizer_args}: {e}") from e


def to_device(t: Any, device: torch.device) -> Any:
    """``t`` (a tensor, or a tree of them) on ``device``."""
    return _tree.to_device(t, device, non_blocking=True)


def replicated_part(state: dict[str, Any],
                    named_parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """A model's ``state`` without what a sharded optimizer's chunks hold, its trainable
    parameters: what each rank's file keeps in a sharded run (frozen parameters, buffers).
    A tied parameter, listed once by ``named_parameters``, is dropped under each of its names."""
    trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
    chunked = {n for n, _ in trainable}
    tied = {(p.data_ptr(), p.shape, p.dtype) for _, p in trainable if p.numel()}
    return {k: v for k, v in state.items() if k not in chunked and not (
        isinstance(v, torch.Tensor) and (v.data_ptr(), v.shape, v.dtype) in tied)}


def batch_size_of(y: Any) -> int:
    """Samples in a batch of targets: the rows of its first tensor that has any (a tuple or
    dict of targets has one per task: its own length is not the batch's), else its length,
    else 1."""
    rows = [len(t) for t in _tree.tensors_in(y) if t.dim()]
    return rows[0] if rows else len(y) if hasattr(y, "__len__") else 1


def checked_loss(loss_fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` refusing a result that is not a one-number tensor (a type and size check)."""
    def loss(output: Any, target: Any) -> torch.Tensor:
        value = loss_fn(output, target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            raise ConfigError(f"the loss function of build_training_func returned a "
                              f"{type(value).__name__}{shape}; it must return a scalar tensor "
                              "(the batch mean). Hint: e.g. nn.CrossEntropyLoss() with the "
                              "default reduction='mean'.")
        return value
    return loss


def micro_batches(batch: Any, n: int, k: int) -> list[Any]:
    """``batch`` (a tensor or a tree of them, ``n`` samples) cut along dim 0 into ``k`` parts
    of nearly equal size, as ``tensor_split``; so are lists of ``n`` plain values (strings,
    as the default collate gives them). Tensors without ``n`` rows go whole into every part."""
    ends = [0, *itertools.accumulate(len(c) for c in torch.arange(n).tensor_split(k))]

    def plain(x: list[Any]) -> bool:
        return len(x) == n and not any(isinstance(v, (torch.Tensor, list, tuple, dict))
                                       for v in x)

    leaves, rebuild = _tree.flatten(batch, plain)  # once: each part only slices
    cut = [isinstance(x, list) or (isinstance(x, torch.Tensor) and x.dim() > 0 and len(x) == n)
           for x in leaves]
    return [rebuild([x[a:b] if c else x for x, c in zip(leaves, cut)])
            for a, b in itertools.pairwise(ends)]


class LossScaler:
    """The dynamic fp16 loss scale of every mode: GradScaler's policy (multiply the loss by
    ``scale``; halve it on an overflow and skip that step; double it after ``growth_interval``
    clean steps), with the overflow decision shared by every rank that steps together.

    Args:
        init_scale: Initial scale (default 2**16).
        growth_interval: Clean steps before the scale doubles.
        group: Process group whose ranks must agree on each overflow (``None``: the world).
        agree: False where the gradients checked are already identical on every rank (averaged
            over the whole data-parallel group), so every rank decides alike without a message;
            True where ranks hold different gradients (pipeline stages): then one MAX allreduce
            of a flag per step agrees.

    Raises:
        ConfigError: A scale that is not a positive finite number.
    """

    def __init__(self, init_scale: float | None = None, growth_interval: int = 2000,
                 group: Any = None, agree: bool = True) -> None:
        scale = DEFAULT_LOSS_SCALE if init_scale is None else init_scale
        if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
            raise ConfigError(f"loss_scale must be a positive finite number, got {scale!r}. "
                              "Hint: powers of two (the default is 2**16) scale exactly.")
        self.scale, self.growth_interval = float(scale), int(growth_interval)
        self.growth_tracker = 0
        self.group, self.agree = group, agree

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale, to call ``backward()`` on."""
        return loss * self.scale

    def found_inf(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether any rank of the group holds a NaN or an infinity in ``grads``."""
        bad = not all_finite(grads)
        if not self.agree or not torch.distributed.is_initialized():
            return bad
        # The group's device, not the gradients': a NCCL-only group carries CUDA tensors only,
        # also from a rank without gradients.
        flag = torch.full((1,), 1.0 if bad else 0.0, device=comm.group_device(self.group))
        comm.allreduce(flag, "max", group=self.group)
        return bool(flag.item())

    def unscale_(self, grads: Sequence[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place unless a rank overflowed.

        Returns:
            True when the step must be skipped (identically on every rank of the group).
        """
        if self.found_inf(grads):
            return True
        inv = 1.0 / self.scale
        dense = [g for g in grads if not g.is_sparse]
        if dense:  # one fused launch per device and dtype, as GradScaler's unscale_
            torch._foreach_mul_(dense, inv)
        for g in grads:
            if g.is_sparse:
                g.mul_(inv)
        return False

    def update(self, skipped: bool) -> None:
        """Halve the scale after an overflow; double it after ``growth_interval`` clean steps."""
        if skipped:
            self.scale, self.growth_tracker = self.scale * 0.5, 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale, self.growth_tracker = self.scale * 2.0, 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (also ``torch.amp.GradScaler``'s and the older
        ``{"scale", "clean"}`` form, so checkpoints written before keep resuming)."""
        self.scale = float(state["scale"])
        tracker = state.get("growth_tracker", state.get("_growth_tracker", state.get("clean", 0)))
        self.growth_tracker = int(tracker)
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))


class StepTemplate(Strategy):
    """Base of the strategies whose ranks step together (``"allreduce"``, ``"hybrid"``): the
    precision, clip and loss-scale options, the optimizer and its learning-rate factor, and
    the update ladder (average, agree on overflow or non-finite, unscale, clip, step).

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        grad_clip: Global gradient-norm clip after averaging (``None``: off).
        loss_scale: Initial fp16 loss scale (default 2**16).
        scaler_group: Group agreeing on fp16 overflows (see :class:`LossScaler`).
        scaler_agree: Whether the ranks' checked gradients can differ (see :class:`LossScaler`).

    Raises:
        ConfigError: Bad precision, clip value or loss scale.
    """

    def _refuse_servers(self) -> None:
        """A job launched with parameter servers (``parlay run --ps``) needs mode ``"ps"``: here
        the server ranks would train as extra replicas.

        Raises:
            ConfigError: The cluster has parameter servers.
        """
        if runtime.is_initialized() and runtime.cluster().num_ps:
            raise ConfigError(f"mode {self.name!r} does not use parameter servers, but the job "
                              f"was launched with {runtime.cluster().num_ps} (--ps). Hint: "
                              "Trainer(mode='ps'), or launch without --ps.")

    def __init__(self, precision: str, grad_clip: float | None, loss_scale: float | None,
                 scaler_group: Any = None, scaler_agree: bool = True) -> None:
        self.precision = check_precision(precision)
        self.grad_clip = check_grad_clip(grad_clip)
        if loss_scale is not None and precision != "fp16":
            raise ConfigError(f"loss_scale is the fp16 loss scale's start; precision "
                              f"{precision!r} scales no loss. Hint: precision='fp16', or drop "
                              "loss_scale.")
        self.scaler: LossScaler | None = (
            LossScaler(loss_scale, group=scaler_group, agree=scaler_agree)
            if precision == "fp16" else None)
        self.optimizer: Any = None
        self._base_lrs: list[float] = []
        #: The non-finite policy (the Trainer sets it from ``Trainer(nonfinite=...)``); fp16
        #: steps keep the loss scaler's own agreed overflow skipping.
        self.guard: NonFiniteGuard = NonFiniteGuard("raise")

    def _new_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params: Iterable[Any],
                       optimizer_args: dict[str, Any]) -> torch.optim.Optimizer:
        """The user's optimizer; its learning rates are the base of :meth:`set_lr_factor`."""
        opt = build_optimizer(optimizer_cls, params, optimizer_args)
        self._base_lrs = [float(g["lr"]) for g in opt.param_groups]
        return opt

    def set_lr_factor(self, factor: float) -> None:
        for g, base in zip(self.optimizer.param_groups, self._base_lrs):
            g["lr"] = base * factor

    def _saved_compression(self) -> dict[str, Any] | None:
        """The compressor's state before a step that may be skipped (see :meth:`_update`)."""
        return self.guard.snapshot(self.optimizer.compression, skips=self.scaler is not None)

    def _update(self, grads: Callable[[], list[torch.Tensor]],
                nonfinite: Callable[[bool], bool], clip: Callable[[float], Any],
                saved: dict[str, Any] | None) -> bool:
        """After backward: average, decide (agreed) whether to skip, unscale, clip and step.

        Args:
            grads: This rank's gradients once averaged (what the loss scaler checks).
            nonfinite: The non-finite guard's agreed decision (True: skip; it drops the
                gradients), on the losses and gradients, or (its argument False) on the losses
                alone: after an fp16 overflow, a loss that was not finite is bad data, not
                the scale's doing, so the policy decides (raise, or skip keeping the scale).
            clip: Clips the global gradient norm to its argument.
            saved: :meth:`_saved_compression`, put back when the step is skipped (the
                residuals took in its overflow or NaNs, which would poison every later step).

        Returns:
            True when the step was skipped, on every rank alike.
        """
        opt = self.optimizer
        opt.synchronize()  # average over replicas first: every rank then checks the same values
        skipped = self.scaler.unscale_(grads()) if self.scaler is not None else nonfinite(True)
        bad_data = skipped and self.scaler is not None and nonfinite(False)
        if skipped and saved is not None:
            opt.compression.load_state_dict(saved)
        if not skipped:
            if self.grad_clip is not None:
                clip(float(self.grad_clip))
            with opt.skip_synchronize():
                opt.step()
        if self.scaler is not None and not bad_data:
            before = self.scaler.scale
            self.scaler.update(skipped)
            rescale = getattr(opt.compression, "rescale_owed", None)
            if self.scaler.scale != before and rescale is not None:  # owed in scaled units
                rescale(self.scaler.scale / before)
        return skipped

    def _skip_nonfinite(self, loss: float | None, named: list[tuple[str, torch.Tensor]],
                        group: Any = None, marked: bool = False, grads: bool = True) -> bool:
        """Agree over ``group`` whether the step went non-finite (``grads=False``: its loss);
        raise, or drop its gradients (:meth:`_update` puts the compressor's state back)."""
        if not self.guard.must_skip(loss, named, group, marked=marked and grads, grads=grads):
            return False
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _scaler_state(self, sd: dict[str, Any]) -> dict[str, Any]:
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def _load_scaler_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
