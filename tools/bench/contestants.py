"""The contestants :mod:`tools.bench.worker` times: one training step each, built alike.

``compute`` (the same step with communication skipped: the limit), ``ddp`` (PyTorch's
DistributedDataParallel), ``none``/``parlay`` (parlay dense), any compressor spec (``fp16``,
``topk:0.01``, ``auto``...), ``flat``/``hier`` (flat vs hierarchical allreduce) and
``pipe:SCHEDULE`` (every rank one pipeline stage; its step records one step's compute
intervals per rank: the timeline).
"""
from __future__ import annotations

import sys
import time
from typing import Any
from collections.abc import Callable

__all__ = ["contestant"]


class _Recorder:
    """Wraps a pipeline's ``meter.timing`` to keep each compute interval of one step."""

    def __init__(self, meter: Any) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.on = False
        self.t0 = 0.0
        self._inner = meter.timing
        meter.timing = self  # instance attribute: the stages call meter.timing()

    def __call__(self) -> Any:
        import contextlib

        # The caller names the phase: forward_one_chunk, backward_one_chunk, the loss' __call__.
        kind = {"forward_one_chunk": "F", "backward_one_chunk": "B"}.get(
            sys._getframe(1).f_code.co_name, "L")

        @contextlib.contextmanager
        def timed() -> Any:
            start = time.perf_counter()
            with self._inner():
                yield
            if self.on:
                self.events.append((kind, start - self.t0, time.perf_counter() - self.t0))
        return timed()


def _pipe_contestant(schedule: str, widths: list[int], chunks: int) -> tuple[Callable, Any]:
    import torch
    import torch.nn as nn

    from parlay.pipeline import Pipeline
    from tools.bench.harness import mlp

    pipe = Pipeline(mlp(widths), nn.functional.cross_entropy, chunks=chunks, schedule=schedule)
    opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.01))
    rec = _Recorder(pipe.meter)
    last: dict[str, Any] = {}

    def step(x: Any, y: Any) -> None:
        # Keep the first timed step (it starts right after a barrier, so stages line up).
        recording = rec.on
        if recording:
            rec.events, rec.t0 = [], time.perf_counter()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = pipe.step(x, y)
        opt.step()
        rec.on = False
        last.update(wall=time.perf_counter() - t0, compute=out.compute_s,
                    bubble=out.bubble, act_bytes=out.fwd_bytes + out.bwd_bytes)
    step.recorder, step.last, step.pipe = rec, last, pipe  # type: ignore[attr-defined]
    return step, None


def contestant(name: str, widths: list[int], chunks: int = 4) -> tuple[Callable, Any]:
    """``(step(x, y), DistributedOptimizer or None)`` for one contestant."""
    import torch
    import torch.nn as nn

    from parlay.horovod import DistributedOptimizer  # what parlay.DistributedOptimizer is
    from tools.bench.harness import mlp

    if name.startswith("pipe:"):
        return _pipe_contestant(name[5:], widths, chunks)
    model = mlp(widths)
    loss_fn = nn.CrossEntropyLoss()
    opt: Any = None
    if name == "ddp":
        # Same seed on every rank: skip DDP's start-up broadcast (seconds on a slow link).
        model = nn.parallel.DistributedDataParallel(model, init_sync=False)
        base = torch.optim.SGD(model.parameters(), lr=0.01)
    elif name == "compute":
        base = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        comp = None if name in ("none", "parlay", "flat", "hier") else name
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, hierarchical=name == "hier")
        base = opt

    def step(x: Any, y: Any) -> None:
        base.zero_grad()
        loss_fn(model(x), y).backward()
        base.step()
    return step, opt
