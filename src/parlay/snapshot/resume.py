"""Resuming from in-memory snapshots: which step, agreed by every rank, and the Trainer's glue.

On start-up every training rank reports the steps it holds (an ``int64`` allgather: tensors, no
pickled objects), the newest step that all of them hold is loaded (each rank its own state:
residuals, RNG and sampler position differ between replicas) and training continues from there.
It wins over a disk checkpoint only when it is newer, and a snapshot of another run (key) is
never read.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import warnings
from typing import Any, Protocol

import numpy as np
import torch

from parlay import comm, runtime
from parlay.data.sampler import ShardedSampler
from parlay.discovery import run_id
from parlay.errors import CheckpointError, ConfigError
from parlay.rngstate import rng_state
from parlay.runinfo import recipe_difference
from parlay.snapshot.owner import run_name
from parlay.snapshot.share import share_newest
from parlay.snapshot.store import FORMAT_VERSION, SnapshotStore

__all__ = ["TrainingRun", "run_key", "key_or_off", "agree", "open_for_trainer",
           "resume_trainer", "optimizer_tensors"]

log = logging.getLogger("parlay")


class TrainingRun(Protocol):
    """What snapshots need of a training run (the Trainer's persistence implements it).

    Attributes:
        strategy: The run's :class:`~parlay.strategies.Strategy`.
        mode: Its registry name.
        batch_size: Samples per batch per data-parallel replica.
        sampler: The training data's sampler (its seed, size and order settings).
        recipe: The training settings a snapshot must have been written with (optimizer and
            its arguments, schedule, precision, compression, mode options, data and seed).
        step: Optimizer steps taken.
    """

    strategy: Any
    mode: str
    batch_size: int
    sampler: ShardedSampler
    recipe: dict[str, str]

    @property
    def step(self) -> int: ...

    def state_dict(self, snapshot: bool = False) -> dict[str, Any]:
        """Everything stateful on this rank (``snapshot``: as an in-memory snapshot holds it)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a checkpoint's or a snapshot's)."""


def run_key(identity: str) -> str | None:
    """Snapshot key for this job: its run id plus a digest of ``identity`` (what must match for
    a snapshot to continue this run exactly), or ``None`` when the job has no run id.

    The run id is :func:`parlay.discovery.run_id`.
    """
    run = run_id()
    if run is None:
        return None
    digest = hashlib.sha1(f"{FORMAT_VERSION}|{identity}".encode()).hexdigest()[:12]
    return f"{run_name(run)}-{digest}"


#: Why snapshots are off without a run id, and how to turn them on.
NO_RUN_ID = ("in-memory snapshots off: no run id (launch with parlay run, or set PARLAY_RUN_ID "
             "to an id that stays the same across restarts of this job)")


def key_or_off(identity: str, message: str = NO_RUN_ID, level: int = logging.INFO) -> str | None:
    """:func:`run_key` of ``identity``, or ``None`` after logging ``message`` (at ``level``)
    when the job has no run id."""
    key = run_key(identity)
    if key is None:
        log.log(level, message)
    return key


_REPORT = 16  # newest steps each rank reports when the ranks agree where to resume


def agree(store: SnapshotStore, group: Any = None, after: int = -1,
          apart: bool = False) -> tuple[int, dict[str, Any]] | None:
    """The newest snapshot step above ``after`` that every rank of ``group`` holds and can read,
    with this rank's state for it; ``None`` when there is none (every rank gets the same answer).
    With ``apart``, each rank's own step (see :func:`_agree_apart`).

    The ranks exchange only tensors (their committed steps, then one ok flag per candidate),
    never pickled objects. A rank killed while writing step t still holds t-1 (``keep`` >= 2),
    so after a single failure the common step is at most one behind the newest.
    """
    if apart:
        return _agree_apart(store, group, after)
    mine = [s for s in store.steps() if s > after]
    common = set.intersection(*({v for v in r if v >= 0}
                                for r in comm.gather_ints(mine, _REPORT, group)))
    refused: list[int] = []
    for step in sorted(common, reverse=True):
        state: dict[str, Any] | None = None
        try:
            state = store.load(step)
        except CheckpointError as e:
            log.warning("rank %d: %s", store.rank, e)
        if comm.all_ok(state is not None, group):
            if refused:
                log.warning("rank %d resumes from the snapshot of step %d instead of step(s) %s, "
                            "which did not verify on every rank", store.rank, step, refused)
            return step, state  # type: ignore[return-value]
        refused.append(step)
        log.warning("snapshot of step %d is not readable on every rank; trying an older one",
                    step)
    if refused:
        log.warning("rank %d: no snapshot verifies on every rank (refused step(s) %s); the disk "
                    "checkpoint, or a replica's state, is used instead", store.rank, refused)
    return None


def _agree_apart(store: SnapshotStore, group: Any,
                 after: int) -> tuple[int, dict[str, Any]] | None:
    """For ranks that meet only at collectives: each rank's newest readable snapshot taken
    after as many collectives as every other rank's (:func:`parlay.comm.issued`). No
    collective lies between such states, so each rank goes on from its own, exactly."""
    mine: dict[int, tuple[int, dict[str, Any]]] = {}
    for step, slot in sorted((r for r in store.records() if r[0] > after), reverse=True):
        try:
            state = store.load(step, slot)
        except CheckpointError as e:
            log.warning("rank %d: %s", store.rank, e)
            continue
        mine.setdefault(int(state.get("collectives", -1)), (step, state))
    rows = comm.gather_ints(sorted(c for c in mine if c >= 0), _REPORT, group)
    common = set.intersection(*({v for v in r if v >= 0} for r in rows))
    return mine[max(common)] if common else None


def _identity(run: TrainingRun) -> str:
    """What must match for a snapshot to continue this run exactly."""
    s, smp = run.strategy, run.sampler
    model = s.snapshot_state_dict().get("model", {})
    shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in model.items()
              if isinstance(v, torch.Tensor)]
    return repr((run.mode, runtime.size(), s.dp_size, run.batch_size, smp.n,
                 smp.seed, smp.shuffle, smp.drop_last, shapes))


def open_for_trainer(run: TrainingRun, every: int) -> SnapshotStore | None:
    """The snapshot store of ``run``'s rank, or ``None`` when snapshots are off: ``every`` is
    0, the rank does not train, the mode does not support them, or the job has no run id (see
    :func:`run_key`). A strategy whose serving ranks snapshot in step is told ``every`` here
    (on every rank)."""
    s = run.strategy
    if s.agrees_snapshots_early:  # every rank: serving ranks snapshot in step
        s.configure_snapshots(every)
    if not every or not s.consumes_data:
        return None
    if not s.supports_snapshots:
        log.info("in-memory snapshots are not available in mode %r", run.mode)
        return None
    if s.agrees_snapshots_early:  # its store was opened before the ranks agreed the step
        s.snapshot_identity = hashlib.sha1(_identity(run).encode()).hexdigest()[:16]
        return s.snapshot_store
    key = key_or_off(_identity(run))
    if key is None:
        return None
    store, status = None, 0
    error: ConfigError | CheckpointError | None = None
    try:
        store = SnapshotStore(key, runtime.rank(), live=True)
    except ConfigError as e:  # another live job holds this run id
        status, error = 2, e
    except CheckpointError as e:  # the folder cannot be written
        status, error = 1, e
    codes = [row[0] for row in comm.gather_ints([status], 1, s.train_group)]
    if max(codes) == 0:
        return store
    if store is not None:
        store.close()
    failed = [comm.to_global_rank(s.train_group, i) for i, c in enumerate(codes) if c]
    if max(codes) == 2:
        if status == 2 and error is not None:
            raise error
        raise ConfigError(f"rank(s) {failed}: this job's run id is in use by another live job "
                          "(see their error). Fix: give this job its own PARLAY_RUN_ID, or stop "
                          "the other job.")
    warnings.warn(f"in-memory snapshots off: {error}" if error else
                  f"in-memory snapshots off: rank(s) {failed} cannot write theirs (see their "
                  "warning)", stacklevel=3)
    return None


def replicated_part(state: dict[str, Any]) -> dict[str, Any]:
    """The part of a Trainer state that data-parallel replicas share: all but the RNG, the
    sampler position and the optimizer's compression state (error-feedback residuals)."""
    out = {k: v for k, v in state.items() if k not in ("rng", "sampler")}
    strategy = dict(out.get("strategy", {}))
    if isinstance(strategy.get("optimizer"), dict):
        strategy["optimizer"] = {k: v for k, v in strategy["optimizer"].items()
                                 if k != "parlay_compression"}
    out["strategy"] = strategy
    return out


