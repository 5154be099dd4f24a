"""The Trainer's options as one frozen, validated-once object, and where training stands.

:class:`TrainerConfig` is what ``Trainer(...)`` is called with: its fields are the Trainer's
arguments (the seed's five by position, every other one by keyword), checked once when it is
built, so the loop and its collaborators read plain, valid fields instead of passing them along.
"""
from __future__ import annotations

import inspect
import math
import os
from dataclasses import KW_ONLY, dataclass
from typing import Any
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from parlay.dp.shard_units import LEVELS as SHARD_LEVELS
from parlay.errors import ConfigError
from parlay.nonfinite import check_policy

__all__ = ["TrainerConfig", "TrainerState", "check_positive", "SCHEDULES", "AUTO"]

SCHEDULES = ("constant", "cosine")
#: ``snapshot_every`` default: an interval chosen from the measured copy and step times.
AUTO = "auto"


def check_positive(name: str, value: Any, allow_none: bool = True, kind: type = int) -> None:
    """Raise ConfigError unless ``value`` is a positive ``kind`` (or None when allowed)."""
    if value is None and allow_none:
        return
    number = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not number or not value > 0:
        raise ConfigError(f"{name} must be a positive {kind.__name__}"
                          f"{' or None' if allow_none else ''}, got {value!r}.")


