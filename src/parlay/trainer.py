"""Trainer: a model and a dataset in, distributed training out, in any mode.

The Trainer never branches on the mode. It asks :func:`parlay.strategies.get_strategy` for one
and drives it: shard the data over ``strategy.dp_size`` replicas, scale the learning rate,
step, log, validate, checkpoint, resume. Parameter-server ranks serve inside
:meth:`Trainer.should_stop` and return ``True`` when the workers are done.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from parlay import runtime
from parlay.data.loader import build_loader
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError, ConfigError, NonFiniteError
from parlay.metrics import MetricsLogger, default_metrics
from parlay.nonfinite import NonFiniteGuard, check_policy, with_step
from parlay.strategies import StepResult, Strategy, get_strategy
from parlay.trainer_io import TrainerIO
from parlay.trainer_support import (TrainerSession, TrainerState, check_built, check_positive,
                                    check_strategy_options, check_trainer_args, choose_printer,
                                    default_lr, start_message)

__all__ = ["Trainer", "TrainerState", "TrainerSession"]

log = logging.getLogger("parlay")


class Trainer(TrainerIO):
    """Train ``build_training_func()``'s model on ``training_dataset`` across all processes.

    The first five arguments are the seed's own (TensorLayer users pass them by position or
    by name); every option after them is keyword-only, in five groups: *mode and schedule*
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

    Keyword Args:
        mode: A registered strategy: ``"allreduce"``, ``"ps"`` or ``"hybrid"``.
        strategy_options: Extra keyword options for the mode (e.g. ``{"consistency": "async"}``).
        num_epochs: Stop after this many epochs (with neither limit: one epoch).
        max_iteration: Stop after this many optimizer steps in total.
        scaling_learning_rate: Multiply the learning rate by the number of replicas (Goyal
            et al. 2017, "Accurate, Large Minibatch SGD"), reached by a linear warm-up.
        warmup_epochs: Length of that warm-up, in epochs (may be fractional; 0: none).
        lr_schedule: After the warm-up, ``"constant"`` or ``"cosine"`` (decay to 0 at the
            last step, Loshchilov & Hutter 2017).
        shuffle: Shuffle the training data each epoch.
        drop_last: Drop the dataset's tail instead of padding it (see ShardedSampler).
        seed: Seeds model construction and the data order (same on every rank); None leaves
            the global RNG alone (data order then uses seed 0).
        prefetch: Batches loaded ahead (per worker with ``num_workers``, else by a thread);
            None: 2, or inline for in-memory tensor datasets (see :func:`build_loader`).
        num_workers: DataLoader worker processes (0: a loading thread in this process).
        validation_dataset: Dataset for :meth:`validate`.
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
        checkpoint_dir: Save checkpoints here and resume from the latest valid one.
        checkpoint_every: Steps between checkpoints (None: at every epoch end). A final one
            is always written when training stops.
        keep_last: Checkpoints kept.
        snapshot_every: Steps between in-memory snapshots of every rank's training state (host
            shared memory, written off the critical path; 0/None: off). A job restarted by
            ``parlay run --max-restarts`` resumes from the newest one every rank holds when
            it is newer than the disk checkpoint, so it loses at most one step (see
            :mod:`parlay.snapshot`).
        log_step_size: Steps between (reduced) loss logs.
        metrics_path: JSONL metrics file (default: ``<checkpoint_dir>/metrics.jsonl`` when
            checkpointing, else none).
        progress: Show the progress bar on the printing rank.

    Raises:
        ConfigError: Bad arguments (with the expected value and a hint).
        CheckpointError: ``checkpoint_dir`` holds checkpoints of an incompatible run.
        TypeError: An option after ``batch_size`` passed by position.
    """

    def __init__(self, build_training_func: Callable[[], tuple[nn.Module, Callable[..., Any]]],
                 training_dataset: Dataset, optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
                 optimizer_args: dict[str, Any] | None = None, batch_size: int = 32, *,
                 # mode and schedule
                 mode: str = "allreduce", strategy_options: dict[str, Any] | None = None,
                 num_epochs: int | None = None, max_iteration: int | None = None,
                 scaling_learning_rate: bool = True, warmup_epochs: float = 1.0,
                 lr_schedule: str = "constant",
                 # data
                 shuffle: bool = True, drop_last: bool = False, seed: int | None = 0,
                 prefetch: int | None = None, num_workers: int = 0,
                 validation_dataset: Dataset | None = None,
                 validation_batch_size: int | None = None,
                 build_validation_func: Callable[[], Callable[..., dict[str, Any]]] | None = None,
                 # precision and numerics
                 precision: str = "fp32", compression: Any = None,
                 grad_clip: float | None = None, nonfinite: str = "raise",
                 # checkpoints and snapshots
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                 keep_last: int = 3, snapshot_every: int | None = 1,
                 # logging
                 log_step_size: int = 50, metrics_path: str | None = None,
                 progress: bool = True) -> None:
        check_trainer_args(build_training_func, optimizer,
                           {"batch_size": batch_size, "log_step_size": log_step_size},
                           {"num_epochs": num_epochs, "max_iteration": max_iteration,
                            "checkpoint_every": checkpoint_every,
                            "validation_batch_size": validation_batch_size},
                           warmup_epochs, lr_schedule, seed)
        check_policy(nonfinite)
        if not runtime.is_initialized():
            runtime.init()
        self._set_schedule(mode, batch_size, num_epochs, max_iteration, lr_schedule,
                           log_step_size, checkpoint_every, validation_dataset)
        self.strategy: Strategy = self._make_strategy(mode, strategy_options, precision,
                                                      compression, grad_clip, nonfinite)
        model = self._build_model(build_training_func, optimizer, optimizer_args, seed,
                                  checkpoint_dir, build_validation_func)
        self._build_data(training_dataset, validation_batch_size, num_workers, prefetch,
                         shuffle, seed, drop_last, scaling_learning_rate, warmup_epochs)
        self._open_checkpoints(checkpoint_dir, keep_last, model, snapshot_every)
        self._start_metrics(metrics_path, checkpoint_dir, progress)
        base = (optimizer_args or {}).get("lr", default_lr(optimizer))
        self._announce(start_message(self, mode, precision, compression, base, warmup_epochs))

    # ------------------------------------------------------------------ construction steps
    def _set_schedule(self, mode: str, batch_size: int, num_epochs: int | None,
                      max_iteration: int | None, lr_schedule: str, log_step_size: int,
                      checkpoint_every: int | None, validation_dataset: Dataset | None) -> None:
        """Record the run's length and cadences (plain attributes, no communication)."""
        self.mode = mode
        self.lr_schedule = lr_schedule
        self.batch_size = batch_size
        self.num_epochs = num_epochs if (num_epochs or max_iteration) else 1
        self.max_iteration = max_iteration
        self.log_step_size = log_step_size
        self.checkpoint_every = checkpoint_every
        self.validation_dataset = validation_dataset
        self.state = TrainerState()

    @staticmethod
    def _make_strategy(mode: str, options: dict[str, Any] | None, precision: str,
                       compression: Any, grad_clip: float | None, nonfinite: str) -> Strategy:
        """The mode's strategy, with the non-finite guard where the strategy checks steps."""
        check_strategy_options(options)
        strategy = get_strategy(mode, compression=compression, precision=precision,
                                grad_clip=grad_clip, **(options or {}))
        if hasattr(strategy, "guard"):  # strategies that check for NaN/inf steps
            strategy.guard = NonFiniteGuard(nonfinite)
        return strategy

    def _build_model(self, build: Callable[[], Any], optimizer: type[torch.optim.Optimizer],
                     optimizer_args: dict[str, Any] | None, seed: int | None,
                     checkpoint_dir: str | None,
                     build_validation_func: Callable[[], Callable[..., dict[str, Any]]] | None
                     ) -> nn.Module:
        """Build the model (same seed on every rank) and hand it to the strategy."""
        s = self.strategy
        if seed is not None:
            torch.manual_seed(seed)
        model, self.loss_fn = check_built(build())
        if checkpoint_dir is not None:
            s.use_checkpoint_dir(str(checkpoint_dir))
        s.setup(model, self.loss_fn, optimizer, dict(optimizer_args or {}))
        if seed is not None:  # distinct dropout masks per rank, reproducible per run
            torch.manual_seed(seed + 1 + runtime.rank())
        self._metric_fn = (build_validation_func() if build_validation_func is not None
                           else default_metrics(self.loss_fn))
        return model

    def _build_data(self, dataset: Dataset, validation_batch_size: int | None,
                    num_workers: int, prefetch: int | None, shuffle: bool, seed: int | None,
                    drop_last: bool, scaling_learning_rate: bool, warmup_epochs: float) -> None:
        """Shard the data over the replicas and derive the step counts and LR scaling."""
        s = self.strategy
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError("training_dataset must be a map-style Dataset with __len__.") from None
        self._val_batch = validation_batch_size or self.batch_size
        self._val_loader: Any = None
        self._num_workers, self._prefetch = num_workers, prefetch
        self._pin = runtime.device().type == "cuda"
        self.sampler = ShardedSampler(n, s.dp_size, s.dp_rank, shuffle=shuffle, seed=seed or 0,
                                      drop_last=drop_last)
        self.loader = (build_loader(dataset, self.sampler, self.batch_size,
                                    num_workers=num_workers, prefetch=prefetch, pin_memory=self._pin)
                       if s.consumes_data else None)
        self.steps_per_epoch = math.ceil(len(self.sampler) / self.batch_size)
        self.lr_scale = float(s.dp_size) if scaling_learning_rate else 1.0
        self.warmup_steps = round(warmup_epochs * self.steps_per_epoch) if self.lr_scale != 1 else 0
        self._it: Any = None
        self.last_step: StepResult | None = None
        self._stopped = False

    def _start_metrics(self, metrics_path: str | None, checkpoint_dir: str | None,
                       progress: bool) -> None:
        """The metrics logger: progress bar and console on the printing rank, JSONL file."""
        s = self.strategy
        full, rest = divmod(self.total_steps, self.steps_per_epoch)
        total = full * self.sampler.total_size + rest * self.batch_size * s.dp_size
        if metrics_path is None and checkpoint_dir is not None:
            metrics_path = f"{checkpoint_dir}/metrics.jsonl"
        self.metrics = MetricsLogger(printer=choose_printer(s),
                                     reduces=s.reports_loss and s.consumes_data,
                                     group=s.dp_group, total_samples=total,
                                     initial_samples=self.state.samples_seen,
                                     jsonl_path=metrics_path, progress=progress)

    def _announce(self, msg: str) -> None:
        """Log the start-up line, print it on the printing rank and record the run's start."""
        log.info(msg)
        self.metrics.print(msg)
        self.metrics.write("start", mode=self.mode, dp_size=self.strategy.dp_size,
                           batch_size=self.batch_size, lr_scale=self.lr_scale,
                           warmup_steps=self.warmup_steps, step=self.state.step,
                           epoch=self.state.epoch)

    # ------------------------------------------------------------------ schedule
    @property
    def total_steps(self) -> int:
        """Steps of the whole run (the smaller of both limits)."""
        limits = [self.max_iteration] if self.max_iteration else []
        if self.num_epochs:
            limits.append(self.num_epochs * self.steps_per_epoch)
        return min(limits)

    def lr_factor(self, step: int | None = None) -> float:
        """Learning-rate multiplier for ``step`` (default: the next one): linear warm-up from
        1 to the replica count over ``warmup_steps`` (Goyal et al. 2017), then constant or a
        cosine decay to 0 at the last step (``lr_schedule``)."""
        t = self.state.step if step is None else step
        if self.warmup_steps > 0 and t < self.warmup_steps:
            return 1.0 + (self.lr_scale - 1.0) * t / self.warmup_steps
        if self.lr_schedule == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            done = min(1.0, (t - self.warmup_steps) / span)
            return self.lr_scale * 0.5 * (1.0 + math.cos(math.pi * done))
        return self.lr_scale

    # ------------------------------------------------------------------ training
    def _next_batch(self) -> Any:
        if self._it is None:
            self.sampler.epoch = self.state.epoch
            self.sampler.position = min(len(self.sampler), self.state.batch_in_epoch * self.batch_size)
            self._it = iter(self.loader)  # type: ignore[arg-type]
        try:
            return next(self._it)
        except StopIteration:
            raise CheckpointError("the data loader ended before the epoch did (the dataset "
                                  "changed size?). Hint: keep the dataset fixed during a run.") from None

    def train_on_batch(self) -> float | None:
        """Run one optimizer step on the next batch of every replica.

        Returns:
            This rank's batch loss (``None`` on ranks that do not compute one).

        Raises:
            ConfigError: Called on a rank that only serves (a parameter server).
        """
        s = self.strategy
        if not s.consumes_data:
            raise ConfigError("train_on_batch() was called on a serving-only rank (parameter "
                              "server). Hint: loop `while not trainer.should_stop(): "
                              "trainer.train_on_batch()`; should_stop() serves on these ranks.")
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(f"each training sample must be an (input, target) pair; the loader "
                              f"gave a {type(batch).__name__} of length "
                              f"{len(batch) if hasattr(batch, '__len__') else '?'}.")
        x, y = batch
        factor = self.lr_factor()
        s.set_lr_factor(factor)
        try:
            res = self.last_step = s.train_step(x, y)
        except NonFiniteError as e:
            raise with_step(e, self.state.step + 1) from None
        if res.skipped:
            self._note_skip()
        self._advance(len(y), res.loss, factor)
        return res.loss

    def _advance(self, n: int, loss: float | None, factor: float) -> None:
        """Count a step of ``n`` samples per replica: log, close the epoch, checkpoint and
        snapshot when due."""
        st, s = self.state, self.strategy
        st.step += 1
        st.samples_seen += n * s.dp_size
        st.batch_in_epoch += 1
        self.sampler.advance(n)
        self.metrics.step(loss if loss is None or math.isfinite(loss) else None, n, n * s.dp_size)
        if st.step % self.log_step_size == 0:
            self.metrics.log(st.step, st.epoch, factor, console=True)
        epoch_done = st.batch_in_epoch >= self.steps_per_epoch
        if epoch_done:
            self.metrics.epoch_end(st.epoch, st.step)
            st.epoch += 1
            st.batch_in_epoch = 0
            self.sampler.set_epoch(st.epoch)
            self._close_iter()
        if self._ckpt is not None and (
                (self.checkpoint_every is not None and st.step % self.checkpoint_every == 0)
                or (self.checkpoint_every is None and epoch_done)):
            self.save_checkpoint()
        self._snapshot_after_step()

    def _reached_end(self) -> bool:
        st = self.state
        return bool((self.max_iteration is not None and st.step >= self.max_iteration)
                    or (self.num_epochs is not None and st.epoch >= self.num_epochs))

    def should_stop(self) -> bool:
        """True when training is over. On serving-only ranks (parameter servers) this serves
        until the workers finish, then returns True. The first True also writes the final
        checkpoint and releases the servers."""
        if self._stopped:
            return True
        if self.strategy.serve_until_done():
            self._stopped = True
            self.close()
            return True
        if self._reached_end():
            self._stopped = True
            if self._ckpt is not None and self._last_ckpt_step != self.state.step:
                self.save_checkpoint()
            self.strategy.finish()
            if self._snap is not None:
                self._snap.clear()  # the run is over: give the memory back
            self.close()
            return True
        return False

    def _note_skip(self) -> None:
        self.state.skipped_steps += 1
        msg = (f"step {self.state.step + 1} was skipped on every rank: its loss or gradient was "
               f"not finite ({self.skipped_steps} skipped so far; under fp16 a loss-scale "
               "overflow, which GradScaler expects now and then)")
        log.warning(msg)
        self.metrics.write("skipped_step", step=self.state.step + 1,
                           skipped_steps=self.skipped_steps)

    # ------------------------------------------------------------------ teardown
    def _close_iter(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self._it = None

    def close(self) -> None:
        """Stop loading threads and close the progress bar and metrics file."""
        self._close_iter()
        if self._val_loader is not None:
            self._val_loader.close()
        self.metrics.close()
        if self._ckpt is not None:
            self._ckpt.close()  # release the checkpoint_dir lock
        if self._snap is not None:
            self._snap.close()  # commits the newest snapshot if its copy is still deferred

    @property
    def session(self) -> "TrainerSession":
        """The object the seed's TensorLayer loop asks, in every mode:
        ``while not trainer.session.should_stop(): trainer.train_on_batch()``."""
        return TrainerSession(self)

    def train_to_end(self) -> None:
        """Train until :meth:`should_stop` (TensorLayer's ``train_to_end``); parameter servers
        serve until the workers finish."""
        while not self.should_stop():
            self.train_on_batch()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank (non-finite, fp16 overflow); restored on resume."""
        return self.state.skipped_steps

    @property
    def model(self) -> nn.Module | None:
        """The model being trained on this rank, when the strategy exposes it."""
        return getattr(self.strategy, "model", None)
