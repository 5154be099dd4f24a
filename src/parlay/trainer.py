"""Trainer: a model and a dataset in, distributed training out, in any mode.

The Trainer never branches on the mode. It asks :func:`parlay.strategies.get_strategy` for one
and drives it: shard the data over ``strategy.dp_size`` replicas, scale the learning rate,
step, log, validate, checkpoint, resume. Parameter-server ranks serve inside
:meth:`Trainer.should_stop` and return ``True`` when the workers are done.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from parlay import comm, runtime
from parlay.checkpoint import CheckpointManager, rng_state, set_rng_state
from parlay.data.loader import build_loader
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError, ConfigError, NonFiniteError
from parlay.metrics import MetricsLogger, default_metrics
from parlay.nonfinite import NonFiniteGuard, check_policy, with_step
from parlay.runinfo import trainer_identity
from parlay.snapshot import open_for_trainer, optimizer_tensors, resume_trainer
from parlay.strategies import StepResult, Strategy, get_strategy

__all__ = ["Trainer", "TrainerState", "TrainerSession"]

log = logging.getLogger("parlay")

_SCHEDULES = ("constant", "cosine")


@dataclass
class TrainerState:
    """Where training stands (identical on every training rank).

    Attributes:
        epoch: Current epoch (0-based; equals ``num_epochs`` when training is over).
        step: Optimizer steps taken.
        samples_seen: Training samples consumed over all replicas.
        batch_in_epoch: Batches of the current epoch already consumed by each replica.
    """

    epoch: int = 0
    step: int = 0
    samples_seen: int = 0
    batch_in_epoch: int = 0


def _default_lr(optimizer: type) -> Any:
    try:
        p = inspect.signature(optimizer).parameters.get("lr")
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def _positive(name: str, value: Any, allow_none: bool = True, kind: type = int) -> None:
    if value is None and allow_none:
        return
    number = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not number or not value > 0:
        raise ConfigError(f"{name} must be a positive {kind.__name__}"
                          f"{' or None' if allow_none else ''}, got {value!r}.")


def _reduce_metrics(sums: dict[str, float], count: int, group: Any) -> dict[str, float]:
    """Sample-weighted means of ``sums`` over ``group``, in tensors only (no peer's bytes are
    unpickled). Ranks without samples take the others' metric names; ranks with samples must
    agree on them (checked with one max over the UTF-8 codes and one over their negation)."""
    names = sorted(sums) if count else []
    if comm.group_size(group) > 1:
        code = torch.tensor(list("\0".join(names).encode()), dtype=torch.int64)
        width = comm.allreduce(torch.tensor([code.numel()]), "max", group=group)
        both = torch.full((2, max(1, int(width.item()))), -1, dtype=torch.int64)
        if names:
            both[0].fill_(256)  # padding differs from every byte: lengths must agree too
            both[0, : code.numel()] = code
            both[1] = -both[0]
        else:
            both[1].fill_(-1000)  # below any -code: ranks without samples do not vote
        comm.allreduce(both, "max", group=group)
        hi, lo = both[0], -both[1]
        if not torch.equal(hi, lo) and bool((hi >= 0).any()):
            raise ConfigError(f"the replicas computed different validation metrics (this rank: "
                              f"{names}). Hint: build_validation_func must return the same "
                              "keys on every rank.")
        raw = bytes(int(b) for b in hi.tolist() if 0 <= b < 256)
        names = raw.decode().split("\0") if raw else []
    vec = torch.tensor([float(count)] + [sums.get(n, 0.0) for n in names], dtype=torch.float64)
    if comm.group_size(group) > 1:
        comm.allreduce(vec, "sum", group=group)
    total = vec[0].item()
    result = {n: vec[i + 1].item() / max(total, 1.0) for i, n in enumerate(names)}
    result["samples"] = float(total)
    return result


class Trainer:
    """Train ``build_training_func()``'s model on ``training_dataset`` across all processes.

    Args:
        build_training_func: Returns ``(model, loss_fn)`` with ``loss_fn(output, target)``;
            called on every rank (the same function serves every mode).
        training_dataset: A map-style dataset of ``(input, target)`` pairs.
        optimizer: A ``torch.optim.Optimizer`` class.
        optimizer_args: Its keyword arguments (``lr`` is the single-replica learning rate).
        batch_size: Samples per batch *per data-parallel replica*.
        mode: A registered strategy: ``"allreduce"``, ``"ps"`` or ``"hybrid"``.
        num_epochs: Stop after this many epochs (with neither limit: one epoch).
        max_iteration: Stop after this many optimizer steps in total.
        scaling_learning_rate: Multiply the learning rate by the number of replicas (Goyal
            et al. 2017, "Accurate, Large Minibatch SGD"), reached by a linear warm-up.
        warmup_epochs: Length of that warm-up, in epochs (may be fractional; 0: none).
        compression: Gradient compressor name or object (e.g. ``"fp16"``, ``"topk:0.01"``).
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        checkpoint_dir: Save checkpoints here and resume from the latest valid one.
        checkpoint_every: Steps between checkpoints (None: at every epoch end). A final one
            is always written when training stops.
        validation_dataset: Dataset for :meth:`validate`.
        build_validation_func: Returns ``fn(output, target) -> dict[str, tensor]`` of batch
            means (default: loss and, for class scores, accuracy).
        log_step_size: Steps between (reduced) loss logs.
        prefetch: Batches loaded ahead (per worker with ``num_workers``, else by a thread);
            None: 2, or inline for in-memory tensor datasets (see :func:`build_loader`).
        keep_last: Checkpoints kept.
        metrics_path: JSONL metrics file (default: ``<checkpoint_dir>/metrics.jsonl`` when
            checkpointing, else none).
        num_workers: DataLoader worker processes (0: a loading thread in this process).
        seed: Seeds model construction and the data order (same on every rank); None leaves
            the global RNG alone (data order then uses seed 0).
        grad_clip: Clip the global gradient norm (after averaging) to this value.
        progress: Show the progress bar on the printing rank.
        shuffle: Shuffle the training data each epoch.
        drop_last: Drop the dataset's tail instead of padding it (see ShardedSampler).
        validation_batch_size: Batch size for validation (default: ``batch_size``).
        lr_schedule: After the warm-up, ``"constant"`` or ``"cosine"`` (decay to 0 at the
            last step, Loshchilov & Hutter 2017).
        strategy_options: Extra keyword options for the mode (e.g. ``{"consistency": "async"}``).
        nonfinite: A step whose loss or averaged gradient holds a NaN or an infinity:
            ``"raise"`` a :class:`~parlay.errors.NonFiniteError` on every rank before the
            update (naming the step, rank and parameter), or ``"skip"`` it identically on
            every rank (counted in ``skipped_steps``). fp16 keeps GradScaler's overflow skips.
        snapshot_every: Steps between in-memory snapshots of every rank's training state (host
            shared memory, written off the critical path; 0/None: off). A job restarted by
            ``parlay run --max-restarts`` resumes from the newest one every rank holds when
            it is newer than the disk checkpoint, so it loses at most one step (see
            :mod:`parlay.snapshot`).

    Raises:
        ConfigError: Bad arguments (with the expected value and a hint).
        CheckpointError: ``checkpoint_dir`` holds checkpoints of an incompatible run.
    """

    def __init__(self, build_training_func: Callable[[], tuple[nn.Module, Callable[..., Any]]],
                 training_dataset: Dataset, optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
                 optimizer_args: dict[str, Any] | None = None, batch_size: int = 32,
                 mode: str = "allreduce", num_epochs: int | None = None,
                 max_iteration: int | None = None, scaling_learning_rate: bool = True,
                 warmup_epochs: float = 1.0, compression: Any = None, precision: str = "fp32",
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                 validation_dataset: Dataset | None = None,
                 build_validation_func: Callable[[], Callable[..., dict[str, Any]]] | None = None,
                 log_step_size: int = 50, prefetch: int | None = None, *, keep_last: int = 3,
                 metrics_path: str | None = None, num_workers: int = 0, seed: int | None = 0,
                 grad_clip: float | None = None, progress: bool = True, shuffle: bool = True,
                 drop_last: bool = False, validation_batch_size: int | None = None,
                 lr_schedule: str = "constant", nonfinite: str = "raise",
                 strategy_options: dict[str, Any] | None = None,
                 snapshot_every: int | None = 1) -> None:
        if not callable(build_training_func):
            raise ConfigError("build_training_func must be a function returning (model, loss_fn).")
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer class (e.g. "
                              f"torch.optim.Adam), got {optimizer!r}.")
        for name, v in (("batch_size", batch_size), ("log_step_size", log_step_size)):
            _positive(name, v, allow_none=False)
        for name, opt_v in (("num_epochs", num_epochs), ("max_iteration", max_iteration),
                            ("checkpoint_every", checkpoint_every),
                            ("validation_batch_size", validation_batch_size)):
            _positive(name, opt_v)
        if not (isinstance(warmup_epochs, (int, float)) and warmup_epochs >= 0):
            raise ConfigError(f"warmup_epochs must be a number >= 0, got {warmup_epochs!r}.")
        if lr_schedule not in _SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {_SCHEDULES}, got {lr_schedule!r}.")
        check_policy(nonfinite)
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"seed must be an int >= 0 or None, got {seed!r}.")
        if not runtime.is_initialized():
            runtime.init()
        self.mode = mode
        self.lr_schedule = lr_schedule
        self.batch_size = batch_size
        self.num_epochs = num_epochs if (num_epochs or max_iteration) else 1
        self.max_iteration = max_iteration
        self.log_step_size = log_step_size
        self.checkpoint_every = checkpoint_every
        self.validation_dataset = validation_dataset
        self.state = TrainerState()
        self.strategy: Strategy = get_strategy(mode, compression=compression, precision=precision,
                                               grad_clip=grad_clip, **(strategy_options or {}))
        s = self.strategy
        if hasattr(s, "guard"):  # strategies that check for NaN/inf steps
            s.guard = NonFiniteGuard(nonfinite)
        self.skipped_steps = 0
        if seed is not None:
            torch.manual_seed(seed)
        built = build_training_func()
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)
                and callable(built[1])):
            raise ConfigError(f"build_training_func() must return (model, loss_fn) with an "
                              f"nn.Module and a callable loss_fn(output, target), got "
                              f"{type(built).__name__}. Hint: return model, nn.CrossEntropyLoss().")
        model, self.loss_fn = built
        if checkpoint_dir is not None:
            s.use_checkpoint_dir(str(checkpoint_dir))
        s.setup(model, self.loss_fn, optimizer, dict(optimizer_args or {}))
        if seed is not None:  # distinct dropout masks per rank, reproducible per run
            torch.manual_seed(seed + 1 + runtime.rank())
        self._metric_fn = (build_validation_func() if build_validation_func is not None
                           else default_metrics(self.loss_fn))
        try:
            n = len(training_dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError("training_dataset must be a map-style Dataset with __len__.") from None
        dev = runtime.device()
        self._val_batch = validation_batch_size or batch_size
        self._val_loader: Any = None
        self._num_workers, self._prefetch = num_workers, prefetch
        self._pin = dev.type == "cuda"
        self.sampler = ShardedSampler(n, s.dp_size, s.dp_rank, shuffle=shuffle, seed=seed or 0,
                                      drop_last=drop_last)
        self.loader = (build_loader(training_dataset, self.sampler, batch_size,
                                    num_workers=num_workers, prefetch=prefetch, pin_memory=self._pin)
                       if s.consumes_data else None)
        self.steps_per_epoch = math.ceil(len(self.sampler) / batch_size)
        self.lr_scale = float(s.dp_size) if scaling_learning_rate else 1.0
        self.warmup_steps = round(warmup_epochs * self.steps_per_epoch) if self.lr_scale != 1 else 0
        self._it: Any = None
        self.last_step: StepResult | None = None
        self._stopped = False
        self._last_ckpt_step = -1
        self._ckpt = (CheckpointManager(checkpoint_dir, keep_last, rank=runtime.rank(),
                                        group=s.train_group, lock=True,
                                        identity=trainer_identity(s, mode, batch_size, model))
                      if checkpoint_dir is not None and s.consumes_data else None)
        if self._ckpt is not None:
            resumed = self._ckpt.load_latest()
            if resumed is not None:
                self._load(resumed)
            # Saves may agree over fewer ranks than the resume (ps async/stale: each worker).
            self._ckpt.group = getattr(s, "checkpoint_group", s.train_group)
        self._resume_from_snapshot(snapshot_every)
        printer = False
        if s.consumes_data:  # the lowest rank that reports a loss (else the lowest one)
            me = runtime.rank()
            low = torch.tensor([me if s.reports_loss else 2 ** 62, me], dtype=torch.int64)
            if comm.group_size(s.train_group) > 1:
                comm.allreduce(low, "min", group=s.train_group)
            printer = me == (int(low[0]) if int(low[0]) != 2 ** 62 else int(low[1]))
        full, rest = divmod(self.total_steps, self.steps_per_epoch)
        total = full * self.sampler.total_size + rest * batch_size * s.dp_size
        if metrics_path is None and checkpoint_dir is not None:
            metrics_path = f"{checkpoint_dir}/metrics.jsonl"
        self.metrics = MetricsLogger(printer=printer, reduces=s.reports_loss and s.consumes_data,
                                     group=s.dp_group, total_samples=total,
                                     initial_samples=self.state.samples_seen,
                                     jsonl_path=metrics_path, progress=progress)
        base = (optimizer_args or {}).get("lr", _default_lr(optimizer))
        msg = (f"parlay Trainer: mode={mode}, {s.dp_size} replica(s) x batch {batch_size} = "
               f"{batch_size * s.dp_size} samples/step, {self.steps_per_epoch} steps/epoch, "
               f"{self.total_steps} steps; learning rate x{self.lr_scale:g} "
               + (f"(linear scaling, warm-up over {self.warmup_steps} steps = {warmup_epochs:g} "
                  f"epoch(s) from x1; base lr {base})" if self.lr_scale != 1
                  else "(no scaling)")
               + f"; precision={precision}, compression={compression}"
               + (f"; resumed at step {self.state.step}, epoch {self.state.epoch}"
                  if self.state.step else ""))
        log.info(msg)
        self.metrics.print(msg)
        self.metrics.write("start", mode=mode, dp_size=s.dp_size, batch_size=batch_size,
                           lr_scale=self.lr_scale, warmup_steps=self.warmup_steps,
                           step=self.state.step, epoch=self.state.epoch)

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
        n = len(y)
        st = self.state
        st.step += 1
        st.samples_seen += n * s.dp_size
        st.batch_in_epoch += 1
        self.sampler.advance(n)
        self.metrics.step(res.loss if res.loss is None or math.isfinite(res.loss) else None,
                          n, n * s.dp_size)
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
        return res.loss

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

    def train_and_validate_to_end(self, validate_every: int | None = None) -> dict[str, float]:
        """Train until :meth:`should_stop`, validating every ``validate_every`` steps (default:
        at every epoch end) and at the end.

        Returns:
            The last validation metrics (empty without a validation set, or on ranks that
            do not report metrics).
        """
        _positive("validate_every", validate_every)
        last: dict[str, float] = {}
        validated_at = -1
        while not self._stopped and not self._reached_end():
            if not self.strategy.consumes_data:
                break
            epoch = self.state.epoch
            self.train_on_batch()
            due = (self.state.step % validate_every == 0 if validate_every
                   else self.state.epoch != epoch)
            if self.validation_dataset is not None and due:
                last, validated_at = self.validate(), self.state.step
        if (self.validation_dataset is not None and self.strategy.consumes_data
                and validated_at != self.state.step and not self._stopped):
            last = self.validate()
        self.should_stop()
        return last

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
        ds = dataset if dataset is not None else self.validation_dataset
        if ds is None:
            raise ConfigError("validate() needs a dataset: pass validation_dataset=... to the "
                              "Trainer or validate(dataset).")
        s = self.strategy
        if not s.consumes_data:
            return {}
        t0 = time.perf_counter()
        if dataset is None and self._val_loader is not None:
            loader = self._val_loader
        else:
            alone = s.reports_loss and s.dp_size > 1 and comm.group_size(s.dp_group) == 1
            shards, index = (1, 0) if alone else (s.dp_size, s.dp_rank)
            sampler = ShardedSampler(len(ds), shards, index, shuffle=False, even=False)  # type: ignore[arg-type]
            loader = build_loader(ds, sampler, self._val_batch, num_workers=self._num_workers,
                                  prefetch=self._prefetch, pin_memory=self._pin)
            if dataset is None:
                self._val_loader = loader
        sums: dict[str, float] = {}
        count = 0
        for x, y in loader:
            out = s.eval_forward(x)
            if out is None or not s.reports_loss:
                continue
            y = y.to(out.device) if isinstance(y, torch.Tensor) else y
            vals = self._metric_fn(out, y)
            k = len(y)
            for name, v in vals.items():
                sums[name] = sums.get(name, 0.0) + float(torch.as_tensor(v).double()) * k
            count += k
        if loader is not self._val_loader:
            loader.close()
        if not s.reports_loss:
            return {}
        result = _reduce_metrics(sums, count, s.dp_group)
        self.metrics.validation(self.state.step, self.state.step / self.steps_per_epoch, result,
                                seconds=time.perf_counter() - t0)
        return result

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        """Write a checkpoint of everything stateful now (every training rank must call it)."""
        if self._ckpt is None:
            raise ConfigError("save_checkpoint() needs checkpoint_dir=... on the Trainer.")
        inf_ok = {b.data_ptr() for b in self.model.buffers()} if self.model is not None else set()
        self._ckpt.save(self.state.step, self._training_state(),  # -inf masks are fine
                        allow_inf=lambda t: t.data_ptr() in inf_ok)
        self._last_ckpt_step = self.state.step

    def _training_state(self) -> dict[str, Any]:
        """Everything stateful on this rank, as checkpoints and snapshots store it."""
        return {"trainer": asdict(self.state), "mode": self.mode,
                "strategy": self.strategy.state_dict(), "sampler": self.sampler.state_dict(),
                "rng": rng_state()}

    def _note_skip(self) -> None:
        self.skipped_steps += 1
        msg = (f"step {self.state.step + 1} was skipped on every rank: its loss or gradient was "
               f"not finite ({self.skipped_steps} skipped so far; under fp16 a loss-scale "
               "overflow, which GradScaler expects now and then)")
        log.warning(msg)
        self.metrics.write("skipped_step", step=self.state.step + 1,
                           skipped_steps=self.skipped_steps)

    def _load(self, ck: dict[str, Any]) -> None:
        if ck.get("mode") != self.mode:
            raise CheckpointError(f"the checkpoint in {self._ckpt.directory} was written in mode "  # type: ignore[union-attr]
                                  f"{ck.get('mode')!r}, this Trainer runs mode {self.mode!r}. "
                                  "Hint: use a fresh checkpoint_dir for a different mode.")
        self.sampler.load_state_dict(ck["sampler"])
        try:
            self.strategy.load_state_dict(ck["strategy"])
        except (RuntimeError, KeyError, ValueError) as e:  # torch's shape errors, ConfigError
            first = " ".join(str(e).split())[:300]  # torch's first line alone says little
            raise CheckpointError(f"the checkpoint does not fit this model ({type(e).__name__}: "
                                  f"{first}). Hint: build the same model (and mode, pp, balance) "
                                  "as the run that wrote it, or use a fresh checkpoint_dir.") from e
        self.state = TrainerState(**ck["trainer"])
        set_rng_state(ck["rng"])
        self._last_ckpt_step = self.state.step

    # ------------------------------------------------------------------ in-memory snapshots
    def _resume_from_snapshot(self, every: int | None) -> None:
        """Open this rank's snapshot store and continue from the newest step every training
        rank holds, when it is newer than the disk checkpoint already loaded."""
        self.snapshot_every = every or 0
        self.resumed_from_snapshot: int | None = None
        self._snap = open_for_trainer(self, every)
        if self._snap is None:
            return
        self.resumed_from_snapshot = resume_trainer(self, self._snap)
        if self.resumed_from_snapshot is not None:
            log.info("resumed from the in-memory snapshot of step %d", self.resumed_from_snapshot)

    def _snapshot_after_step(self) -> None:
        if self._snap is None or self.state.step % self.snapshot_every:
            return
        try:
            self._snap.save(self.state.step, self._training_state(),
                            defer=optimizer_tensors(self.strategy))
        except CheckpointError as e:  # snapshots are a speed-up: training goes on without
            self._snap = None
            warnings.warn(f"in-memory snapshots stopped on rank {runtime.rank()}: {e}",
                          stacklevel=3)

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
    def model(self) -> nn.Module | None:
        """The model being trained on this rank, when the strategy exposes it."""
        return getattr(self.strategy, "model", None)


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
