"""WrappedOptimizer: a ``torch.optim.Optimizer`` around another whose ``param_groups``,
``state`` and ``defaults`` are the wrapped one's (the base of :class:`~parlay.DistributedOptimizer`
and :class:`~parlay.local.diloco.DiLoCoOptimizer`), so LR schedulers, ``torch.amp.GradScaler``
and optimizer hooks work on the wrapper unchanged."""
from __future__ import annotations

from typing import Any

import torch

from parlay.errors import ConfigError

__all__ = ["WrappedOptimizer"]


def _shared(name: str) -> Any:
    """The wrapped optimizer's ``name`` container, seen (and replaced) through the wrapper,
    so schedulers, GradScaler and user code that edit it see one truth, even after the wrapped
    optimizer's ``load_state_dict`` rebuilt it. Before a wrapped optimizer is attached (inside
    ``torch.optim.Optimizer.__init__``) the wrapper keeps its own."""
    own = f"_own_{name}"

    def get(self: Any) -> Any:
        inner = self.__dict__.get("_opt")
        return getattr(inner, name) if inner is not None else self.__dict__[own]

    def set_(self: Any, value: Any) -> None:
        inner = self.__dict__.get("_opt")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__[own] = value

    return property(get, set_, doc=f"The wrapped optimizer's ``{name}``.")


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer around ``optimizer`` whose ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's, so LR schedulers, ``torch.amp.GradScaler`` and
    hooks work on the wrapper unchanged (:class:`DistributedOptimizer`,
    :class:`~parlay.local.diloco.DiLoCoOptimizer`)."""

    param_groups = _shared("param_groups")
    state = _shared("state")
    defaults = _shared("defaults")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # torch's own __init__ sets up what every optimizer has (the step and state-dict hook
        # registries, the profiled step) in whatever form this torch version keeps them. It
        # needs one parameter group: an empty placeholder, dropped once the wrapped optimizer
        # is attached and param_groups, state and defaults become its containers.
        super().__init__([{"params": []}], {})
        self._opt = optimizer
        for name in ("param_groups", "state", "defaults"):
            self.__dict__.pop(f"_own_{name}", None)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`_state`, with torch's state-dict hooks registered on the wrapper run around
        it."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        sd = self._state()
        for post in self._optimizer_state_dict_post_hooks.values():
            out = post(self, sd)
            sd = sd if out is None else out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`_load_state` of what :meth:`state_dict` returned, with torch's load hooks
        registered on the wrapper run around it."""
        sd = dict(state_dict)
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            out = pre(self, sd)
            sd = sd if out is None else dict(out)
        self._load_state(sd)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _state(self) -> dict[str, Any]:
        """What :meth:`state_dict` returns: the wrapped optimizer's state (extended by
        subclasses)."""
        return self._opt.state_dict()

    def _load_state(self, sd: dict[str, Any]) -> None:
        """Load :meth:`_state`'s output (a copy, the caller's dict left as it was)."""
        self._opt.load_state_dict(sd)

    def _unscale_grads(self, scale: torch.Tensor) -> None:
        """Divide every gradient by ``scale``: what ``torch.amp.GradScaler`` leaves to an
        optimizer that declares ``_step_supports_amp_scaling`` (its ``grad_scale``)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(scale.to(p.grad.device))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported once wrapped (what is reduced or synced is planned at construction).

        Raises:
            ConfigError: Always, after construction.
        """
        if "_opt" not in self.__dict__:  # torch's __init__ registering the placeholder group
            super().add_param_group(param_group)
            return
        raise ConfigError(f"add parameter groups to the optimizer before wrapping it in "
                          f"{type(self).__name__} (what it reduces or syncs is planned at "
                          "construction).")
