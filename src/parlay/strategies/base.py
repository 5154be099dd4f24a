"""Strategy protocol, :class:`StepResult` and the mode registry: the one place the modes meet.

The :class:`~parlay.trainer.Trainer` knows nothing about allreduce, parameter servers or
pipelines; it asks the registry for ``mode`` and drives the returned :class:`Strategy`.
A new mode is one class plus one :func:`register_strategy` call. The built-in modes live next
to this module (``allreduce.py``, ``ps.py``, ``hybrid.py``) and register when first asked for.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple
from collections.abc import Callable

import torch
import torch.nn as nn

from parlay import comm
from parlay.errors import ConfigError
from parlay.nonfinite import NonFiniteGuard
from parlay.registry import Registry

__all__ = ["Strategy", "StepResult", "EpochEnd", "register_strategy", "get_strategy",
           "available_strategies", "reject_unknown"]


@dataclass
class StepResult:
    """What one training step reports to the trainer.

    Attributes:
        loss: Mean loss of this rank's batch, or ``None`` on ranks that do not compute it
            (parameter servers, non-last pipeline stages).
        samples: Samples this rank consumed (0 where it consumed none).
        skipped: True when the optimizer step was skipped (fp16 overflow); agrees on all ranks.
    """

    loss: float | None
    samples: int
    skipped: bool = False


class EpochEnd(NamedTuple):
    """What the replicas agreed at the end of an epoch (:meth:`Strategy.end_epoch`).

    Attributes:
        samples: Samples trained in the epoch, counted over every replica that finished it.
        shards: Replicas the next epoch's data is sharded over.
        shard: This rank's shard among them.
    """

    samples: int
    shards: int
    shard: int


class Strategy:
    """How a model is trained across processes. Subclasses implement every method.

    Life cycle, driven by the Trainer on every rank::

        s = get_strategy(mode, **options)
        s.setup(model, loss_fn, optimizer_cls, optimizer_args)   # after parlay.init()
        while ...:
            if s.serve_until_done(): break      # True on ranks that only serve (PS ranks)
            r = s.train_step(x, y)              # x, y: this data-parallel replica's batch
        s.state_dict() / s.load_state_dict(sd) # checkpoints

    The Trainer builds it as ``get_strategy(mode, compression=..., precision=...,
    grad_clip=..., **strategy_options)``: a factory accepts those three keywords (raising
    ``ConfigError`` for values it cannot honour) plus its own options. ``set_lr_factor`` is
    called before every ``train_step``; ``eval_forward`` runs the model in eval mode without
    gradients. The Trainer reduces metrics over ``dp_group`` only on ranks where
    ``reports_loss`` is True.

    Attributes:
        name: Registry name ("allreduce", "ps", "hybrid").
    """

    name: ClassVar[str] = "base"
    #: Non-finite policy, set by ``Trainer(nonfinite=...)``; ``None``: this strategy does not
    #: check its steps for NaN/inf.
    guard: NonFiniteGuard | None = None
    #: True for a strategy whose state also lives on serving ranks: it opens its snapshot
    #: store and agrees the resume step before the Trainer exists (:attr:`snapshot_store`,
    #: :attr:`agreed_snapshot_step`) and is told ``snapshot_every`` on every rank
    #: (:meth:`configure_snapshots`).
    agrees_snapshots_early: bool = False
    #: Whether the ranks skip a non-finite step together (False: each replica decides alone,
    #: as diloco's inner steps do).
    skips_together: bool = True
    #: Digest of the Trainer's settings, stored in each snapshot and checked on resume (set
    #: by the Trainer for strategies that agree snapshots early).
    snapshot_identity: str = ""

    # --- data sharding: which replica am I, among how many that read distinct data?
    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (batches are sharded over these)."""
        raise NotImplementedError

    @property
    def dp_rank(self) -> int:
        """This rank's replica index in ``[0, dp_size)``; ranks of one replica read the same
        data (e.g. every pipeline stage of a replica)."""
        raise NotImplementedError

    @property
    def update_replicas(self) -> int:
        """Replicas whose batches one update averages: the Trainer's linear learning-rate
        scaling factor (1 where each update applies one replica's gradient alone)."""
        return self.dp_size

    @property
    def consumes_data(self) -> bool:
        """False on ranks that never need batches (parameter servers)."""
        return True

    @property
    def dp_group(self) -> Any:
        """Process group of the ranks that compute losses, for reducing metrics (None: world)."""
        return None

    @property
    def train_group(self) -> Any:
        """Process group of every rank that runs the training loop, i.e. all ranks except
        serving-only ones (None: world). Checkpoint saves/resumes agree over it, so every
        member must reach the same checkpoint points."""
        return None

    @property
    def resumes_apart(self) -> bool:
        """True where ranks meet only at collectives (no collective every step): each may
        resume from its own newest snapshot taken between the same two collectives."""
        return False

    def evaluating(self) -> contextlib.AbstractContextManager[Any]:
        """Held around a whole evaluation (every rank of ``train_group`` enters it)."""
        return contextlib.nullcontext()

    def reached_end(self) -> bool:
        """The mode's own end of training (ps: ``max_steps`` updates applied), besides the
        Trainer's ``max_iteration`` and ``num_epochs``."""
        return False

    def abort(self, exc: BaseException) -> None:
        """A training step raised ``exc`` on this rank: tell the ranks that wait on it
        (parameter servers) at once. Default: nothing (collectives fail on their own)."""

    @property
    def metrics_group(self) -> Any:
        """Where ranks that do not compute the loss (a pipeline's first stages) get the
        metrics from the one that does; ``None``: every rank computes its own."""
        return None

    @property
    def sharded_checkpoint(self) -> tuple[Any, str] | None:
        """The ``shard=`` optimizer whose chunks checkpoints keep in DCP form, and the folder
        (inside the step's) its ``dp_group`` writes them to; ``None`` where nothing is sharded."""
        return None

    @property
    def eval_in_lockstep(self) -> bool:
        """True where every forward is a collective over ``dp_group`` (parameters gathered
        as modules run): every rank must then evaluate as many batches as the others."""
        return False

    @property
    def reports_loss(self) -> bool:
        """True on ranks whose ``train_step`` returns a loss (all, or the last stage)."""
        return True

    def setup(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
              optimizer_cls: type[torch.optim.Optimizer], optimizer_args: dict[str, Any]) -> None:
        """Place the model, build the (distributed) optimizer."""
        raise NotImplementedError

    def serve_until_done(self) -> bool:
        """On serving-only ranks, serve until training ends and return True; else False."""
        return False

    def train_step(self, x: Any, y: Any) -> StepResult:
        """One optimizer step on this replica's batch."""
        raise NotImplementedError

    def eval_forward(self, x: Any) -> torch.Tensor | None:
        """Model output for evaluation (``None`` on ranks that do not produce outputs)."""
        raise NotImplementedError

    def set_lr_factor(self, factor: float) -> None:
        """Multiply every param group's base learning rate by ``factor`` (warm-up/scaling)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Everything stateful this strategy owns on this rank."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        raise NotImplementedError

    def end_epoch(self, epoch: int, samples: int) -> EpochEnd | None:
        """Called on the training ranks at the end of ``epoch``, of which this rank trained
        ``samples``. ``None`` (default): every replica trained as many and the data stays
        sharded as it is; else the count over the replicas and the next epoch's sharding."""
        return None

    def finish(self) -> None:
        """Called once when training ends (e.g. tell parameter servers to stop)."""

    def use_checkpoint_dir(self, path: str) -> None:
        """The Trainer's ``checkpoint_dir``, given before :meth:`setup`, for state the Trainer's
        own checkpoints cannot hold (e.g. parameter-server shards, saved on the servers)."""

    # --- checkpoints and snapshots: what the Trainer's persistence asks (defaults suit most)
    @property
    def supports_snapshots(self) -> bool:
        """Whether the Trainer keeps in-memory snapshots of this strategy's state (default:
        the built-in modes whose whole training state lives in the Trainer's state dict on the
        training ranks)."""
        return self.name in ("allreduce", "hybrid")

    @property
    def has_replicas(self) -> bool:
        """Whether the ranks of :attr:`dp_group` hold identical parameters and optimizer state
        in ``optimizer`` (default: the built-in data-parallel and hybrid modes), which the
        Trainer's replica check compares."""
        return self.name in ("allreduce", "hybrid")

    @property
    def pp(self) -> int:
        """Pipeline stages per replica (1: no pipeline)."""
        return 1

    @property
    def checkpoint_group(self) -> Any:
        """Process group of the ranks that agree on each checkpoint save (default:
        :attr:`train_group`; the resume always agrees over :attr:`train_group`)."""
        return self.train_group

    @property
    def layout_world_size(self) -> int:
        """Ranks a checkpoint's layout counts (default: the size of :attr:`train_group`)."""
        return comm.group_size(self.train_group)

    def snapshot_state_dict(self) -> dict[str, Any]:
        """The state an in-memory snapshot holds (default: :meth:`state_dict`)."""
        return self.state_dict()

    @property
    def snapshot_store(self) -> Any:
        """With :attr:`agrees_snapshots_early`: the store opened before the resume step was
        agreed (``None``: off here)."""
        return None

    @property
    def agreed_snapshot_step(self) -> int | None:
        """With :attr:`agrees_snapshots_early`: the snapshot step every rank agreed to resume
        (``None``: they resumed from disk or afresh)."""
        return None

    @property
    def newest_checkpoint(self) -> int | None:
        """The newest disk checkpoint step the Trainer may resume (``None``: any), where
        ranks outside the Trainer (parameter servers) agreed on one."""
        return None

    def configure_snapshots(self, every: int) -> None:
        """With :attr:`agrees_snapshots_early`: the Trainer's ``snapshot_every``, on every
        rank before training."""


