"""Fault handling shared by parameter-server ranks: where to resume, and the launcher marker.

* :func:`agree_resume`: at start every rank lists the steps it can resume (servers their shard
  files and in-memory snapshots, workers the Trainer's files and snapshots) and all resume one
  step, so server shards and worker state never come from different steps, nor runs: a
  server's file recording another run id than the workers' files of its step (a file copied
  in from another run) is left out, with a warning naming it. Tensors only.
* :func:`mark_droppable`: an ``async``/``stale`` worker tells ``parlay run`` that losing it
  need not stop the job (the other workers go on without it); :func:`server_loss_is_fatal`
  takes that back when the worker fails because it lost a server (the job must stop, and
  ``--max-restarts`` restart it).
* :func:`save_worker_state` / :func:`load_worker_state`: a plain session's worker file
  (compression residuals) when no Trainer keeps the worker's state.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from parlay import comm, runtime
from parlay.statefile import save_atomic, verify
from parlay.compress.base import Compressor
from parlay.errors import CheckpointError, CommError
from parlay.launch import droppable_marker
from parlay.launch import mark_droppable as _launch_mark_droppable
from parlay.ps.shard_io import read_shard, snapshot_steps, step_path
from parlay.runinfo import same_numbers
from parlay.snapshot import SnapshotStore, key_or_off

__all__ = ["agree_resume", "Resume", "resume_session", "open_snapshots", "mark_droppable",
           "verified_steps",
           "server_loss_is_fatal", "HELD_SLOTS", "save_worker_state", "load_worker_state"]

log = logging.getLogger("parlay.ps")

#: Newest checkpoint steps each rank offers when agreeing where to resume.
HELD_SLOTS = 32
_SNAP_SLOTS = 8  # newest in-memory snapshot steps each rank offers (a store keeps 2)
_FLAGS = 4  # tagged, keeps snapshots, is a worker, a fresh run id


class Resume(NamedTuple):
    """Where every rank resumes (the same answer on every rank).

    Attributes:
        tagged: Some worker keeps step-tagged checkpoints (a Trainer worker): servers
            checkpoint when the workers ask.
        step: The step to resume, or ``None`` (a fresh start, or nothing every rank holds).
        from_snapshot: ``step`` is read from the in-memory snapshots (else from disk).
        snapshots: Some worker keeps in-memory snapshots: servers snapshot their shards too.
        training: Global ranks of the workers that train; the others sit out (see
            :func:`agree_resume`).
        run: The id this start's servers and workers record in their checkpoints (drawn
            anew at every start: the files of one step are always written by one start).
        foreign: Steps of this server whose file records another run id than the workers'
            files of that step (left out).
    """

    tagged: bool
    step: int | None
    from_snapshot: bool
    snapshots: bool
    training: list[int]
    run: int = 0
    foreign: tuple[int, ...] = ()


def agree_resume(disk: Iterable[int], snaps: Iterable[int], *, is_worker: bool, tagged: bool,
                 snapshots: bool, relaxed: bool, group: Any,
                 runs: Mapping[int, int] | None = None) -> Resume:
    """Agree, over every rank of ``group``, on the step to resume (one allgather of tensors).

    The in-memory snapshot step every rank holds wins when it is newer than the disk step;
    a rank never mixes the two. On disk, ``sync`` (``relaxed=False``) takes the newest step
    every rank holds (with no tagged worker: every server, whose step files are versions).
    ``async``/``stale`` (``relaxed=True``) take the newest step ``T`` that every server holds
    and that every worker holding a file of step ``T`` or later holds: workers lost before
    ``T`` (dropped while the others went on; they hold only older files, or none) sit out,
    since their state at ``T`` was never saved. A server's step whose file records another run
    id than the workers' files of that step (all of one run) is not held (:attr:`Resume.foreign`).

    Args:
        disk: Checkpoint steps this rank holds on disk.
        snaps: In-memory snapshot steps this rank holds.
        is_worker: This rank computes gradients.
        tagged: This rank keeps step-tagged checkpoints (a Trainer worker).
        snapshots: This worker keeps in-memory snapshots.
        relaxed: Lost workers were dropped and the others went on (``async``/``stale``).
        group: Every server and worker.
        runs: The run id each of ``disk``'s files records (0 or missing: none, an older file).
    """
    def slots(steps: Iterable[int], n: int) -> list[int]:
        newest = sorted(set(int(t) for t in steps))[-n:]
        return newest + [-1] * (n - len(newest))

    on = slots(disk, HELD_SLOTS)
    ids = [int((runs or {}).get(t, 0)) for t in on]
    rows = comm.gather_ints([int(tagged), int(snapshots), int(is_worker), secrets.randbits(62)]
                            + on + ids + slots(snaps, _SNAP_SLOTS),
                            _FLAGS + 2 * HELD_SLOTS + _SNAP_SLOTS, group)
    any_tagged = any(r[0] for r in rows)
    any_snap = any(r[1] for r in rows)
    workers = [k for k, r in enumerate(rows) if r[2]]
    held = [{t for t in r[_FLAGS: _FLAGS + HELD_SLOTS] if t >= 0} for r in rows]
    mem = [{t for t in r[_FLAGS + 2 * HELD_SLOTS:] if t >= 0} for r in rows]
    foreign = _foreign_runs(rows, workers)
    for k, t in foreign:
        held[k].discard(t)
    me = comm.group_rank(group) if len(rows) > 1 else 0
    extra = (rows[0][3], tuple(sorted(t for k, t in foreign if k == me)))
    if any_tagged:
        on_disk = _disk_step(held, workers, relaxed)
    elif relaxed:  # async/stale servers keep no versions in common
        on_disk = None
    else:  # sync servers' own step files (their versions)
        servers = [held[k] for k in range(len(rows)) if k not in workers]
        common = set.intersection(*servers)
        # workers offer the step of their compression residuals: one that has them is exact
        exact = common.intersection(*(held[w] for w in workers if held[w]))
        on_disk = max(exact or common, default=None)
        if on_disk is None and any(servers):  # not a fresh start: refuse it
            none = [k for k, h in enumerate(servers) if not h]
            raise CheckpointError(
                "the parameter servers hold no checkpoint version in common (usable steps by "
                f"server: {[sorted(h) for h in servers]}; see the warnings for files left "
                "out), so the run cannot resume; nothing was deleted. " + (
                    f"Server(s) {none} hold none while the others do: the number of "
                    "parameter servers probably changed (parlay run --ps). Fix: resume with "
                    "the --ps count of the run that wrote them" if none else
                    "Fix: restore the missing ps-<k>.step-*.pt files")
                + ", or start afresh with a new (or emptied) checkpoint_dir.")
    in_mem = max(set.intersection(*mem), default=None) if any_snap else None
    if in_mem is not None and (on_disk is None or in_mem > on_disk):
        return Resume(any_tagged, in_mem, True, any_snap, workers, *extra)
    training = workers
    if relaxed and on_disk is not None:
        training = [w for w in workers if any(t >= on_disk for t in held[w])]
    return Resume(any_tagged, on_disk, False, any_snap, training, *extra)


def _foreign_runs(rows: list[list[int]], workers: list[int]) -> set[tuple[int, int]]:
    """``(rank, step)`` of every server file whose run id differs from the one that every
    workers' file of that step records (ids of 0: older files, which record none)."""
    ids = [dict(zip(r[_FLAGS: _FLAGS + HELD_SLOTS], r[_FLAGS + HELD_SLOTS:])) for r in rows]
    out = set()
    for t in {t for row in ids for t in row if t >= 0}:
        run = {ids[w][t] for w in workers if ids[w].get(t, 0) > 0}
        if len(run) == 1:  # (workers of several runs: the Trainer's own check refuses them)
            out |= {(k, t) for k in range(len(rows)) if k not in workers
                    and ids[k].get(t, 0) not in (0, *run)}
    return out


