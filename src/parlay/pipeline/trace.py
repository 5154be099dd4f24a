"""Models that are not an ``nn.Sequential``: cut them at named submodules by tracing.

``torch.distributed.pipelining.pipeline(model, mb_args, split_spec={name: SplitPoint.BEGINNING})``
traces the model with ``torch.export`` and splits the graph into one ``GraphModule`` per stage,
whose parameters are the model's own tensors. parlay wraps those pieces as the layers of an
``nn.Sequential`` so everything downstream (partition, stage modules, schedules) is shared with
the Sequential path. parlay's stages exchange values only with their neighbours, so a value that
skips a stage is refused with a hint.

A trace bakes in the training mode (BatchNorm's batch statistics, dropout), so the model is
traced twice: in training mode for training and in eval mode for evaluation; a piece in eval mode
runs its eval graph on the training graph's own parameters and buffers (same names, same tensors).
A trace also bakes in shapes the model computes from its input (``x.view(x.size(0), -1)``
freezes the sample's row count; ``x.flatten(1)`` does not).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call

from parlay.errors import ConfigError

__all__ = ["TracedStage", "trace_to_sequential", "as_sequential", "original_name"]


class TracedStage(nn.Module):
    """One piece of a traced model, called with ``nn.Sequential`` semantics (a tuple input is
    spread over the piece's arguments: the graph takes the flattened tensors of the model's
    input, or of the previous piece's output). Its parameters are the original model's, shared.

    In eval mode (``.eval()``) it runs ``eval_module``, the piece traced in eval mode, on
    ``gm``'s parameters and buffers by name (so moves and loads of ``gm`` reach it too)."""

    def __init__(self, graph_module: nn.Module, eval_module: nn.Module | None = None) -> None:
        super().__init__()
        self.gm = graph_module
        self._eval = (eval_module,)  # a tuple: not a submodule, so not in state_dict or .to()

    def forward(self, x: Any) -> Any:
        args = x if isinstance(x, tuple) else (x,)
        ev = self._eval[0]
        if self.training or ev is None:
            return self.gm(*args)
        own = dict(_tensors(self.gm))
        return functional_call(ev, {n: own[n] for n, _ in _tensors(ev) if n in own}, args)


def _tensors(m: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return chain(m.named_parameters(remove_duplicate=False),
                 m.named_buffers(remove_duplicate=False))


@contextmanager
def _train_mode(model: nn.Module, mode: bool) -> Iterator[None]:
    """``model`` in ``mode`` inside, every submodule's own mode restored after."""
    saved = [(m, m.training) for m in model.modules()]
    model.train(mode)
    try:
        yield
    finally:
        for m, t in saved:
            m.training = t


def _pipeline(model: nn.Module, args: tuple[Any, ...], split_points: Sequence[str]) -> Any:
    """``pipeline()``, with the forwards it patches on the split modules restored after."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    mods = [model.get_submodule(p) for p in split_points]
    keys = ("forward", "_orig_forward")
    saved: list[dict[str, Any]] = [{k: m.__dict__[k] for k in keys if k in m.__dict__}
                                   for m in mods]
    try:
        return pipeline(model, mb_args=args,
                        split_spec={p: SplitPoint.BEGINNING for p in split_points})
    finally:
        for m, d in zip(mods, saved):
            for k in keys:
                m.__dict__.pop(k, None)
            m.__dict__.update(d)


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
    if sample is None:
        raise ConfigError("splitting a non-Sequential model traces it and needs sample=<example "
                          "micro-batch input>.")
    names = dict(model.named_modules())
    bad = [p for p in split_points if p not in names or p == ""]
    if bad:
        raise ConfigError(f"split_points name submodules that are not in the model: {bad}. "
                          "Hint: use names from model.named_modules(), e.g. 'layers.4'.")
    try:  # model(x), as in every mode: a tuple input is one argument
        with _train_mode(model, True):
            pipe = _pipeline(model, (sample,), split_points)
        with _train_mode(model, False):
            evals = _pipeline(model, (sample,), split_points)
    except Exception as e:  # noqa: BLE001 - tracing errors come in many types
        root: BaseException = e
        while root.__cause__ is not None:
            root = root.__cause__
        raise ConfigError(
            f"could not trace {type(model).__name__} for pipelining: {type(root).__name__}: "
            f"{root}. Hint: the model is called as model(sample), as in every mode (a tuple "
            "input is one argument: forward(self, inputs), not forward(self, a, b)); fix that "
            "error or express the model as an nn.Sequential.") from e
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
    return nn.Sequential(OrderedDict(  # in the model's mode, as a Sequential's layers stay
        (f"stage{i}", TracedStage(pipe.get_stage_module(i), evals.get_stage_module(i))
         .train(model.training)) for i in range(pipe.num_stages)))


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
