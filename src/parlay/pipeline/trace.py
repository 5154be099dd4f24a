"""Models that are not an ``nn.Sequential``: cut them at named submodules by tracing.

``torch.distributed.pipelining.pipeline(model, mb_args, split_spec={name: SplitPoint.BEGINNING})``
traces the model with ``torch.export`` and splits the graph into one ``GraphModule`` per stage,
whose parameters are the model's own tensors. parlay wraps those pieces as the layers of an
``nn.Sequential`` so everything downstream (partition, stage modules, schedules) is shared with
the Sequential path. parlay's stages exchange values only with their neighbours, so a value that
skips a stage is refused with a hint.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from parlay.errors import ConfigError

__all__ = ["TracedStage", "trace_to_sequential", "as_sequential", "original_name"]


class TracedStage(nn.Module):
    """One piece of a traced model, called with ``nn.Sequential`` semantics (a tuple input is
    spread over the piece's arguments). Its parameters are the original model's, shared."""

    def __init__(self, graph_module: nn.Module) -> None:
        super().__init__()
        self.gm = graph_module

    def forward(self, x: Any) -> Any:
        return self.gm(*x) if isinstance(x, tuple) else self.gm(x)


def trace_to_sequential(model: nn.Module, split_points: Sequence[str], sample: Any
                        ) -> nn.Sequential:
    """Cut any module at named submodules by tracing it (``torch.distributed.pipelining``'s
    ``pipeline(..., split_spec={name: SplitPoint.BEGINNING})``).

    Returns:
        An ``nn.Sequential`` of :class:`TracedStage` children named ``stage0``, ``stage1``...;
        their parameters are the model's own (same tensors, original names under ``gm.``).

    Raises:
        ConfigError: No sample, unknown names, a trace failure, or a value that skips a stage
            (each stage may only consume what the stage before it produced).
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    if sample is None:
        raise ConfigError("splitting a non-Sequential model traces it and needs sample=<example "
                          "micro-batch input>.")
    names = dict(model.named_modules())
    bad = [p for p in split_points if p not in names or p == ""]
    if bad:
        raise ConfigError(f"split_points name submodules that are not in the model: {bad}. "
                          "Hint: use names from model.named_modules(), e.g. 'layers.4'.")
    args = sample if isinstance(sample, tuple) else (sample,)
    try:
        pipe = pipeline(model, mb_args=args,
                        split_spec={p: SplitPoint.BEGINNING for p in split_points})
    except Exception as e:  # noqa: BLE001 - tracing errors come in many types
        raise ConfigError(f"could not trace {type(model).__name__} for pipelining: {e}. Hint: "
                          "express the model as an nn.Sequential instead.") from e
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for i, node in enumerate(calls[1:], start=1):
        prev = calls[i - 1]
        for a in node.all_input_nodes:
            src = a.args[0] if a.op == "call_function" and a.args else a
            if src is not prev:
                raise ConfigError(
                    f"stage {i} of the traced model reads {a.name!r}, which is not produced by "
                    f"stage {i - 1}: values may only flow between neighbouring stages. Hint: "
                    "move the split points so skip connections stay inside one stage.")
    return nn.Sequential(OrderedDict((f"stage{i}", TracedStage(pipe.get_stage_module(i)))
                                     for i in range(pipe.num_stages)))


def as_sequential(model: nn.Module, split_points: list[str] | None, sample: Any
                   ) -> nn.Sequential:
    if isinstance(model, nn.Sequential):
        return model
    if split_points is None:
        raise ConfigError(f"the pipeline splits an nn.Sequential, got {type(model).__name__}. "
                          "Hint: express the model as nn.Sequential(...) of its layers, or "
                          "name the submodules that start each stage with split_points=[...] "
                          "(the model is then traced with torch.distributed.pipelining).")
    return trace_to_sequential(model, split_points, sample)


def original_name(name: str, traced: bool) -> str:
    # A traced stage is Sequential child "stageK" wrapping graph module "gm": strip both.
    return name.split(".", 2)[2] if traced else name