def _disk_step(held: list[set[int]], workers: list[int], relaxed: bool) -> int | None:
    if not relaxed:
        return max(set.intersection(*held), default=None)
    servers = [held[k] for k in range(len(held)) if k not in workers]
    for t in sorted(set.intersection(*servers) if servers else set(), reverse=True):
        later = [w for w in workers if max(held[w], default=-1) >= t]
        if later and all(t in held[w] for w in later):
            return t
    return None


def verified_steps(steps: Iterable[int], read: Callable[[int], Any], rank: int) -> list[int]:
    """The ``steps`` whose state ``read(step)`` loads and verifies (it raises
    ``CheckpointError`` otherwise); a warning names each one left out. Ranks offer only these
    to :func:`agree_resume`, so a corrupt newest state sends every rank to an older step."""
    usable = []
    for t in steps:
        try:
            read(t)
            usable.append(t)
        except CheckpointError as e:
            log.warning("rank %d: step %d is not resumable here (%s); the ranks agree on "
                        "another, if one is usable on every rank", rank, t, e)
    return usable


def resume_session(session: Any) -> tuple[Resume, SnapshotStore | None]:
    """Where a starting :class:`~parlay.ps.session.DistributedSession` resumes (agreed over
    its ``ps_group``), and the in-memory snapshot store its rank keeps from
    now on: ``sync`` servers, and workers whose caller snapshots (``snapshots=True``). A store
    is emptied when the resume does not use it (its steps are older than the resumed one, or
    of a lost future) and dropped on servers when no worker snapshots."""
    s = session
    disk = ((snapshot_steps(s.checkpoint_dir, s.rank) if s.checkpoint_dir else [])
            if s.is_ps else s.resume_steps or _residuals_step(s.residuals_path))
    runs = {} if s.is_ps else s.resume_runs

    def read(t: int) -> None:
        runs[t] = int(read_shard(step_path(s.checkpoint_dir, s.rank, t), t, s.rank).get("run", 0))

    if s.is_ps and disk:
        disk = verified_steps(disk, read, s.rank)
    store = open_snapshots(s) if s.consistency.aggregate and (s.is_ps or s.snapshots) else None
    snaps = verified_steps(store.steps(), store.load, s.rank) if store is not None else []
    r = agree_resume(disk, snaps, is_worker=not s.is_ps,
                     tagged=not s.is_ps and s.resume_steps is not None,
                     snapshots=not s.is_ps and store is not None,
                     relaxed=not s.consistency.aggregate, group=s.ps_group, runs=runs)
    for t in r.foreign:
        log.warning("rank %d: %s (step %d) was written by another run than the workers' "
                    "checkpoint files of step %d (copied in from another run?): it is not "
                    "resumed; the ranks agree on another step, if one is usable on every rank",
                    s.rank, step_path(s.checkpoint_dir, s.rank, t), t, t)
    if store is not None and not r.from_snapshot and snaps:
        store.clear()
        store = open_snapshots(s)
    if s.is_ps and store is not None and not r.snapshots:
        store.clear()  # no worker snapshots: the servers' would never match one
        store = None
    return r, store


