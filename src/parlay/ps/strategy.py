"""The ``"ps"`` strategy: the Trainer's parameter-server mode, a thin shell over
:class:`~parlay.ps.session.DistributedSession`.

Parameter-server ranks consume no data: :meth:`serve_until_done` serves until every worker
finished, closes the session and returns True. Workers form the data-parallel replicas
(``dp_size`` = number of workers, ``dp_rank`` = worker index).
"""
from __future__ import annotations

import os

from typing import Any, Callable

import torch
import torch.nn as nn

from parlay import runtime
from parlay.errors import ConfigError
from parlay.nonfinite import NonFiniteGuard
from parlay.ps.plan import DEFAULT_SPLIT_BYTES
from parlay.ps.session import DistributedSession
from parlay.strategies import StepResult, Strategy, register_strategy

__all__ = ["ParameterServerStrategy"]


class ParameterServerStrategy(Strategy):
    """Train with parameter servers (ranks ``0..K-1`` under ``parlay run --ps K``).

    Args:
        compression: Compressor of worker -> server pushes (name or object).
        precision: ``"fp32"`` or ``"bf16"`` (autocast on workers). ``"fp16"`` is refused: loss
            scaling would need every server to agree on skipped steps.
        grad_clip: Must be ``None``: a global gradient norm is not available to any one rank
            when gradients are averaged on servers holding different shards.
        consistency: ``"sync"``, ``"async"`` or ``"stale:s"``.
        checkpoint_dir: Where servers save and resume their shards (see DistributedSession).
        placement, split_bytes, timeout, checkpoint_every, max_steps: As for
            :class:`DistributedSession`.

    Raises:
        ConfigError: An option it cannot honour, or an unknown option.
    """

    name = "ps"

    def __init__(self, compression: Any = None, precision: str = "fp32",
                 grad_clip: float | None = None, consistency: str = "sync",
                 checkpoint_dir: str | None = None, placement: str = "balanced",
                 split_bytes: int | None = DEFAULT_SPLIT_BYTES, timeout: float | None = None,
                 checkpoint_every: int | None = 100, max_steps: int | None = None,
                 **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"mode 'ps' got unknown option(s) {sorted(unknown)}; it takes "
                              "compression, precision, consistency, checkpoint_dir, placement, "
                              "split_bytes, timeout, checkpoint_every, max_steps.")
        if precision not in ("fp32", "bf16"):
            raise ConfigError(f"mode 'ps' supports precision 'fp32' or 'bf16', got "
                              f"{precision!r}. Hint: bf16 needs no loss scaling.")
        if grad_clip is not None:
            raise ConfigError("mode 'ps' cannot clip the global gradient norm (gradients are "
                              "averaged on the servers, each holding a different shard). Hint: "
                              "use mode='allreduce' for grad_clip, or clip in the loss.")
        self.precision = precision
        self.options = dict(consistency=consistency, compression=compression,
                            checkpoint_dir=checkpoint_dir, max_steps=max_steps,
                            placement=placement, split_bytes=split_bytes, timeout=timeout,
                            checkpoint_every=checkpoint_every)
        #: Non-finite policy (set by ``Trainer(nonfinite=...)``): workers check before pushing.
        self.guard = NonFiniteGuard("raise")
        self.session: DistributedSession | None = None
        self.model: nn.Module | None = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ topology
    def _cluster(self) -> Any:
        return runtime.cluster()

    @property
    def dp_size(self) -> int:
        c = self._cluster()
        return c.world_size - c.num_ps

    @property
    def dp_rank(self) -> int:
        c = self._cluster()
        return max(0, c.rank - c.num_ps)

    @property
    def consumes_data(self) -> bool:
        c = self._cluster()
        return c.rank >= c.num_ps

    @property
    def reports_loss(self) -> bool:
        return self.consumes_data

    @property
    def dp_group(self) -> Any:
        return self.session.dp_group if self.session is not None else None

    @property
    def train_group(self) -> Any:
        return self.dp_group

    # ------------------------------------------------------------------ life cycle
    def use_checkpoint_dir(self, path: str) -> None:
        """Servers save and resume their shards under ``<path>/ps`` unless the strategy was
        given its own ``checkpoint_dir``."""
        if self.options.get("checkpoint_dir") is None:
            self.options["checkpoint_dir"] = os.path.join(path, "ps")

    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        if self.consumes_data:
            self._device = runtime.device()
            model = model.to(self._device)
        self.model, self._loss_fn = model, loss_fn
        self.session = DistributedSession(None, model, optimizer_cls, optimizer_args,
                                          **self.options)
        if self.guard.policy != "raise":
            raise ConfigError("mode 'ps' supports nonfinite='raise' only: workers do not step "
                              "together, so no step can be skipped on every worker alike. "
                              "Hint: use mode='allreduce' for nonfinite='skip'.")
        self.session.start()
        if self.session.worker is not None:  # raise before a NaN reaches the servers
            self.session.worker.before_push = self.guard.check_local
        if self.session.worker is not None and self.precision == "bf16":
            from parlay.dp.strategy import autocast_context

            dev = self._device
            self.session.worker.forward_context = lambda: autocast_context("bf16", dev)

    def _ready(self) -> DistributedSession:
        if self.session is None:
            raise ConfigError("ParameterServerStrategy.setup(...) must run before training.")
        return self.session

    def serve_until_done(self) -> bool:
        s = self._ready()
        if s.is_worker:
            return False
        s.serve()
        s.close()
        return True

    def train_step(self, x: Any, y: Any) -> StepResult:
        s = self._ready()
        assert self._loss_fn is not None
        loss = s.train_step((x, y), self._loss_fn)
        n = len(y) if hasattr(y, "__len__") else 1
        return StepResult(loss=loss, samples=n)

    @torch.no_grad()
    def eval_forward(self, x: Any) -> torch.Tensor | None:
        s = self._ready()
        if not s.is_worker or self.model is None:
            return None
        was = self.model.training
        self.model.eval()
        try:
            x = x.to(self._device) if isinstance(x, torch.Tensor) else x
            return self._forward(x)
        finally:
            self.model.train(was)

    def _forward(self, x: Any) -> torch.Tensor:
        assert self.model is not None and self.session is not None and self.session.worker
        with self.session.worker.forward_context():
            return self.model(x)

    def set_lr_factor(self, factor: float) -> None:
        self._ready().set_lr_factor(factor)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Worker-side state only (the servers checkpoint their shards in ``checkpoint_dir``)."""
        s = self._ready()
        if not s.is_worker or self.model is None:
            return {}
        return {"model": self.model.state_dict(), "compressor": s.compressor.state_dict(),
                "global_step": s.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore worker-side state (compressor residuals). Parameters come from the servers
        on the next pull; to resume them too, give the strategy a ``checkpoint_dir``."""
        s = self._ready()
        if s.is_worker and "compressor" in state:
            s.compressor.load_state_dict(state["compressor"])

    def finish(self) -> None:
        if self.session is not None:
            self.session.close()


register_strategy("ps", ParameterServerStrategy)
