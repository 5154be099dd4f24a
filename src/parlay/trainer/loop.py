"""Trainer: a model and a dataset in, distributed training out, in any mode.

The Trainer never branches on the mode. It asks :func:`parlay.strategies.get_strategy` for one
and drives it: shard the data over ``strategy.dp_size`` replicas, scale the learning rate,
step and log. Validation is an :class:`~parlay.trainer.evaluation.Evaluation`'s, checkpoints,
snapshots and resume a :class:`~parlay.trainer.persistence.Persistence`'s. Parameter-server
ranks serve inside :meth:`Trainer.should_stop` and return ``True`` when the workers are done.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from typing import Any
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from parlay import runtime
from parlay.data.loader import build_loader, check_dataset
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError, ConfigError, NonFiniteError
from parlay.metrics import MetricsLogger, choose_printer, default_metrics
from parlay.nonfinite import NonFiniteGuard, with_step
from parlay.runinfo import model_layout, stable_repr
from parlay.strategies import StepResult, Strategy, get_strategy
from parlay.strategies.template import batch_size_of, checked_loss
from parlay.trainer.config import TrainerConfig, TrainerState, check_positive
from parlay.trainer.evaluation import Evaluation
from parlay.trainer.persistence import Persistence, check_same_settings, shaped

__all__ = ["Trainer", "TrainerSession"]

log = logging.getLogger("parlay")


class Trainer:
    """Train ``build_training_func()``'s model on ``training_dataset`` across all processes.

    Takes the arguments of :class:`~parlay.trainer.config.TrainerConfig` (the seed's five by
    position or by name, every other one by keyword), kept as :attr:`config`.

    Raises:
        ConfigError: Bad arguments (with the expected value and a hint).
        CheckpointError: ``checkpoint_dir`` holds checkpoints of an incompatible run.
        TypeError: An option after ``batch_size`` passed by position.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "prefetch_size" in kwargs:  # TensorLayer's name
            if "prefetch" in kwargs:
                raise ConfigError("pass prefetch or prefetch_size (TensorLayer's name for it), "
                                  "not both.")
            kwargs["prefetch"] = kwargs.pop("prefetch_size")
        if args and "build_training_func" in kwargs:  # TensorLayer's order, Trainer(data, ...)
            args = (kwargs.pop("build_training_func"), *args)
        self.config = cfg = TrainerConfig(*args, **kwargs)
        if not runtime.is_initialized():
            runtime.init()
        # before the strategy's set-up, whose collectives differ by mode: a mismatch aborts
        # (over the ranks that train together: the world, or a process_group option's)
        check_same_settings({k: stable_repr(v) for k, v in {
            "mode": cfg.mode, "strategy_options": shaped(cfg.strategy_options),
            "shard": cfg.shard}.items()}, (cfg.strategy_options or {}).get("process_group"))
        self.mode, self.batch_size, self.lr_schedule = cfg.mode, cfg.batch_size, cfg.lr_schedule
        self.num_epochs = cfg.num_epochs if (cfg.num_epochs or cfg.max_iteration) else 1
        self.max_iteration = cfg.max_iteration
        self.state = TrainerState()
        self.strategy: Strategy = get_strategy(
            cfg.mode, compression=cfg.compression, precision=cfg.precision,
            grad_clip=cfg.grad_clip, **({"shard": cfg.shard} if cfg.shard else {}),
            **(cfg.strategy_options or {}))
        self.strategy.guard = NonFiniteGuard(cfg.nonfinite)  # strategies that check steps use it
        layout = self._build_model()
        try:
            self._start(cfg, layout)
        except BaseException as e:  # e.g. a checkpoint this layout cannot resume: the ranks
            self.strategy.abort(e)  # that wait on this one (parameter servers) hear it now
            raise

    def _start(self, cfg: TrainerConfig, layout: list[list[Any]]) -> None:
        """What construction does once the strategy is set up: data, resume, metrics."""
        self._build_data(cfg.training_dataset)
        self.last_step: StepResult | None = None
        self._it: Any = None
        self._stopped = False
        self.persistence = Persistence(cfg, self.strategy, self.sampler, self.state, layout,
                                       self._say)
        self.steps_per_epoch = math.ceil(len(self.sampler) / self.batch_size)  # as resumed
        self.metrics = self._start_metrics()
        self.evaluation = Evaluation(self.strategy, self._metric_fn, cfg.validation_dataset,
                                     cfg.validation_batch_size or cfg.batch_size,
                                     **self._loader_options)
        self._say(self._start_message())
        cosine, w, n = self.lr_schedule == "cosine", self.warmup_steps, self.total_steps
        if 0 < n and (n < w or (n == w and cosine)) and self.metrics.printer:  # (defaults: no)
            warnings.warn(f"the learning-rate warm-up ({w} steps) covers all {n} steps of "
                          "training: the rate only rises and never reaches its scaled value"
                          + (" nor decays (lr_schedule='cosine')" if cosine else "")
                          + f". Hint: a smaller warmup_epochs (now {cfg.warmup_epochs:g}), or "
                          "train longer.", stacklevel=3)
        self.metrics.write("start", mode=self.mode, dp_size=self.strategy.dp_size,
                           batch_size=self.batch_size, lr_scale=self.lr_scale,
                           warmup_steps=self.warmup_steps, step=self.state.step,
                           epoch=self.state.epoch)

    # ------------------------------------------------------------------ construction steps
    def _build_model(self) -> list[list[Any]]:
        """Build the model (same seed on every rank) and hand it to the strategy; returns its
        layout as built (``shard="parameters"`` leaves size-0 placeholders in the model)."""
        cfg, s = self.config, self.strategy
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        built = cfg.build_training_func()
        if not (isinstance(built, tuple) and len(built) == 2
                and isinstance(built[0], nn.Module) and callable(built[1])):
            raise ConfigError(f"build_training_func() must return (model, loss_fn) with an "
                              f"nn.Module and a callable loss_fn(output, target), got "
                              f"{type(built).__name__}. Hint: return model, nn.CrossEntropyLoss().")
        model, self.loss_fn = built[0], checked_loss(built[1])
        if cfg.checkpoint_dir is not None:
            s.use_checkpoint_dir(str(cfg.checkpoint_dir))
        layout = model_layout(model)  # before a shard="parameters" setup empties it
        s.setup(model, self.loss_fn, cfg.optimizer, dict(cfg.optimizer_args or {}))
        if cfg.seed is not None:  # distinct dropout masks per rank, reproducible per run
            torch.manual_seed((cfg.seed + 1 + runtime.rank()) % 2**64)
        self._metric_fn = (cfg.build_validation_func() if cfg.build_validation_func is not None
                           else default_metrics(self.loss_fn))
        return layout

    def _build_data(self, dataset: Dataset) -> None:
        """Shard the data over the replicas and derive the step counts and LR scaling."""
        cfg, s = self.config, self.strategy
        check_dataset("training_dataset", dataset)  # here, failures reach waiting servers
        self.sampler = ShardedSampler(len(dataset), s.dp_size, s.dp_rank,  # type: ignore[arg-type]
                                      shuffle=cfg.shuffle, seed=cfg.seed or 0,
                                      drop_last=cfg.drop_last)
        self._loader_options: dict[str, Any] = {"num_workers": cfg.num_workers,
                                                "prefetch": cfg.prefetch,
                                                "pin_memory": runtime.device().type == "cuda",
                                                # workers draw alike on a replica's stages
                                                "seed": cfg.seed or 0, "rank": s.dp_rank}
        self.loader = (build_loader(dataset, self.sampler, self.batch_size,
                                    **self._loader_options) if s.consumes_data else None)
        self.steps_per_epoch = math.ceil(len(self.sampler) / self.batch_size)
        self.lr_scale = float(s.update_replicas) if cfg.scaling_learning_rate else 1.0
        self.warmup_steps = (round(cfg.warmup_epochs * self.steps_per_epoch)
                             if self.lr_scale != 1 else 0)

    def _start_metrics(self) -> MetricsLogger:
        """The metrics logger: progress bar and console on the printing rank, JSONL file."""
        cfg, s = self.config, self.strategy
        full, rest = divmod(self.total_steps, self.steps_per_epoch)
        total = full * self.sampler.total_size + rest * self.batch_size * s.dp_size
        path = cfg.metrics_path
        if path is None and cfg.checkpoint_dir is not None:
            path = f"{cfg.checkpoint_dir}/metrics.jsonl"
        metrics = MetricsLogger(printer=choose_printer(s.consumes_data, s.reports_loss,
                                                       s.train_group),
                                reduces=s.reports_loss and s.consumes_data, group=s.dp_group,
                                total_samples=total, initial_samples=self.state.samples_seen,
                                jsonl_path=path, progress=cfg.progress,
                                epoch_so_far=self.persistence.resumed_metrics)
        self.persistence.epoch_so_far = lambda: metrics.epoch_so_far
        return metrics

    def _say(self, msg: str) -> None:
        """Log a line and show it on the printing rank."""
        log.info(msg)
        self.metrics.print(msg)

    def _start_message(self) -> str:
        """The line the printing rank shows when a Trainer starts (or resumes)."""
        cfg, s, st = self.config, self.strategy, self.state
        risk = self.persistence.steps_at_risk(self.total_steps, self.steps_per_epoch)
        return (f"parlay Trainer: mode={self.mode}, {s.dp_size} replica(s) x batch "
                f"{self.batch_size} = {self.batch_size * s.dp_size} samples/step, "
                f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps; learning rate "
                f"x{self.lr_scale:g} "
                + (f"(linear scaling, warm-up over {self.warmup_steps} steps = "
                   f"{cfg.warmup_epochs:g} epoch(s) from x1; base lr {cfg.base_lr})"
                   if self.lr_scale != 1 else "(no scaling: each update applies one replica's "
                   "gradient)" if cfg.scaling_learning_rate and s.dp_size > 1 else "(no scaling)")
                + f"; precision={cfg.precision}, compression={cfg.compression}"
                + (f"; resumed at step {st.step}, epoch {st.epoch}" if st.step else "")
                + (f"; steps at risk: {risk}" if risk is not None
                   else "; snapshot interval: measured over the first steps"))

    # ------------------------------------------------------------------ schedule
    @property
    def total_steps(self) -> int:
        """Steps of the whole run (the smaller of both limits)."""
        limits = [self.max_iteration + self.state.schedule_shift] if self.max_iteration else []
        if self.num_epochs:
            limits.append(self.num_epochs * self.steps_per_epoch)
        return min(limits)

    def lr_factor(self, step: int | None = None) -> float:
        """Learning-rate multiplier for ``step`` (default: the next one): linear warm-up from
        1 to the replica count over ``warmup_steps`` (Goyal et al. 2017), then constant or a
        cosine decay towards 0, reached just after the last step (``lr_schedule``)."""
        t = (self.state.step if step is None else step) + self.state.schedule_shift
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
            self.sampler.position = min(len(self.sampler),
                                        self.state.batch_in_epoch * self.batch_size)
            self._it = iter(self.loader)  # type: ignore[arg-type]
        try:
            return next(self._it)
        except StopIteration:
            raise CheckpointError("the data loader ended before the epoch did (the dataset "
                                  "changed size?). Hint: keep the dataset fixed during a "
                                  "run.") from None

    def train_on_batch(self) -> float | None:
        """Run one optimizer step on the next batch of every replica.

        Returns:
            This rank's batch loss (``None`` on ranks that do not compute one).

        Raises:
            ConfigError: Called on a rank that only serves (a parameter server), or once
                ``max_iteration`` or ``num_epochs`` is reached.
        """
        s = self.strategy
        if not s.consumes_data:
            raise ConfigError("train_on_batch() was called on a serving-only rank (parameter "
                              "server). Hint: loop `while not trainer.should_stop(): "
                              "trainer.train_on_batch()`; should_stop() serves on these ranks.")
        if self._stopped or self._reached_end(counters_only=True):  # alike on every rank
            raise ConfigError(f"training is over (step {self.state.step} of "
                              f"{self.total_steps}): another train_on_batch() would train past "
                              "the end. Hint: loop `while not trainer.should_stop()`, or a "
                              "larger max_iteration or num_epochs.")
        try:
            batch = self._next_batch()
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ConfigError(f"each training sample must be an (input, target) pair; the "
                                  f"loader gave a {type(batch).__name__} of length "
                                  f"{len(batch) if hasattr(batch, '__len__') else '?'}.")
            x, y = batch
            factor = self.lr_factor()
            s.set_lr_factor(factor)
            self.persistence.begin_step()
            res = self.last_step = s.train_step(x, y)
        except BaseException as e:  # (loading the data too: a dataset that raises)
            s.abort(e)  # peers that wait on this rank hear of it now, not at their timeout
            if isinstance(e, NonFiniteError):
                raise with_step(e, self.state.step + 1) from None
            raise
        if res.skipped:
            self._note_skip()
        self._advance(batch_size_of(y), res.loss, factor)
        return res.loss

    def _advance(self, n: int, loss: float | None, factor: float) -> None:
        """Count a step of ``n`` samples per replica: log, close the epoch, checkpoint and
        snapshot when due."""
        st, smp = self.state, self.sampler
        st.step += 1
        st.samples_seen += n * smp.num_replicas
        st.batch_in_epoch += 1
        smp.advance(n)
        self.metrics.step(loss if loss is None or math.isfinite(loss) else None, n,
                          n * smp.num_replicas)
        if st.step % self.config.log_step_size == 0:
            self.metrics.log(st.step, st.epoch, factor, console=True)
        epoch_done = st.batch_in_epoch >= self.steps_per_epoch
        if epoch_done:  # replicas that do not step together count and re-shard here
            end = self.strategy.end_epoch(st.epoch, smp.position)
            if end is not None:  # the lowest replica left prints (the printer may be lost)
                self.metrics.set_printer(end.shard == 0)
            self.metrics.epoch_end(st.epoch, st.step, None if end is None else end.samples)
            st.epoch += 1
            st.batch_in_epoch = 0
            if end is not None:
                smp.reshard(end.shards, end.shard)
                self.steps_per_epoch = math.ceil(len(smp) / self.batch_size)
                # the schedule and epoch fractions go on as if every epoch had had these steps
                st.schedule_shift = st.epoch * self.steps_per_epoch - st.step
            smp.set_epoch(st.epoch)
            self._it = None  # the next pass starts anew (worker processes stay)
        self.persistence.after_step(epoch_done)

    def _reached_end(self, counters_only: bool = False) -> bool:
        st = self.state
        return bool((self.max_iteration is not None and st.step >= self.max_iteration)
                    or (self.num_epochs is not None and st.epoch >= self.num_epochs)
                    or (not counters_only and self.strategy.reached_end()))

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
            self._finish()
            return True
        return False

    def _finish(self, then: Callable[[], Any] = lambda: None) -> Any:
        """End training: the final checkpoint, the strategy's end (diloco's final sync), then
        ``then()`` (the final validation: on the weights training ends with), then close."""
        self._stopped = True
        self.persistence.begin_step()
        self.persistence.finish()
        self.strategy.finish()
        out = then()
        self._close(over=True)
        return out

    def _note_skip(self) -> None:
        self.state.skipped_steps += 1
        where = "every rank" if self.strategy.skips_together else f"rank {runtime.rank()}"
        msg = (f"step {self.state.step + 1} was skipped on {where}: its loss or gradient was "
               f"not finite ({self.skipped_steps} skipped so far; under fp16 a loss-scale "
               "overflow, which GradScaler expects now and then)")
        (log.warning if self.metrics.printer or where != "every rank" else log.debug)(msg)
        self.metrics.write("skipped_step", step=self.state.step + 1,
                           skipped_steps=self.skipped_steps)

    def train_to_end(self) -> None:
        """Train until :meth:`should_stop` (TensorLayer's ``train_to_end``); parameter servers
        serve until the workers finish."""
        while not self.should_stop():
            self.train_on_batch()

    # ------------------------------------------------------------------ validation
    def validate(self, dataset: Dataset | None = None) -> dict[str, float]:
        """Evaluate on ``dataset`` (default: ``validation_dataset``) across all replicas.

        Each replica evaluates its own shard (no sample twice); metrics are batch means
        weighted by sample counts and reduced over the strategy's ``dp_group`` (as tensors),
        so every reporting rank returns the mean over the whole dataset. A replica whose
        ``dp_group`` holds only itself while there are several replicas (asynchronous
        parameter-server workers, whose models differ) evaluates the whole dataset alone.
        Servers return ``{}`` at once, also after :meth:`should_stop`.

        Returns:
            ``{name: value}`` plus ``"samples"``; empty on ranks without metrics.

        Raises:
            ConfigError: No dataset.
        """
        if dataset is None and self.config.validation_dataset is None:
            raise ConfigError("validate() needs a dataset: pass validation_dataset=... to the "
                              "Trainer or validate(dataset).")
        t0 = time.perf_counter()
        result = self.evaluation.validate(dataset)
        if result:
            self.metrics.validation(self.state.step, (self.state.step + self.state.schedule_shift)
                                    / self.steps_per_epoch,
                                    result, seconds=time.perf_counter() - t0)
        return result

    def train_and_validate_to_end(self, validate_every: int | None = None, *,
                                  validate_step_size: int | None = None) -> dict[str, float]:
        """Train until :meth:`should_stop`, validating every ``validate_every`` steps (default:
        at every epoch end; ``validate_step_size`` is TensorLayer's name for it) and at the end.

        Returns:
            The last validation metrics (empty without a validation set, or on ranks that
            do not report metrics).
        """
        if validate_every is not None and validate_step_size is not None:
            raise ConfigError("pass validate_every or validate_step_size (TensorLayer's name "
                              "for it), not both.")
        if validate_every is None:
            validate_every = validate_step_size
        check_positive("validate_every", validate_every)
        has_val = self.config.validation_dataset is not None
        last: dict[str, float] = {}
        while not self._stopped and not self._reached_end():
            if not self.strategy.consumes_data:
                break
            epoch = self.state.epoch
            self.train_on_batch()
            due = (self.state.step % validate_every == 0 if validate_every
                   else self.state.epoch != epoch)
            if has_val and due and not self._reached_end():  # the end's comes after finishing
                last = self.validate()
        if self._stopped or not self.strategy.consumes_data:
            self.should_stop()  # stopped before, or a rank that only serves
            return last
        return self._finish(lambda: self.validate() if has_val else last)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        """Write a checkpoint of everything stateful now (every training rank must call it).
        Parameter servers save their shards when the workers do; after training, the final
        checkpoint already holds the state."""
        if not self.strategy.consumes_data or (
                self._stopped and self.persistence.last_checkpoint_step == self.state.step):
            return
        self.persistence.save_checkpoint()

    @property
    def resumed_from_snapshot(self) -> int | None:
        """The step resumed from an in-memory snapshot, or None."""
        return self.persistence.resumed_from_snapshot

    @property
    def snapshot_every(self) -> int:
        """Steps between in-memory snapshots now (0: none; 1 while ``"auto"`` measures)."""
        return self.persistence.every

    @snapshot_every.setter
    def snapshot_every(self, every: int) -> None:
        self.persistence.every = every

    # ------------------------------------------------------------------ teardown
    def _close_iter(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self._it = None

    def close(self) -> None:
        """Stop loading threads, close the progress bar and metrics file, release the
        checkpoint directory and commit a snapshot still being copied. After training ended,
        also remove the in-memory snapshots (else they go when the process exits normally)."""
        self._close(over=False)

    def _close(self, over: bool) -> None:
        self._close_iter()
        self.evaluation.close()
        self.metrics.close()
        self.persistence.close(over)  # over: training ended (its snapshots go at exit)

    @property
    def session(self) -> TrainerSession:
        """The object the seed's TensorLayer loop asks, in every mode:
        ``while not trainer.session.should_stop(): trainer.train_on_batch()``."""
        return TrainerSession(self)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank (non-finite, fp16 overflow); restored on resume."""
        return self.state.skipped_steps

    @property
    def model(self) -> nn.Module | None:
        """The model being trained on this rank, when the strategy exposes it."""
        return getattr(self.strategy, "model", None)

    # TensorLayer's names
    @property
    def global_step(self) -> int:
        """Training steps taken so far (TensorLayer's name for ``state.step``)."""
        return self.state.step

    @property
    def training_network(self) -> nn.Module | None:
        """TensorLayer's name for :attr:`model`."""
        return self.model

    @property
    def validation_metrics(self) -> list[tuple[str, float]]:
        """TensorLayer's ``[(name, value), ...]``: :meth:`validate` on the validation set
        (every rank must read it together)."""
        return list(self.validate().items())


# The signature users see (help(), IDEs, inspect): the configuration's fields.
Trainer.__signature__ = inspect.signature(TrainerConfig)  # type: ignore[attr-defined]


class TrainerSession:
    """``trainer.session``: TensorLayer's training-session handle, a view of its Trainer.

    Args:
        trainer: The Trainer whose loop this session reports on.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def should_stop(self) -> bool:
        """Same as :meth:`Trainer.should_stop` (serves on parameter-server ranks)."""
        return self.trainer.should_stop()
