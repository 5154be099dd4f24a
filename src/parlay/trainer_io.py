"""The Trainer's input and output across runs: validation over the replicas (and the loop that
trains with validation in between), disk checkpoints and in-memory snapshots. A mixin of
:class:`parlay.trainer.Trainer`, kept apart so the loop reads at a glance; it uses the
Trainer's attributes (``strategy``, ``state``, ``sampler``, ``metrics``, ``_ckpt``, ...) and
has no state of its own."""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import asdict
from typing import Any, Callable

import torch.nn as nn
from torch.utils.data import Dataset

from parlay import comm, runtime
from parlay.checkpoint import CheckpointManager, rng_state, set_rng_state
from parlay.data.loader import build_loader
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError, ConfigError
from parlay.runinfo import trainer_identity
from parlay.snapshot import open_for_trainer, optimizer_tensors, resume_trainer
from parlay.trainer_support import TrainerState, check_positive, evaluate, reduce_metrics

__all__ = ["TrainerIO"]

log = logging.getLogger("parlay")


class TrainerIO:
    """Validation, checkpoints and snapshots of a :class:`~parlay.trainer.Trainer`."""

    strategy: Any
    state: TrainerState
    sampler: ShardedSampler
    metrics: Any
    mode: str
    batch_size: int
    steps_per_epoch: int
    validation_dataset: Dataset | None
    _ckpt: CheckpointManager | None
    _snap: Any
    _val_loader: Any
    _last_ckpt_step: int
    _stopped: bool
    model: nn.Module | None
    train_on_batch: Callable[[], Any]
    should_stop: Callable[[], bool]
    _reached_end: Callable[[], bool]

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
        sums, count = evaluate(s, loader, self._metric_fn)
        if loader is not self._val_loader:
            loader.close()
        if not s.reports_loss:
            return {}
        result = reduce_metrics(sums, count, s.dp_group)
        self.metrics.validation(self.state.step, self.state.step / self.steps_per_epoch, result,
                                seconds=time.perf_counter() - t0)
        return result

    def train_and_validate_to_end(self, validate_every: int | None = None) -> dict[str, float]:
        """Train until :meth:`should_stop`, validating every ``validate_every`` steps (default:
        at every epoch end) and at the end.

        Returns:
            The last validation metrics (empty without a validation set, or on ranks that
            do not report metrics).
        """
        check_positive("validate_every", validate_every)
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

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        """Write a checkpoint of everything stateful now (every training rank must call it)."""
        if self._ckpt is None:
            raise ConfigError("save_checkpoint() needs checkpoint_dir=... on the Trainer.")
        inf_ok = {b.data_ptr() for b in self.model.buffers()} if self.model is not None else set()
        self._ckpt.save(self.state.step, self._training_state(),  # -inf masks are fine
                        allow_inf=lambda t: t.data_ptr() in inf_ok)
        self._last_ckpt_step = self.state.step

    def _training_state(self, snapshot: bool = False) -> dict[str, Any]:
        """Everything stateful on this rank, as checkpoints and snapshots store it (a strategy
        may state a snapshot differently: ps workers do not ask the servers to save)."""
        s = self.strategy
        strategy = (s.snapshot_state_dict() if snapshot and hasattr(s, "snapshot_state_dict")
                    else s.state_dict())
        return {"trainer": asdict(self.state), "mode": self.mode, "strategy": strategy,
                "sampler": self.sampler.state_dict(), "rng": rng_state()}

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
        store = self._snap = open_for_trainer(self, every)
        if store is None:
            return
        self.resumed_from_snapshot = resume_trainer(self, store)
        if self.resumed_from_snapshot is not None:
            log.info("resumed from the in-memory snapshot of step %d", self.resumed_from_snapshot)

    def _snapshot_after_step(self) -> None:
        if self._snap is None or self.state.step % self.snapshot_every:
            return
        try:
            self._snap.save(self.state.step, self._training_state(snapshot=True),
                            defer=optimizer_tensors(self.strategy))
        except CheckpointError as e:  # snapshots are a speed-up: training goes on without
            self._snap = None
            warnings.warn(f"in-memory snapshots stopped on rank {runtime.rank()}: {e}",
                          stacklevel=3)

    def _open_checkpoints(self, checkpoint_dir: str | None, keep_last: int, model: nn.Module,
                          snapshot_every: int | None) -> None:
        """Lock and resume from ``checkpoint_dir``, then from a newer in-memory snapshot."""
        s = self.strategy
        self._last_ckpt_step = -1
        self._ckpt = (CheckpointManager(checkpoint_dir, keep_last, rank=runtime.rank(),
                                        group=s.train_group, lock=True,
                                        identity=trainer_identity(s, self.mode, self.batch_size,
                                                                  model))
                      if checkpoint_dir is not None and s.consumes_data else None)
        if self._ckpt is not None:
            resumed = self._ckpt.load_latest()
            if resumed is not None:
                self._load(resumed)
            # Saves may agree over fewer ranks than the resume (ps async/stale: each worker).
            self._ckpt.group = getattr(s, "checkpoint_group", s.train_group)
        self._resume_from_snapshot(snapshot_every)
