"""Stages and schedules on top of ``torch.distributed.pipelining``.

parlay does not reimplement pipeline scheduling: GPipe, 1F1B and interleaved 1F1B are PyTorch's
``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` driving ``PipelineStage``s.
What parlay adds is thin and lives here:

* :class:`StageModule` wraps a stage's layers and casts what crosses a stage boundary to a
  *wire dtype* (bf16/fp16) and back, so activations and their gradients travel compressed
  (the cast's autograd makes the backward send the gradient in the wire dtype too);
* :class:`InstrumentedStage` is a ``PipelineStage`` that counts the bytes of every activation
  and gradient it sends, times its compute, and defers data-parallel gradient hooks to the
  last micro-batch's backward (so a bucketed allreduce overlaps the pipeline's drain);
* a schedule registry (``"gpipe"``, ``"1f1b"``, ``"interleaved"``) with the constraints each
  schedule puts on the number of micro-batches.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from parlay.errors import ConfigError
from parlay.pipeline.partition import kept_state
from parlay.registry import Registry

__all__ = ["wire_dtype", "StageModule", "StageMeter", "InstrumentedStage", "ScheduleSpec",
           "register_schedule", "get_schedule", "available_schedules", "theoretical_bubble",
           "WIRE_DTYPES"]

#: Names accepted for ``activation_dtype``.
WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                                       "fp16": torch.float16, "float16": torch.float16,
                                       "half": torch.float16}


def wire_dtype(value: Any) -> torch.dtype | None:
    """Resolve ``activation_dtype`` (a name, a dtype or ``None``) to a wire dtype or ``None``.

    Raises:
        ConfigError: Not a floating dtype or a known name.
    """
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ConfigError(f"activation_dtype must be a floating dtype, got {value}.")
        return value
    key = str(value).lower().replace("torch.", "")
    if key in ("fp32", "float32", "none"):
        return None
    if key not in WIRE_DTYPES:
        raise ConfigError(f"activation_dtype must be one of {sorted(WIRE_DTYPES)} or a torch "
                          f"dtype, got {value!r}.")
    return WIRE_DTYPES[key]


def _cast(value: Any, dtypes: Any) -> Any:
    """Cast the floating tensors of ``value`` (a tensor or tuple) to ``dtypes`` (one dtype or
    one per tensor); other values pass through."""
    if isinstance(value, torch.Tensor):
        d = dtypes[0] if isinstance(dtypes, (tuple, list)) else dtypes
        return value.to(d) if value.is_floating_point() and d is not None else value
    if isinstance(value, tuple):
        ds = dtypes if isinstance(dtypes, (tuple, list)) else [dtypes] * len(value)
        return tuple(_cast(v, d) for v, d in zip(value, ds))
    return value


def _device_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        t: torch.Tensor | None = value
    elif isinstance(value, tuple):
        t = next((v for v in value if isinstance(v, torch.Tensor)), None)
    else:
        t = None
    return t.device.type if t is not None else "cpu"


def tensor_dtypes(value: Any) -> tuple[torch.dtype | None, ...]:
    if isinstance(value, torch.Tensor):
        return (value.dtype,)
    if isinstance(value, tuple):
        return tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in value)
    return ()


class StageModule(nn.Module):
    """One pipeline stage: its layers, plus the optional boundary cast.

    Args:
        layers: The stage's layers (run with ``nn.Sequential`` semantics: several inputs
            arrive as one tuple argument).
        wire_dtype: dtype of the tensors sent between stages (``None``: no cast).
        first: Whether this is stage 0 (its input comes from the user, uncast).
        last: Whether this is the last stage (its output goes to the loss, uncast).
        autocast_dtype: Run the layers under ``torch.autocast`` with this dtype (mixed
            precision), or ``None``.

    Attributes:
        in_dtypes: dtypes the received tensors are cast back to (set from a sample run; the
            fallback is the stage's parameter dtype).
        out_dtypes: dtypes of the last output before the cast (for "dense bytes" stats).
    """

    def __init__(self, layers: nn.Module, wire_dtype: torch.dtype | None, first: bool,
                 last: bool, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.autocast_dtype = autocast_dtype
        self.layers = layers
        self.wire_dtype = wire_dtype
        self.first, self.last = first, last
        params = [p for p in layers.parameters() if p.is_floating_point()]
        self.in_dtypes: Any = params[0].dtype if params else torch.get_default_dtype()
        self.out_dtypes: tuple[torch.dtype | None, ...] = ()

    def forward(self, *args: Any) -> Any:
        x: Any = args[0] if len(args) == 1 else tuple(args)
        if self.wire_dtype is not None and not self.first:
            x = _cast(x, self.in_dtypes)
        if self.autocast_dtype is not None:
            with torch.autocast(_device_type(x), dtype=self.autocast_dtype):
                out = self.layers(x)
        else:
            out = self.layers(x)
        if self.wire_dtype is not None and not self.last:
            self.out_dtypes = tensor_dtypes(out)
            out = _cast(out, self.wire_dtype)
        if not self.last:  # a view (x.t(), a slice) is sent as one block
            out = tree_map_only(torch.Tensor, torch.Tensor.contiguous, out)
        return out


@dataclass
class StageMeter:
    """Per-step measurements shared by a rank's stages (reset by the pipeline every step).

    Attributes:
        compute_s: Wall seconds inside forward/backward/loss computation.
        compute_cpu_s: CPU seconds of this thread inside them (excludes time the OS gave the
            core to another process, which wall time includes on an oversubscribed host).
        fwd_bytes / bwd_bytes: Bytes of activations / gradients this rank sent.
        fwd_dense_bytes / bwd_dense_bytes: The same tensors' bytes before the wire cast.
        messages: Point-to-point sends issued.
        defer_grad_sync: When set, a context manager factory under which backward passes that
            are not a stage's last in the step run (``DistributedOptimizer.no_sync``).
    """

    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    fwd_dense_bytes: int = 0
    bwd_dense_bytes: int = 0
    messages: int = 0
    defer_grad_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = field(
        default=None, repr=False)

    def reset(self) -> None:
        self.compute_s = self.compute_cpu_s = 0.0
        self.fwd_bytes = self.bwd_bytes = self.fwd_dense_bytes = self.bwd_dense_bytes = 0
        self.messages = 0

    @contextlib.contextmanager
    def timing(self) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - t0
            self.compute_cpu_s += time.thread_time() - c0


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    size = t.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size()
    return t.numel() * size


class InstrumentedStage(PipelineStage):
    """A ``PipelineStage`` that measures itself; scheduling is PyTorch's, unchanged.

    Args:
        submodule: The :class:`StageModule` of this stage.
        stage_index: Global stage index.
        num_stages: Number of stages in the pipeline.
        device: Compute device.
        group: The pipeline process group (stage ``i`` lives on group rank ``i % size``).
        meter: Where measurements go.
    """

    def __init__(self, submodule: StageModule, stage_index: int, num_stages: int,
                 device: torch.device, group: Any, meter: StageMeter) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.meter = meter

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.meter.timing():
            return super().forward_one_chunk(*args, **kwargs)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # torch runs the stage on placeholder inputs to learn its shapes, in training mode:
        # that forward must not move BatchNorm's statistics (or draw dropout masks)
        with kept_state(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        # torch builds the shape-inference inputs from metadata with torch.empty: integer ones
        # (token ids) would hold garbage indices. Zeros are valid for any lookup.
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                t.zero_()
        return t

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        # Data-parallel hooks fire once per step: during the last micro-batch's backward, when
        # each parameter's gradient is complete (torchgpipe/DDP "no_sync" for all but the last).
        gate = self.meter.defer_grad_sync
        ctx = gate() if gate is not None and not last_backward else contextlib.nullcontext()
        with self.meter.timing(), ctx:
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        dense = getattr(self.submod, "out_dtypes", ())
        for k, op in enumerate(ops):
            self.meter.fwd_bytes += _nbytes(op.tensor)
            d = dense[k] if k < len(dense) else None
            self.meter.fwd_dense_bytes += _nbytes(op.tensor, d)
        self.meter.messages += len(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        dense = getattr(self.submod, "in_dtypes", None)
        if isinstance(dense, (tuple, list)):  # gradients go back for the float inputs only
            dense = [d for d in dense if d is not None and d.is_floating_point]
        wire = getattr(self.submod, "wire_dtype", None)
        for k, op in enumerate(ops):
            self.meter.bwd_bytes += _nbytes(op.tensor)
            d = dense[k] if isinstance(dense, (tuple, list)) else dense
            self.meter.bwd_dense_bytes += _nbytes(op.tensor, d if wire is not None else None)
        self.meter.messages += len(ops)
        return ops


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule.

    Attributes:
        name: Registry name.
        cls: The ``torch.distributed.pipelining`` schedule class used for training.
        multi_stage: Whether each rank holds several (virtual) stages.
        accepts: ``accepts(chunks, pp)``: whether ``chunks`` micro-batches are valid.
        requirement: Human-readable form of ``accepts`` for error messages.
        fallback: Schedule used for a batch whose micro-batch count ``accepts`` rejects (same
            mathematics, different order), or ``None``.
        eval_cls: Forward-only schedule class for evaluation.
    """

    name: str
    cls: type
    multi_stage: bool
    accepts: Callable[[int, int], bool]
    requirement: str
    fallback: str | None
    eval_cls: type


# Names are matched case-insensitively and without dashes or underscores ("1F1B", "looped-bfs").
_REGISTRY: Registry[ScheduleSpec] = Registry(
    "pipeline schedule", valid="valid schedules",
    normalize=lambda n: n.lower().replace("-", "").replace("_", ""))


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> None:
    """Register a schedule under ``spec.name`` (a taken name is refused unless ``replace``)."""
    _REGISTRY.register(spec.name, spec, replace=replace)


def available_schedules() -> list[str]:
    """Registered schedule names."""
    return _REGISTRY.available()


def get_schedule(name: str) -> ScheduleSpec:
    """The spec of schedule ``name`` (case-insensitive).

    Raises:
        ConfigError: Unknown name; the message lists the valid ones.
    """
    return _REGISTRY.get(name)


def _interleaved_ok(m: int, pp: int) -> bool:
    rounds = max(1, m // pp)
    return m % rounds == 0


register_schedule(ScheduleSpec("gpipe", ScheduleGPipe, False, lambda m, pp: m >= 1,
                               "chunks >= 1", None, ScheduleGPipe))
# 1F1B's warm-up holds pp micro-batches in flight; PyTorch requires chunks >= stages.
register_schedule(ScheduleSpec("1f1b", Schedule1F1B, False, lambda m, pp: m >= pp,
                               "chunks >= stages", "gpipe", ScheduleGPipe))
# Narayanan et al. 2021, as generalised by PyTorch's flex-PP: m % max(1, m // pp) == 0.
register_schedule(ScheduleSpec("interleaved", ScheduleInterleaved1F1B, True, _interleaved_ok,
                               "chunks % max(1, chunks // stages) == 0", "loopedbfs",
                               ScheduleLoopedBFS))
# Breadth-first looped GPipe over virtual stages: the fallback of "interleaved".
register_schedule(ScheduleSpec("loopedbfs", ScheduleLoopedBFS, True, lambda m, pp: m >= 1,
                               "chunks >= 1", None, ScheduleLoopedBFS))


def theoretical_bubble(stages: int, chunks: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a synchronous pipeline with equal stages: ``(S-1)/(v*m + S-1)``.

    GPipe and 1F1B share it (Huang et al. 2019; Narayanan et al. 2019); interleaving ``v``
    virtual stages per rank divides the bubble by ``v`` (Narayanan et al. 2021) when ``m`` is a
    multiple of ``S``. With fewer micro-batches than stages interleaving cannot overlap
    anything (one micro-batch visits the ``v*S`` virtual stages one after another), which is
    the non-interleaved ``(S-1)/(m+S-1)`` for ``m = 1``; other ``m`` not a multiple of ``S``
    have no closed form here.

    Raises:
        ConfigError: ``v > 1`` with ``m`` neither 1 nor a multiple of ``S``.
    """
    s, m, v = stages, chunks, virtual_stages
    if v > 1 and m % s:
        if m == 1:
            return (s - 1) / s
        raise ConfigError(f"the interleaved bubble formula needs chunks % stages == 0, got "
                          f"chunks={m}, stages={s}.")
    return (s - 1) / (v * m + s - 1)