def _required_args(fn: Any) -> list[str]:
    """The parameters ``fn`` cannot be called without (none when it cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a :class:`~parlay.trainer.Trainer` is told, checked once.

    The first five fields are the seed's own (TensorLayer users pass them by position or by
    name); every field after them is keyword-only, in five groups: *mode and schedule*
    (``mode`` .. ``lr_schedule``), *data* (``shuffle`` .. ``build_validation_func``),
    *precision and numerics* (``precision`` .. ``nonfinite``), *checkpoints and snapshots*
    (``checkpoint_dir`` .. ``snapshot_every``) and *logging* (``log_step_size`` ..
    ``progress``).

    Args:
        build_training_func: Returns ``(model, loss_fn)`` with ``loss_fn(output, target)``;
            called on every rank (the same function serves every mode).
        training_dataset: A map-style dataset of ``(input, target)`` pairs.
        optimizer: A ``torch.optim.Optimizer`` class.
        optimizer_args: Its keyword arguments (``lr`` is the single-replica learning rate).
        batch_size: Samples per batch *per data-parallel replica*.
        mode: A registered strategy: ``"allreduce"``, ``"ps"`` or ``"hybrid"``.
        strategy_options: Extra keyword options for the mode (e.g. ``{"consistency": "async"}``).
        num_epochs: Stop after this many epochs (with neither limit: one epoch).
        max_iteration: Stop after this many steps of each replica (``None`` or ``inf``: no
            limit). In the synchronous modes these are the optimizer's steps; with ``async`` or
            ``stale`` parameter servers each worker takes this many, so the servers apply up
            to workers x max_iteration updates.
        scaling_learning_rate: Multiply the learning rate by the number of replicas one
            update averages (Goyal et al. 2017, "Accurate, Large Minibatch SGD"), reached by
            a linear warm-up; ``async``/``stale`` parameter servers apply each worker's alone.
        warmup_epochs: Length of that warm-up, in epochs (may be fractional; 0: none).
        lr_schedule: After the warm-up, ``"constant"`` or ``"cosine"`` (decay to 0 at the
            last step, Loshchilov & Hutter 2017).
        shuffle: Shuffle the training data each epoch.
        drop_last: Drop the dataset's tail instead of padding it (see ShardedSampler).
        seed: Seeds model construction and the data order (same on every rank); None leaves
            the global RNG alone (data order then uses seed 0).
        prefetch: Batches loaded ahead (per worker with ``num_workers``, else by a thread);
            None: 2 per worker with ``num_workers``, else 0: inline (see :func:`build_loader`).
        num_workers: DataLoader worker processes (0: load in this process, inline unless
            ``prefetch`` > 0 asks for a loading thread).
        validation_dataset: Dataset for :meth:`~parlay.trainer.Trainer.validate`.
        validation_batch_size: Batch size for validation (default: ``batch_size``).
        build_validation_func: Returns ``fn(output, target) -> dict[str, tensor]`` of batch
            means (default: loss and, for class scores, accuracy).
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        compression: Gradient compressor name or object (e.g. ``"fp16"``, ``"topk:0.01"``).
        grad_clip: Clip the global gradient norm (after averaging) to this value.
        nonfinite: A step whose loss or averaged gradient holds a NaN or an infinity:
            ``"raise"`` a :class:`~parlay.errors.NonFiniteError` on every rank before the
            update (naming the step, rank and parameter), or ``"skip"`` it identically on
            every rank (counted in ``skipped_steps``). fp16 keeps GradScaler's overflow skips.
        shard: Modes ``"allreduce"`` and ``"hybrid"``: shard the training state over the
            data-parallel ranks (ZeRO): ``"optimizer"`` (1/N of the optimizer state per rank),
            ``"gradients"`` (also of the gradients) or ``"parameters"`` (also of the
            parameters, each module's gathered just before use). ``None``: every rank holds
            all of it. Checkpoints then hold each rank's shard (DCP). Mode ``"diloco"``: data
            parallel inside each host, sharded over its ranks; the hosts are the replicas.
        reshard: Mode ``"allreduce"``: resume a checkpoint written by another number of
            ranks (e.g. 2 -> 4 -> 3), re-splitting parameters and optimizer state exactly;
            the data order, RNG and compression residuals change (a warning says so). Off
            (default), such a checkpoint is refused.
        checkpoint_dir: Save checkpoints here and resume from the latest valid one.
        checkpoint_every: Steps between checkpoints (None: at every epoch end). A final one
            is always written when training stops.
        keep_last: Checkpoints kept.
        snapshot_every: Steps between in-memory snapshots of every rank's training state (host
            shared memory, written off the critical path). ``"auto"`` (default): the Trainer
            snapshots the first few steps, measures what a snapshot and a step take, and
            picks the smallest interval at which snapshots cost at most 2% of training (the
            ranks agree on it; modes whose servers snapshot in step use 1). An int K: every
            K steps. 0/None: off. A job restarted by ``parlay run --max-restarts`` resumes
            from the newest snapshot every rank holds when it is newer than the disk
            checkpoint (see :mod:`parlay.snapshot`); the printing rank logs how many steps a
            crash can cost (``steps at risk: K``).
        replica_check: Steps between comparisons of the data-parallel replicas' parameters
            and optimizer state (a CRC-32 each, one small allgather; also right after a
            resume). ``"auto"`` (default): an interval re-chosen at every check so checks cost
            at most 0.5% of training. An int K: every K steps. 0/None: off. Three or more
            replicas heal a minority that differs; two stop with
            :class:`~parlay.errors.ReplicaDivergence` (see :mod:`parlay.trainer.replicas`).
        log_step_size: Steps between (reduced) loss logs.
        metrics_path: JSONL metrics file (default: ``<checkpoint_dir>/metrics.jsonl`` when
            checkpointing, else none).
        progress: Show the progress bar on the printing rank.

    Raises:
        ConfigError: Bad arguments (with the expected value and a hint).
        TypeError: An option after ``batch_size`` passed by position.
    """

    build_training_func: Callable[[], tuple[nn.Module, Callable[..., Any]]]
    training_dataset: Dataset
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam
    optimizer_args: dict[str, Any] | None = None
    batch_size: int = 32
    _: KW_ONLY
    # mode and schedule
    mode: str = "allreduce"
    strategy_options: dict[str, Any] | None = None
    num_epochs: int | None = None
    max_iteration: int | None = None
    scaling_learning_rate: bool = True
    warmup_epochs: float = 1.0
    lr_schedule: str = "constant"
    # data
    shuffle: bool = True
    drop_last: bool = False
    seed: int | None = 0
    prefetch: int | None = None
    num_workers: int = 0
    validation_dataset: Dataset | None = None
    validation_batch_size: int | None = None
    build_validation_func: Callable[[], Callable[..., dict[str, Any]]] | None = None
    # precision and numerics
    precision: str = "fp32"
    compression: Any = None
    grad_clip: float | None = None
    nonfinite: str = "raise"
    shard: str | None = None
    reshard: bool = False
    # checkpoints and snapshots
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_last: int = 3
    snapshot_every: int | str | None = AUTO
    replica_check: int | str | None = AUTO
    # logging
    log_step_size: int = 50
    metrics_path: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        """Check every option that needs no process group, the first bad one raising."""
        if not callable(self.build_training_func) and callable(self.training_dataset):
            # TensorLayer's order, Trainer(training_dataset, build_training_func, ...): the same
            build, data = self.training_dataset, self.build_training_func
            object.__setattr__(self, "build_training_func", build)
            object.__setattr__(self, "training_dataset", data)
        if not callable(self.build_training_func):
            raise ConfigError("build_training_func must be a function returning (model, loss_fn).")
        for name, returns in (("build_training_func", "(model, loss_fn)"),
                              ("build_validation_func", "fn(output, target) -> {name: mean}")):
            needs = _required_args(getattr(self, name))
            if needs:  # TensorLayer's took the batch tensors (x, y_) and built a graph on them
                raise ConfigError(f"{name} is called with no arguments and returns {returns}; "
                                  f"this one needs {', '.join(needs)}. Hint: build the model "
                                  "inside it without the batch (TensorLayer's took x and y_).")
        if self.max_iteration == math.inf:  # TensorLayer's default: no limit
            object.__setattr__(self, "max_iteration", None)
        opt = self.optimizer
        if not (isinstance(opt, type) and issubclass(opt, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer class (e.g. "
                              f"torch.optim.Adam), got {opt!r}.")
        if issubclass(opt, torch.optim.LBFGS):
            raise ConfigError("optimizer=LBFGS steps with a closure, which the Trainer's loop "
                              "does not give. Hint: a first-order optimizer (Adam, SGD), or "
                              "parlay.DistributedOptimizer in a loop of your own.")
        for name in ("scaling_learning_rate", "shuffle", "drop_last", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.strategy_options is not None and not isinstance(self.strategy_options, dict):
            raise ConfigError(f"strategy_options must be a dict of the mode's options, got "
                              f"{type(self.strategy_options).__name__}. Hint: e.g. "
                              "strategy_options={'pp': 2}.")
        if self.optimizer_args is not None and not isinstance(self.optimizer_args, dict):
            raise ConfigError(f"optimizer_args must be a dict of the optimizer's keyword "
                              f"arguments, got {self.optimizer_args!r}. Hint: e.g. "
                              "optimizer_args={'lr': 0.1}.")
        for name in ("optimizer_args", "strategy_options"):  # the caller's dict may change
            if getattr(self, name) is not None:
                object.__setattr__(self, name, dict(getattr(self, name)))
        for name in ("checkpoint_dir", "metrics_path"):
            path = getattr(self, name)
            if path is not None and not isinstance(path, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a path, got {path!r}.")
        if self.metrics_path is not None and os.path.isdir(self.metrics_path):
            raise ConfigError(f"metrics_path {self.metrics_path} is a directory. Hint: name a "
                              "file in it, e.g. metrics.jsonl.")
        if self.build_validation_func is not None and not callable(self.build_validation_func):
            raise ConfigError("build_validation_func must be a function returning "
                              "fn(output, target) -> {name: batch mean}.")
        for name in ("batch_size", "log_step_size"):
            check_positive(name, getattr(self, name), allow_none=False)
        for name in ("num_epochs", "max_iteration", "checkpoint_every", "validation_batch_size"):
            check_positive(name, getattr(self, name))
        w = self.warmup_epochs
        if isinstance(w, bool) or not (isinstance(w, (int, float)) and 0 <= w < math.inf):
            raise ConfigError(f"warmup_epochs must be a number >= 0, got {w!r}.")
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(
                self.seed, bool) or not 0 <= self.seed < 2**64):  # torch.manual_seed's range
            raise ConfigError(f"seed must be an int in [0, 2**64) or None, got {self.seed!r}.")
        check_policy(self.nonfinite)
        if not isinstance(self.reshard, bool):
            raise ConfigError(f"reshard must be True or False, got {self.reshard!r}.")
        if self.shard is False:  # as DistributedOptimizer(shard=False): not sharded
            object.__setattr__(self, "shard", None)
        if self.shard is not None and self.shard not in SHARD_LEVELS:
            raise ConfigError(f"shard must be one of {SHARD_LEVELS} or None, got {self.shard!r}.")
        twice = sorted({"compression", "precision", "grad_clip", "shard"}
                       & set(self.strategy_options or {}))
        if twice:
            raise ConfigError(f"strategy_options sets {twice}, which are Trainer arguments. "
                              f"Hint: pass them as Trainer({twice[0]}=...).")
        for name, off in (("snapshot_every", "in-memory snapshots"),
                          ("replica_check", "replica checks")):
            every = getattr(self, name)
            if every != AUTO and every is not None and (
                    isinstance(every, bool) or not isinstance(every, int) or every < 0):
                raise ConfigError(f"{name} must be 'auto', an int >= 0 or None (0/None: no "
                                  f"{off}), got {every!r}.")

    @property
    def base_lr(self) -> Any:
        """The single-replica learning rate: ``optimizer_args["lr"]``, else the optimizer's
        default (None when it has none)."""
        if "lr" in (self.optimizer_args or {}):
            return (self.optimizer_args or {})["lr"]
        try:
            p = inspect.signature(self.optimizer).parameters.get("lr")
        except (TypeError, ValueError):
            return None
        return None if p is None or p.default is inspect.Parameter.empty else p.default


@dataclass
class TrainerState:
    """Where training stands (identical on every training rank).

    Attributes:
        epoch: Current epoch (0-based; equals ``num_epochs`` when training is over).
        step: Optimizer steps taken.
        samples_seen: Training samples consumed over all replicas.
        batch_in_epoch: Batches of the current epoch already consumed by each replica.
        skipped_steps: Steps skipped on every rank (non-finite, fp16 overflow), counted across
            restarts.
        schedule_shift: Added to ``step`` where the learning-rate schedule and epoch
            fractions count steps: nonzero after a resume at another number of ranks
            (``reshard=True``), whose steps per epoch differ from those already taken.
    """

    epoch: int = 0
    step: int = 0
    samples_seen: int = 0
    batch_in_epoch: int = 0
    skipped_steps: int = 0
    schedule_shift: int = 0