def _complete(run: TrainingRun, shared: dict[str, Any]) -> dict[str, Any]:
    """A full Trainer state from a replica's shared part: the sampler position follows from the
    step, the RNG is re-seeded from (seed, rank, step), the residuals restart at zero."""
    st = shared["trainer"]
    seed = int(hashlib.sha1(f"{run.sampler.seed}|{runtime.rank()}|{st['step']}".encode())
               .hexdigest()[:8], 16)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    sampler = {"epoch": int(st["epoch"]),
               "position": int(st["batch_in_epoch"]) * run.batch_size}
    return {**shared, "sampler": sampler, "rng": rng_state()}


def resume_trainer(run: TrainingRun, store: SnapshotStore) -> int | None:
    """Load the newest snapshot the ranks agree on into ``run`` when it is newer than the
    step it is at (its disk checkpoint); returns that step or ``None``.

    First choice: the newest step every training rank holds (exact: each rank its own state).
    Otherwise the newest step every replica group holds somewhere: ranks without it receive the
    model and optimizer from a replica (:func:`~parlay.snapshot.share.share_newest`), while
    their RNG is re-seeded and compression residuals restart at zero; the run then continues
    correctly but not bit for bit like an uninterrupted one (other dropout masks; the gradient
    mass those residuals still owed is lost), and a warning says so.
    """
    s = run.strategy
    if s.agrees_snapshots_early:
        return _resume_agreed(run, store, s.agreed_snapshot_step)
    after = run.step
    found = agree(store, s.train_group, after=after, apart=s.resumes_apart)
    exact = True
    if found is not None:
        step, state = found
    elif not s.has_replicas:  # each rank holds its own shard: no replica can stand in
        return None
    else:
        # Replicas of the model and optimizer: the ranks of one dp_group (one pipeline stage).
        shared = share_newest(store, s.train_group, s.dp_group, after, replicated_part)
        if shared is None:
            return None
        step, state, exact = shared
        if not exact:
            state = _complete(run, state)
    _refuse_other_recipe(run, state, step, store)
    run.load_state_dict(state)
    if not exact:
        warnings.warn(f"rank {runtime.rank()} had no snapshot of step {step}: it resumed with a "
                      "replica's model and optimizer, a re-seeded RNG and zero compression "
                      "residuals (not bit-exact).", stacklevel=3)
    return step