def reject_unknown(cls: type[Strategy], unknown: dict[str, Any]) -> None:
    """Raise ConfigError for options ``cls`` does not take, listing those it does (read from
    its constructor, so the list never goes stale).

    Raises:
        ConfigError: ``unknown`` is not empty.
    """
    if unknown:
        takes = [n for n, p in inspect.signature(cls.__init__).parameters.items()
                 if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
        raise ConfigError(f"mode {cls.name!r} got unknown option(s) {sorted(unknown)}; it takes "
                          f"{', '.join(takes)}.")


# Built-in mode -> the module whose import registers it.
# Mode names are case-sensitive: the Trainer reports and checkpoints the name as given.
# The built-in modes' adapters register on first use: parlay.strategies sets the loader (it
# imports them; they import this module, so the loader cannot live here without a cycle).
_REGISTRY: Registry[Callable[..., Strategy]] = Registry(
    "mode", valid="valid modes", normalize=str)


def register_strategy(name: str, factory: Callable[..., Strategy], *,
                      replace: bool = False) -> None:
    """Register a strategy factory under ``name`` (a taken name is refused unless
    ``replace``)."""
    _REGISTRY.register(name, factory, replace=replace)


def available_strategies() -> list[str]:
    """Registered mode names."""
    return _REGISTRY.available()


def get_strategy(mode: str, **options: Any) -> Strategy:
    """Build the strategy registered as ``mode``.

    Raises:
        ConfigError: Unknown mode (the message lists the valid ones).
    """
    return _REGISTRY.get(mode)(**options)
