"""One pipeline step: micro-batch planning, the scaled loss, and what a step reports."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from parlay import comm
from parlay.errors import ConfigError
from parlay.pipeline.schedule import StageMeter

__all__ = ["StepOutput", "ScaledLoss", "batch_args", "plan_chunks", "p2p_errors"]


@dataclass
class StepOutput:
    """What one :meth:`Pipeline.step` did on this rank.

    Attributes:
        loss: Mean loss of this replica's batch (detached); ``None`` off the last stage.
        output: The model output for the batch on the last stage (when requested), else None.
        chunks: Micro-batches the batch was cut into.
        schedule: Schedule that ran (after any fallback).
        wall_s: Seconds the schedule took on this rank.
        compute_s: Seconds of it spent computing (forward, backward, loss).
        compute_cpu_s: CPU seconds of that compute (less than ``compute_s`` when the OS
            gave this rank's core to another process).
        fwd_bytes / bwd_bytes: Activation / gradient bytes this rank sent to other stages.
        fwd_dense_bytes / bwd_dense_bytes: The same without the wire cast.
        messages: Point-to-point sends this rank issued.
    """

    loss: torch.Tensor | None
    output: Any
    chunks: int
    schedule: str
    wall_s: float
    compute_s: float
    compute_cpu_s: float
    fwd_bytes: int
    bwd_bytes: int
    fwd_dense_bytes: int
    bwd_dense_bytes: int
    messages: int

    @property
    def idle_s(self) -> float:
        """Seconds not computing: blocked on a neighbour (the bubble) or communicating."""
        return max(0.0, self.wall_s - self.compute_s)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step on this rank."""
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


class ScaledLoss:
    """``loss_fn`` times a per-step factor (``1/m``), then the fp16 loss scale in float32 (as
    GradScaler: a float16 loss times the scale overflows), timed as compute (see the module's
    loss contract). ``losses`` keeps each call's loss before the loss scale, to report."""

    def __init__(self, fn: Callable[..., torch.Tensor], meter: StageMeter,
                 autocast_dtype: torch.dtype | None = None, device_type: str = "cpu") -> None:
        self.fn, self.meter, self.factor, self.loss_scale = fn, meter, 1.0, 1.0
        self.losses: list[torch.Tensor] = []
        self.autocast_dtype, self.device_type = autocast_dtype, device_type
        #: A step's target that is not one tensor (a tuple, a dict): torch splits only tensors
        #: into micro-batches, so the schedule gets sample indices and the loss looks them up.
        self.targets: Any = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.targets is not None:
            target = tree_map_only(torch.Tensor, lambda t: t[target.to(t.device)], self.targets)
        amp = (torch.autocast(self.device_type, dtype=self.autocast_dtype)
               if self.autocast_dtype is not None else contextlib.nullcontext())
        with self.meter.timing(), amp:
            loss = self.fn(output, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
                raise ConfigError(f"loss_fn must return a scalar tensor, got "
                                  f"{type(loss).__name__}{shape}. Hint: use reduction='mean'.")
            loss = loss * self.factor if self.factor != 1.0 else loss
            self.losses.append(loss.detach())
            return loss.float() * self.loss_scale if self.loss_scale != 1.0 else loss


def batch_args(x: Any) -> tuple[Any, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise ConfigError(f"a pipeline input must be a tensor or a tuple of tensors, got "
                      f"{type(x).__name__}.")


def plan_chunks(batch: int, chunks: int) -> int:
    """Largest divisor of ``batch`` that is at most ``chunks`` (equal micro-batches)."""
    for m in range(min(chunks, batch), 0, -1):
        if batch % m == 0:
            return m
    return 1


@contextlib.contextmanager
def p2p_errors(op: str, group: Any = None) -> Iterator[None]:
    """Turn transport failures (a lost or silent neighbour) into ``CommError``; errors raised
    by the model or the loss propagate unchanged (torch's stage wraps them in a RuntimeError
    whose message is a dump of its inputs: the model's own error is raised instead).
    ``group``: the pipeline's ranks, of which the one that does not answer is named."""
    import torch.distributed as dist

    try:
        yield
    except RuntimeError as e:
        text = str(e).lower()
        if e.__cause__ is not None and ("failed to run forward" in text
                                        or "failed to run stage backward" in text):
            raise e.__cause__ from None
        if isinstance(e, dist.DistError) or any(
                w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection")):
            with comm.comm_errors(op, group=group):
                raise
        raise