def _refuse_other_recipe(run: TrainingRun, state: dict[str, Any], step: int,
                         store: SnapshotStore) -> None:
    """Raise when ``state`` was written with other training settings than ``run``'s (the
    same on every rank, so every rank refuses).

    Raises:
        CheckpointError: It was (the message names the settings and the folder).
    """
    diff = recipe_difference(state.get("recipe"), run.recipe)
    if diff:
        raise CheckpointError(
            f"rank {runtime.rank()}: the in-memory snapshot of step {step} in {store.directory} "
            f"was written with other training settings ({diff}) under this job's run id "
            f"{run_id()!r}; it is not resumed. Fix: give this job its own PARLAY_RUN_ID (two "
            "jobs must not share one), or resume with the settings that wrote it, or delete "
            f"{store.directory.parent} to start afresh.")


def _resume_agreed(run: TrainingRun, store: SnapshotStore, step: int | None) -> int | None:
    """Load exactly ``step``, which the ranks agreed before the Trainer existed (parameter
    servers loaded their snapshots of it at start); ``None``: they resumed from disk.

    Raises:
        CheckpointError: The snapshot is unreadable here or was written with other Trainer
            settings (its servers already resumed it, so no other step can be taken).
    """
    if step is None:
        return None
    state = store.load(step)
    mine = run.strategy.snapshot_identity
    theirs = state.get("strategy", {}).get("identity", mine)
    if theirs != mine or state.get("trainer", {}).get("step") != step:
        raise CheckpointError(
            f"rank {runtime.rank()}: the in-memory snapshot of step {step} in "
            f"{store.directory} was written by a run with other Trainer settings (batch size, "
            "data, seed or model) under the same run id. Fix: delete that folder, or give "
            "this job its own PARLAY_RUN_ID.")
    _refuse_other_recipe(run, state, step, store)
    run.load_state_dict(state)
    return step


def background_copy() -> bool:
    """Whether parameters and optimizer state are copied into a snapshot while the rank waits
    for communication (:mod:`parlay.snapshot.deferred`) instead of before ``save`` returns: yes
    unless ``$PARLAY_SNAPSHOT_BACKGROUND`` is ``0``. Deferring costs at most what the inline
    copy does: what is left when the next optimizer step begins is copied then."""
    return os.environ.get("PARLAY_SNAPSHOT_BACKGROUND", "") != "0"


def optimizer_tensors(strategy: Any) -> set[int]:
    """``data_ptr()`` of the tensors that change only in an optimizer step: the parameters and
    the optimizer's state, for :meth:`SnapshotStore.save`'s ``defer``. Empty when the strategy
    exposes no ``optimizer`` or deferred copies are off (:func:`background_copy`)."""
    opt = getattr(strategy, "optimizer", None)
    if not isinstance(opt, torch.optim.Optimizer) or not background_copy():
        return set()
    ptrs = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    ptrs.update(v.data_ptr() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return ptrs
