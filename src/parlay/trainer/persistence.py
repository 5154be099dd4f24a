"""The Trainer's state across runs: disk checkpoints and in-memory snapshots.

:class:`Persistence` owns both stores, decides when each is due, and is the
:class:`~parlay.snapshot.resume.TrainingRun` that checkpoints and snapshots save and resume:
its ``state_dict`` is everything stateful on the rank (counters, strategy, sampler, RNG).
With ``snapshot_every="auto"`` it times the first steps with a snapshot each and then without,
and keeps the smallest interval at which snapshots cost at most 2% of training.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from parlay import _tree, comm, runtime
from parlay.checkpoint import CheckpointManager, rng_state, set_rng_state
from parlay.data.sampler import ShardedSampler
from parlay.dp.shard_dcp import load_dcp, save_dcp
from parlay.errors import CheckpointError, ConfigError, ReplicaDivergence
from parlay.runinfo import recipe_difference, same_numbers, stable_repr, trainer_identity
from parlay.snapshot import (
    SnapshotStore,
    open_for_trainer,
    optimizer_tensors,
    resume_trainer,
)
from parlay.strategies import Strategy
from parlay.trainer.config import AUTO, TrainerConfig, TrainerState
from parlay.trainer.replicas import ReplicaCheck
from parlay.trainer.reshard import load_resharded

__all__ = ["Persistence", "choose_interval", "check_same_settings", "shaped", "BUDGET",
           "PROBE_STEPS"]

log = logging.getLogger("parlay")

#: Largest share of training time the automatic snapshot interval lets snapshots take.
BUDGET = 0.02
#: Steps timed with a snapshot each, and then as many without, to choose the automatic interval
#: (after as many steps that snapshot untimed: the first save into each of the store's slots
#: also creates its file). A snapshot's cost is the difference, not the copy's time alone: the
#: deferred copy shares the memory bus and the caches with the step it overlaps.
PROBE_STEPS = 4


def choose_interval(copy_s: float, step_s: float, budget: float = BUDGET) -> int:
    """The smallest snapshot interval K (>= 1) at which a snapshot of ``copy_s`` seconds every
    K steps of ``step_s`` (> 0) seconds costs at most ``budget`` of the training time."""
    return max(1, math.ceil(copy_s / (budget * step_s) - 1e-9))


def recipe(config: TrainerConfig, sampler: ShardedSampler) -> dict[str, str]:
    """The settings a checkpoint or snapshot must have been written with to be continued by
    this run, as stable strings (part of the run's identity). Not the length of training:
    raising ``num_epochs`` and resuming is how a run is extended; nor the values of hybrid's
    example input (``sample``, by its shapes), which a restart may draw anew."""
    c = config
    fields = {"optimizer": c.optimizer, "optimizer_args": c.optimizer_args or {},
              "lr_schedule": c.lr_schedule, "warmup_epochs": c.warmup_epochs,
              "scaling_learning_rate": c.scaling_learning_rate, "precision": c.precision,
              "compression": c.compression, "grad_clip": c.grad_clip, "nonfinite": c.nonfinite,
              "shard": c.shard, "strategy_options": shaped(c.strategy_options),
              "dataset_size": sampler.n,
              "seed": sampler.seed, "shuffle": sampler.shuffle, "drop_last": sampler.drop_last}
    return {k: stable_repr(v) for k, v in fields.items()}


def shaped(options: dict[str, Any] | None) -> dict[str, Any]:
    """``strategy_options`` as the ranks must agree on them: hybrid's ``sample`` (an example
    input to trace and time the model with) by its shapes, as each rank may draw its own."""
    o = dict(options or {})
    if "sample" in o:
        o["sample"] = _tree.map_tensors(lambda t: f"tensor{tuple(t.shape)}", o["sample"])
    return o


def check_same_settings(settings: dict[str, str], group: Any) -> None:
    """Every training rank must start with the same settings (one allgather of their hashes):
    ranks apart on the dataset or the batch size would step out of turn and meet in
    mismatched collectives, which gloo answers with an abort.

    Raises:
        ConfigError: On every rank, naming the first setting that differs.
    """
    keys = sorted(settings)
    mine = [int(hashlib.sha256(f"{k}={same_numbers(settings[k])}".encode()).hexdigest()[:15], 16)
            for k in keys]
    rows = comm.gather_ints(mine, len(keys), group)
    for i, k in enumerate(keys):
        apart = [comm.to_global_rank(group, r) for r, row in enumerate(rows)
                 if row[i] != rows[0][i]]
        if apart:
            raise ConfigError(
                f"the training ranks start with different settings: {k} on rank(s) "
                f"{', '.join(map(str, apart))} differs from rank {comm.to_global_rank(group, 0)}'s "
                f"(this rank: {k}={settings[k]}). Hint: build the same dataset and pass the same "
                "Trainer arguments on every rank.")


class Persistence:
    """Checkpoints and snapshots of one rank's training run; resumes on construction.

    Args:
        config: The Trainer's options (``checkpoint_dir``, ``checkpoint_every``,
            ``keep_last``, ``snapshot_every``, ``mode``, ``batch_size``).
        strategy: The run's strategy, set up.
        sampler: The training data's sampler.
        state: The Trainer's counters (updated in place on resume).
        layout: The model's layout as built (:func:`~parlay.runinfo.model_layout`): part of
            the checkpoints' identity.
        report: Shows a line on the printing rank (the interval chosen, steps at risk).

    Raises:
        CheckpointError: ``checkpoint_dir`` holds checkpoints of an incompatible run.
    """

    def __init__(self, config: TrainerConfig, strategy: Strategy, sampler: ShardedSampler,
                 state: TrainerState, layout: list[list[Any]],
                 report: Callable[[str], None]) -> None:
        self.strategy, self.sampler, self.state = strategy, sampler, state
        #: The epoch's and log window's metrics so far, saved with the state (the Trainer
        #: sets it), and as resumed (None: none resumed).
        self.epoch_so_far: Callable[[], list[float]] = lambda: [0.0, 0.0, 0]
        self.resumed_metrics: list[float] | None = None
        self.mode, self.batch_size = config.mode, config.batch_size
        self.recipe = recipe(config, sampler)
        if strategy.consumes_data:  # and what decides when the ranks meet
            c = config
            check_same_settings({**self.recipe, **{k: stable_repr(v) for k, v in {
                "batch_size": c.batch_size, "num_epochs": c.num_epochs,
                "max_iteration": c.max_iteration, "log_step_size": c.log_step_size,
                "checkpoint_every": c.checkpoint_every, "snapshot_every": c.snapshot_every,
                "replica_check": c.replica_check,
                "checkpoints": c.checkpoint_dir is not None}.items()}}, strategy.train_group)
        self.checkpoint_every = config.checkpoint_every
        self._report = report
        self.last_checkpoint_step = -1
        self._ended = False  # training ended (close(over=True)): the next close clears
        self.checkpoints = self._open_checkpoints(config, layout)
        auto = config.snapshot_every == AUTO
        # Auto probes every step; strategies whose servers snapshot in step keep 1 throughout.
        self.every: int = 1 if auto else int(config.snapshot_every or 0)  # type: ignore[arg-type]
        self.store: SnapshotStore | None = open_for_trainer(self, self.every)
        self._probe: list[float] | None = (
            [] if auto and self.store is not None
            and not strategy.agrees_snapshots_early else None)
        self.resumed_from_snapshot = (resume_trainer(self, self.store)
                                      if self.store is not None else None)
        if self.resumed_from_snapshot is not None:
            log.info("resumed from the in-memory snapshot of step %d", self.resumed_from_snapshot)
        if self.store is None:
            self.every = 0
        # Ranks that meet only at collectives resume apart (see snapshot.resume.agree).
        self._apart = self.store is not None and strategy.resumes_apart
        self._issued = comm.issued()
        self.replicas = ReplicaCheck(strategy, config.replica_check or 0, self.state.step)
        if self.state.step and self.replicas.every:  # resumed: do the replicas agree?
            self._check_replicas(self.state.step)

    def _open_checkpoints(self, config: TrainerConfig,
                          layout: list[list[Any]]) -> CheckpointManager | None:
        """Lock ``checkpoint_dir`` and resume from its newest checkpoint every rank holds."""
        s = self.strategy
        if config.checkpoint_dir is None or not s.consumes_data:
            return None
        ckpt = CheckpointManager(config.checkpoint_dir, config.keep_last, rank=runtime.rank(),
                                 group=s.train_group, lock=True,
                                 identity=trainer_identity(s, self.mode, self.batch_size, layout,
                                                           self.recipe))
        sharded = s.sharded_checkpoint
        if sharded is not None and sharded[1]:  # a stage's files are checked by its replicas
            group = sharded[0].process_group
            ckpt.dcp_share = (comm.group_rank(group), comm.group_size(group))
        rank = comm.group_rank(s.train_group)
        resumed = load_resharded(ckpt, ckpt.identity or {}, comm.group_size(s.train_group),
                                 rank, getattr(getattr(s, "optimizer", None), "shard_rank", rank)) \
            if config.reshard else None
        if resumed is None:
            resumed = ckpt.load_latest(newest=s.newest_checkpoint)
        if resumed is not None:
            failed: CheckpointError | None = None
            try:
                self.load_state_dict(resumed, where=str(ckpt.directory))
            except CheckpointError as e:
                failed = e
            if not comm.all_ok(failed is None, s.train_group):  # every rank refuses together
                ckpt.close()
                raise failed or CheckpointError(
                    f"the checkpoint in {ckpt.directory} does not fit on another rank (see "
                    "that rank's error). Nothing was deleted.")
            if "dcp" in resumed and sharded:  # the shards, at this world (verified by ckpt)
                try:
                    load_dcp(sharded[0], str(ckpt.dcp_path(resumed["step"]) / sharded[1]))
                except ConfigError as e:
                    raise CheckpointError(f"the checkpoint does not fit this model: {e}") from e
            self.last_checkpoint_step = self.state.step
        # Saves may agree over fewer ranks than the resume (ps async/stale: each worker).
        ckpt.group = s.checkpoint_group
        return ckpt

    # ------------------------------------------------------------------ the training state
    @property
    def step(self) -> int:
        return self.state.step

    def state_dict(self, snapshot: bool = False) -> dict[str, Any]:
        """Everything stateful on this rank, as checkpoints and snapshots store it (a strategy
        may state a snapshot differently: ps workers do not ask the servers to save)."""
        s = self.strategy
        strategy = s.snapshot_state_dict() if snapshot else s.state_dict()
        return {"trainer": asdict(self.state), "mode": self.mode, "strategy": strategy,
                "sampler": self.sampler.state_dict(), "rng": rng_state(), "recipe": self.recipe,
                "collectives": comm.issued(), "metrics": self.epoch_so_far()}

    def load_state_dict(self, state: dict[str, Any], where: str = "snapshot") -> None:
        """Continue from ``state``.

        Raises:
            CheckpointError: It was written in another mode or does not fit the model.
        """
        if state.get("mode") != self.mode:
            raise CheckpointError(f"the checkpoint in {where} was written in mode "
                                  f"{state.get('mode')!r}, this Trainer runs mode {self.mode!r}. "
                                  "Hint: use a fresh checkpoint_dir for a different mode.")
        changed = recipe_difference(state.get("recipe"), self.recipe, changeable=True)
        if changed:
            log.warning("resuming step %s (%s) with changed settings: %s",
                        state["trainer"].get("step"), where, changed)
        self.sampler.load_state_dict(state["sampler"])
        strategy = state["strategy"]
        if "dcp" in state:  # the chunks' tensors come from DCP after this: drop the entries
            opt = strategy["optimizer"]  # left empty (Adagrad reads any entry's "step")
            strategy = {**strategy, "optimizer": {
                **opt, "state": {k: e for k, e in opt["state"].items() if e}}}
        try:
            self.strategy.load_state_dict(strategy)
        except (RuntimeError, KeyError, ValueError) as e:  # torch's shape errors, ConfigError
            first = " ".join(str(e).split())[:300]  # torch's first line alone says little
            raise CheckpointError(f"the checkpoint does not fit this model ({type(e).__name__}: "
                                  f"{first}). Hint: build the same model (and mode, pp, balance) "
                                  "as the run that wrote it, or use a fresh checkpoint_dir.") from e
        vars(self.state).update(asdict(TrainerState(**state["trainer"])))
        self.resumed_metrics = state.get("metrics")  # (older states have none)
        set_rng_state(state["rng"])
        comm.set_issued(state.get("collectives", comm.issued()))

    # ------------------------------------------------------------------ saving
    def save_checkpoint(self) -> None:
        """Write a checkpoint of everything stateful now (every training rank must call it)."""
        if self.checkpoints is None:
            raise ConfigError("save_checkpoint() needs checkpoint_dir=... on the Trainer.")
        if self.replicas.every and self.replicas.agreed_at != self.state.step:
            self._check_replicas(self.state.step)  # only a state the replicas agree on is kept
        model = getattr(self.strategy, "model", None)
        inf_ok = {b.data_ptr() for b in model.buffers()} if model is not None else set()
        state, sharded, shards = self.state_dict(), self.strategy.sharded_checkpoint, None
        if sharded is not None:  # its chunks go to DCP, the rest to this rank's file
            opt, sub = sharded
            shards, sd = functools.partial(_save_shards, opt, sub), state["strategy"]["optimizer"]
            rest = {k: {n: v for n, v in e.items() if not isinstance(v, torch.Tensor)}
                    for k, e in sd["state"].items()}
            layout = {k: v for k, v in sd["parlay_shard"].items() if k != "params"}
            state["strategy"] = {**state["strategy"],
                                 "optimizer": {**sd, "state": rest, "parlay_shard": layout}}
        self.checkpoints.save(self.state.step, state, shards=shards,
                              allow_inf=lambda t: t.data_ptr() in inf_ok)  # -inf masks
        self.last_checkpoint_step = self.state.step

    def after_step(self, epoch_done: bool) -> None:
        """Checkpoint and snapshot when due (the Trainer calls it after every step)."""
        step = self.state.step
        if self.replicas.every and step >= self.replicas.next:
            self._check_replicas(step)  # before a diverged state is saved
        every = self.checkpoint_every
        if self.checkpoints is not None and (step % every == 0 if every else epoch_done):
            self.save_checkpoint()
        chosen = self._probe is not None and self._probe_step()
        self._snapshot(step, due=True, now=chosen)

    def begin_step(self) -> None:
        """A training step starts, or training ends (the Trainer calls it). Ranks that resume
        apart and met since the last step (an evaluation, say) first snapshot the step they
        are at again, so that its snapshot stands after that meeting too. (At the end: a rank
        that resumed at the last step meets there the others' first step.)"""
        self._snapshot(self.state.step, due=False)

    def _snapshot(self, step: int, due: bool, now: bool = False) -> None:
        """Snapshot ``step`` when ``due`` or when this rank met the others since the last
        call (ranks that resume apart), at the interval's steps (``now``: also between them,
        where the interval was just chosen). After such a meeting no rank goes on before
        every rank holds its snapshot committed, so a kill costs each rank at most one step;
        the barrier that ensures it is not counted, as those snapshots already stand after
        it."""
        met = self._apart and comm.issued() != self._issued
        if self.store is not None and self.every and (now or step % self.every == 0) \
                and (due or met):
            try:  # a rank lost before its own snapshot after the meeting needs the one before
                self.store.save(step, self.state_dict(snapshot=True),
                                defer=optimizer_tensors(self.strategy), replace=not met)
                if met:
                    self.store.wait()
            except CheckpointError as e:
                self._stop_snapshots(e)
        if met:
            n = comm.issued()
            comm.barrier(self.strategy.train_group)
            comm.set_issued(n)
            if self.store is not None:
                self.store.supersede(step)
        self._issued = comm.issued()

    def _check_replicas(self, step: int) -> None:
        """Compare the replicas now; when they diverged, this rank's snapshots after the last
        step they agreed on are deleted before the error propagates, so a restart resumes a
        state they agreed on (every checkpoint is one: it is written only after they agree).

        Raises:
            ReplicaDivergence: See :meth:`ReplicaCheck.check`.
        """
        try:
            self.replicas.check(step)
        except ReplicaDivergence:
            if self.store is not None:
                self.store.drop_after(self.replicas.agreed_at)
            raise

    def _stop_snapshots(self, error: CheckpointError) -> None:
        """Snapshots are a speed-up: training goes on without them, with a warning."""
        self.store, self.every = None, 0
        warnings.warn(f"in-memory snapshots stopped on rank {runtime.rank()}: {error}",
                      stacklevel=4)

    def _probe_step(self) -> bool:
        """Time the probe steps: ``PROBE_STEPS`` untimed and ``PROBE_STEPS`` timed with a
        snapshot each, then ``PROBE_STEPS`` without; then choose the interval (the largest any
        training rank asks for, so every rank snapshots the same steps). Whether it chose now
        (the caller snapshots this step: the next multiple of the interval is up to that many
        steps away, while the probe's last snapshot is ``PROBE_STEPS`` + 1 steps old)."""
        probe, p = self._probe, PROBE_STEPS
        assert probe is not None
        probe.append(time.perf_counter())  # probe[k - 1]: the end of the probe's step k
        if len(probe) == 2 * p:
            self.every = 0  # steps 2p+1 .. 3p carry no snapshot (step 2p's is skipped too)
        if len(probe) < 3 * p:
            return False
        with_snapshot = (probe[2 * p - 1] - probe[p - 1]) / p
        without = (probe[3 * p - 1] - probe[2 * p - 1]) / p
        copy = 0.0
        try:
            if self.store is not None:
                self.store.wait()
                copy = self.store.last_save_s or 0.0
        except CheckpointError as e:  # still agree below: the other ranks are waiting
            self._stop_snapshots(e)
        # Noise can make the difference smaller than the copy's own time: never below that.
        cost, step = max(with_snapshot - without, copy), max(without, 1e-9)
        want = choose_interval(cost, step)
        group = self.strategy.train_group
        k = torch.tensor([want], dtype=torch.int64, device=comm.group_device(group))
        if comm.group_size(group) > 1:
            comm.allreduce(k, "max", group=group)
        agreed, self._probe = int(k.item()), None
        if self.store is None:  # stopped here (warned): this rank's steps at risk are others
            return False
        self.every = agreed
        self._report(f"in-memory snapshots every {agreed} step(s): a snapshot cost "
                     f"{cost * 1e3:.2f} ms, a step {step * 1e3:.2f} ms (at most "
                     f"{BUDGET:.0%} of training); steps at risk: {agreed}")
        return True

    def steps_at_risk(self, total_steps: int, steps_per_epoch: int) -> int | None:
        """Steps a crash can cost now: the smaller of the snapshot and the checkpoint interval
        (the newer of the two is resumed), else the whole run; None while the automatic
        interval is being chosen."""
        if self._probe is not None:
            return None
        disk = total_steps if self.checkpoints is None else \
            self.checkpoint_every or steps_per_epoch
        return min(self.every, disk) if self.every else disk

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Training reached its end: the final checkpoint, unless one is at this step."""
        if self.checkpoints is not None and self.last_checkpoint_step != self.state.step:
            self.save_checkpoint()

    def close(self, over: bool = False) -> None:
        """Release the checkpoint directory's lock and commit a snapshot still being copied.
        ``over``: training ended. Its snapshots stay while the script goes on, so that a
        failure after training (a final validation, an export) restarts at the final step;
        they go at the next close, or when the process exits without an uncaught exception
        (:meth:`~parlay.snapshot.SnapshotStore.clear_at_exit`)."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.store is not None and self._ended:
            self.store.clear()
        elif self.store is not None:
            self._ended = over
            self.store.close(keep_live=over)
            if over:
                self.store.clear_at_exit()


def _save_shards(opt: Any, sub: str, folder: Path) -> dict[str, int]:
    """:func:`save_dcp` into ``folder/sub``; the CRCs keyed by path within ``folder``."""
    return {f"{sub}/{n}" if sub else n: crc for n, crc in save_dcp(opt, folder / sub).items()}
