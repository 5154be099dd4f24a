"""Argument checks of :class:`~parlay.ps.session.DistributedSession`, run on every rank before
anything is built, so a typo fails at once with the fix instead of inside a server."""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn as nn

from parlay._validate import MAX_TIMEOUT_S
from parlay.errors import ConfigError
from parlay.taskspec import TaskSpec

__all__ = ["check_session_args"]


def check_session_args(task_spec: Any, model: Any, optimizer: Any, optimizer_args: Any,
                       max_steps: Any, checkpoint_every: Any, timeout: Any,
                       checkpoint_dir: Any) -> None:
    """Check DistributedSession's arguments (see its docstring for their meaning).

    Raises:
        ConfigError: The first bad argument, with what was expected and a hint.
    """
    if task_spec is not None and not isinstance(task_spec, TaskSpec):
        raise ConfigError(f"task_spec must be a parlay.TaskSpec or None, got "
                          f"{type(task_spec).__name__}. Hint: parlay.TaskSpec.from_env().")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        got = (f"an instance of {type(optimizer).__name__}"
               if isinstance(optimizer, torch.optim.Optimizer) else repr(optimizer))
        raise ConfigError(f"optimizer must be an optimizer class such as torch.optim.SGD, got "
                          f"{got}. Hint: servers build it on their shard: "
                          "optimizer=torch.optim.SGD, optimizer_args={'lr': 0.1}.")
    if optimizer_args is not None and not isinstance(optimizer_args, dict):
        raise ConfigError(f"optimizer_args must be a dict, got "
                          f"{type(optimizer_args).__name__}.")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 0):
        raise ConfigError(f"max_steps must be None or an int >= 0, got {max_steps!r}.")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or isinstance(
            checkpoint_every, bool) or checkpoint_every < 1):
        raise ConfigError(f"checkpoint_every must be None or an int >= 1, "
                          f"got {checkpoint_every!r}.")
    if timeout is not None and not (isinstance(timeout, (int, float))
                                    and 0 < timeout <= MAX_TIMEOUT_S):
        raise ConfigError(f"timeout must be a number of seconds > 0 and at most 1e7, got "
                          f"{timeout!r}.")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise ConfigError(f"checkpoint_dir must be a path or None, got {checkpoint_dir!r}.")
    try:  # catch misspelt optimizer arguments on every rank, without building one
        inspect.signature(optimizer).bind(None, **(optimizer_args or {}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer_args {optimizer_args} do not fit "
                          f"{getattr(optimizer, '__name__', optimizer)}: {e}. Hint: use the "
                          "optimizer's keyword names, e.g. {'lr': 0.1, 'momentum': 0.9}.") \
            from None
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = sorted({str(p.dtype) for p in trainable})
    if len(dtypes) > 1:
        raise ConfigError(f"parameter servers hold one dtype; the model has {dtypes}. "
                          "Hint: convert it, e.g. model.float() or model.double().")