def open_snapshots(session: Any) -> SnapshotStore | None:
    """The in-memory snapshot store of a started session's rank, or ``None`` when the job has
    no run id (:func:`parlay.snapshot.key_or_off`) or the store cannot be made (a warning).

    Servers and workers of one job share a key: the run id plus what must match for a
    snapshot to continue the run (placement, world layout, consistency, optimizer,
    compressor). The Trainer's own settings (batch size, data) are checked when a worker
    loads one (:func:`parlay.snapshot.resume_trainer`).
    """
    s = session
    identity = repr(("ps", runtime.size(), s.num_servers, s.consistency.name, s.plan.rows(),
                     getattr(s.optimizer_cls, "__qualname__", repr(s.optimizer_cls)),
                     sorted((k, same_numbers(repr(v))) for k, v in s.optimizer_args.items()),
                     type(s.compressor).__qualname__))
    key = key_or_off(identity)
    if key is None:
        return None
    try:  # live: a second live job under this run id is refused (ConfigError names it)
        return SnapshotStore(key, s.rank, live=True)
    except CheckpointError as e:
        log.warning("in-memory snapshots off on rank %d: %s", s.rank, e)
        return None


def mark_droppable(rank: int) -> None:
    """Declare this worker droppable to ``parlay run`` (:func:`parlay.launch.mark_droppable`);
    a marker that cannot be written only costs the job its tolerance of this worker's loss."""
    try:
        _launch_mark_droppable(rank)
    except OSError as e:
        log.warning("could not write the droppable marker of rank %d (%s): losing this worker "
                    "will stop the job under parlay run", rank, e)


@contextlib.contextmanager
def server_loss_is_fatal(rank: int, num_servers: int) -> Iterator[None]:
    """A worker whose error names a lost server (ranks ``0..num_servers-1``) removes its
    droppable marker before the error propagates."""
    try:
        yield
    except CommError as e:
        path = droppable_marker(rank)
        if path and e.peer is not None and 0 <= e.peer < num_servers:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise


def save_worker_state(path: str | None, compressor: Compressor, step: int) -> None:
    """Write a worker's compression residuals as of its ``step`` to ``path`` (no-op for
    ``None``)."""
    if path:
        save_atomic({"compressor": compressor.state_dict(), "step": int(step)}, path)


def _residuals_step(path: str | None) -> list[int]:
    """The step of the compression residuals a plain session's worker file holds ([] when
    there are none: no file, no residuals, or unreadable, which loading then reports)."""
    if not path or not os.path.exists(path):
        return []
    try:
        sd = verify(torch.load(path, weights_only=True), Path(path), "worker checkpoint", "")
    except Exception:  # noqa: BLE001 - unusable: nothing to offer (loading it reports why)
        return []
    return [int(sd["step"])] if sd.get("compressor") and "step" in sd else []


def load_worker_state(path: str | None, compressor: Compressor, step: int | None) -> None:
    """Restore a worker's compression residuals from ``path`` when it exists. With ``step``
    (``sync``: the version every server resumes), residuals of another step are left out
    with a warning: they belong to another state of the model (not bit-exact).

    Raises:
        CheckpointError: The file is unreadable.
    """
    if path and os.path.exists(path):
        try:
            sd = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a CheckpointError
            raise CheckpointError(f"could not read worker checkpoint {path!r}: {e}. Hint: "
                                  "delete it to start the worker's residuals at zero.") from e
        sd = verify(sd, Path(path), "worker checkpoint",
                    "delete it to start the worker's residuals at zero.")
        if step is not None and sd.get("step", step) != step and sd.get("compressor"):
            log.warning("%s holds the residuals of step %s, the servers resume step %d: they "
                        "start at zero (not bit-exact)", path, sd["step"], step)
            return
        compressor.load_state_dict(sd.get("compressor", {}))
