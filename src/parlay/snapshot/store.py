"""In-memory snapshots: every rank keeps its newest training states in host shared memory.

A snapshot is written after every ``snapshot_every`` steps, off the critical path and atomically,
so a restarted job loses at most one step instead of everything since the last disk checkpoint.
Each rank owns a folder ``<root>/<key>/rank<r>/`` (root: ``$PARLAY_SNAPSHOT_DIR``, else
``/dev/shm/parlay``) holding

* ``data-<slot>.pt``: the tensors of one snapshot, a ``torch.save`` file that the writer maps
  ``MAP_SHARED`` once (and again only when the state's shapes change) and then copies into in
  place: one memory copy per step, no serialisation and no allocation;
* ``snap-<step>.s<slot>.json``: the commit record (step, slot, layout, the state's structure
  with its plain values and the CRC-32 of every tensor), written to a temporary name and
  renamed, with a CRC-32 of its own.

:meth:`SnapshotStore.load` verifies both checksums: a flipped bit or byte anywhere in a
snapshot makes it unreadable, and the caller resumes from another state instead.

Before a slot is overwritten its commit record is deleted, so a process killed half way through
a copy leaves the slot uncommitted and the previous snapshot intact. ``keep`` slots rotate: the
newest ``keep`` committed snapshots survive. Data is read back with
``torch.load(weights_only=True)`` and records with ``json``: a snapshot cannot execute code.

Off the critical path: the copy is the write (the file lives in host memory; no serialisation
per step, which a fresh ``torch.save`` would cost), and the record is a few kilobytes. Tensors
that training changes only inside an optimizer step (parameters, optimizer state: the bulk of
the bytes; the caller names them with ``defer``) are copied in chunks while the rank waits for
communication in the next step, then the record is committed (:mod:`parlay.snapshot.deferred`;
not a copying thread, which would compete with training for the cores and the GIL); every
optimizer step first finishes what is left. Everything else is copied before
:meth:`SnapshotStore.save` returns. Files survive the death of the process (the page cache is
the file), not of the host: that is what disk checkpoints are for, so nothing here is
``fsync``-ed.
"""
from __future__ import annotations

import atexit
import json
import logging
import zlib
import os
import weakref
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from parlay.errors import CheckpointError, ConfigError
from parlay.statefile import read_atomic, remove_temporaries
from parlay.integrity import tensor_crc
from parlay.snapshot.codec import decode, encode, layout, map_shared, write_atomic
from parlay.snapshot.deferred import DeferredCopy, settle_before_optimizer_steps
from parlay.snapshot.owner import (default_root, hold, hold_live, live_path, other_recipes,
                                   release_live)

__all__ = ["SnapshotStore", "default_root", "FORMAT_VERSION"]

log = logging.getLogger("parlay")

FORMAT_VERSION = 2  #: Bumped when the snapshot layout changes incompatibly (2: checksums).
_META = re.compile(r"^snap-(\d{10})\.s(\d+)\.json$")
_MKDIR_TRIES = 20  # tries to create a rank's folder while other ranks clear the run folder


_INSTEAD = ("The newest state that verifies is used instead: an older snapshot, a replica's "
            "or the disk checkpoint.")


def _record_crc(record: dict[str, Any]) -> int:
    """CRC-32 of a commit record's canonical JSON (without its own ``check``)."""
    return zlib.crc32(json.dumps(record, sort_keys=True).encode())


def _clear_ended(at_exit: bool) -> None:
    """Clear the stores of :meth:`SnapshotStore.clear_at_exit`."""
    if at_exit and getattr(sys, "last_value", None) is not None:
        return  # an uncaught exception ends the process: a restart resumes them
    for store in _ended:
        if not (at_exit and store._owner_fd >= 0):
            store.clear()
    _ended.clear()


class SnapshotStore:
    """One rank's in-memory snapshots of one run.

    Args:
        key: Identifies the run: stable across restarts of one job, distinct across jobs.
            Snapshots of another key are never read.
        rank: This rank (one folder per rank).
        root: Parent folder (default :func:`default_root`).
        keep: Committed snapshots kept (the newest ones); 2 lets a rank killed while writing
            step t still hold step t-1.
        live: Hold this rank's live lock on the run id until :meth:`close`
            (:func:`~parlay.snapshot.owner.hold_live`): a second live job with the same run id
            is refused; a store of this process still holding it (a Trainer stopped early,
            never closed) is superseded: cleared, and its next save raises.

    Raises:
        ConfigError: Bad key or keep, or (``live``) another live job holds the run id.
        CheckpointError: The folder cannot be created.
    """

    def __init__(self, key: str, rank: int, root: str | os.PathLike[str] | None = None,
                 keep: int = 2, *, live: bool = False) -> None:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", key):
            raise ConfigError(f"snapshot key must be 1-200 letters, digits, '.', '_' or '-', "
                              f"got {key!r}.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}.")
        self.key, self.rank, self.keep = key, int(rank), keep
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.directory = self.root / key / f"rank{self.rank}"
        self._live_fd, self._cleared = -1, False
        if live:
            _clear_ended(at_exit=False)  # this process trains anew: the run id is its own
            older = _live.get(live_path(self.root, key, self.rank))
            if older is not None:  # one this process left open (a Trainer stopped early)
                older.clear()
                older._error = CheckpointError(
                    f"a later store of this run id in this process (another Trainer) took "
                    f"over rank {self.rank}'s snapshots; this one was cleared.")
            try:
                self._live_fd = hold_live(self.root, key, self.rank)
            except OSError as e:
                raise CheckpointError(f"cannot create snapshot folder {self.root}: {e}. Hint: "
                                      "set PARLAY_SNAPSHOT_DIR to a writable folder.") from e
            if self._live_fd >= 0:
                _live[live_path(self.root, key, self.rank)] = self
            for old in other_recipes(self.root, key, self.rank):
                log.warning("rank %d: in-memory snapshots of this run id taken with another "
                            "configuration (model, batch size, world size or data) are in %s; "
                            "this job cannot resume them and does not use them. Remove them, "
                            "or relaunch with the configuration that wrote them.", self.rank, old)
        self._make_folder()
        self._owner_fd = hold(self.root, key)  # a sweep leaves this run alone while it is held
        remove_temporaries(self.directory, "*")
        for step, slot in self._committed():
            if slot >= keep:  # written with a larger keep: its slot is never rotated again
                self._meta_path(step, slot).unlink(missing_ok=True)
        # What this process committed, kept here so that a save never lists the folder.
        self._held: list[tuple[int, int]] = self._committed()
        self._maps: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self._sig: tuple[list[Any], str] = ([], "")  # (dtypes and shapes, their layout)
        self._job: DeferredCopy | None = None
        self._error: CheckpointError | None = None
        #: Seconds this thread spent copying and committing the newest finished snapshot (in
        #: :meth:`save` and, deferred, while waiting for communication or before the next
        #: optimizer step): what a snapshot costs, to choose ``snapshot_every`` from. The first
        #: save into each of the ``keep`` slots also creates its file: later ones are typical.
        self.last_save_s: float | None = None

    def _make_folder(self) -> None:
        """Create this rank's folder, again if another rank's :meth:`clear` removed the (then
        empty) run folder between the two mkdirs."""
        err: OSError | None = None
        for _ in range(_MKDIR_TRIES):
            try:
                self.directory.parent.mkdir(parents=True, exist_ok=True)
                self.directory.mkdir(exist_ok=True)
                return
            except (FileNotFoundError, FileExistsError) as e:
                err = e  # the run folder was removed in between (mkdir, is_dir): try again
            except OSError as e:
                err = e
                break
        raise CheckpointError(f"cannot create snapshot folder {self.directory}: {err}. Hint: "
                              "set PARLAY_SNAPSHOT_DIR to a writable folder.") from err

    # ------------------------------------------------------------------ files
    def _meta_path(self, step: int, slot: int) -> Path:
        return self.directory / f"snap-{int(step):010d}.s{slot}.json"

    def _data_path(self, slot: int) -> Path:
        return self.directory / f"data-{slot}.pt"

    def _committed(self) -> list[tuple[int, int]]:
        out = []
        for p in self.directory.iterdir():
            m = _META.match(p.name)
            if m:
                out.append((int(m.group(1)), int(m.group(2))))
        return sorted(out)

    def steps(self) -> list[int]:
        """Steps with a committed snapshot on this rank, ascending."""
        return [step for step, _ in self._committed()]

    # ------------------------------------------------------------------ writing
    def _slot_for_next(self) -> int:
        used = {slot for _, slot in self._held}
        free = [s for s in range(self.keep) if s not in used]
        return free[0] if free else min(self._held)[1]

    def _layout_of(self, tensors: list[torch.Tensor]) -> str:
        """:func:`~parlay.snapshot.codec.layout`, recomputed only when a dtype or shape
        changed (comparing them costs a fraction of hashing them)."""
        sig = [(t.dtype, t.shape) for t in tensors]
        if sig != self._sig[0]:
            self._sig = (sig, layout(tensors))
        return self._sig[1]

    def _mapped(self, slot: int, tensors: list[torch.Tensor], lay: str) -> list[torch.Tensor]:
        """Writable views of ``slot``'s data file with layout ``lay`` (the file is (re)written
        when it is missing or holds another layout, e.g. once the optimizer created its
        state)."""
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == lay:
            return cached[1]
        self._maps.pop(slot, None)
        views = map_shared(self._data_path(slot), tensors, lay)
        self._maps[slot] = (lay, views)
        return views

    def save(self, step: int, state: dict[str, Any], *,
             defer: frozenset[int] | set[int] = frozenset(), replace: bool = True) -> None:
        """Snapshot ``state`` as of ``step``.

        Copies every tensor into a free slot's shared-memory file (the slot of the oldest kept
        snapshot is reused once ``keep`` are held; its record is deleted first) and renames the
        commit record into place. A step saved again (after a restart) goes into the slot of
        its earlier record, which is deleted first, so the older snapshots stay: a peer killed
        while writing this step resumes the previous one. With ``replace`` False the earlier
        record stays instead: ranks that resume apart snapshot a step again after meeting the
        others, and keep the first until every rank holds its second (:meth:`supersede`).
        CPU tensors whose ``data_ptr()`` is in ``defer`` (those that change only in an
        optimizer step) are copied, and the record committed, while this thread waits for
        communication, at the latest when the next optimizer step in the process begins (or
        :meth:`wait`); everything else is copied before this returns.

        Raises:
            CheckpointError: This or the previous snapshot could not be written (the other
                committed snapshots are intact), or the state holds something other than
                tensors and plain values.
        """
        self.wait()
        t0 = time.perf_counter()
        tensors: list[torch.Tensor] = []
        skeleton = encode(state, tensors)
        lay = self._layout_of(tensors)
        again = [s for t, s in self._held if t == step] if replace else []
        slot = again[0] if again else self._slot_for_next()  # keep step-1 (restarted ranks)
        for old in [h for h in self._held if h[1] == slot or (replace and h[0] == step)]:
            self._meta_path(*old).unlink(missing_ok=True)
            self._held.remove(old)
        views = self._mapped(slot, tensors, lay)
        later: list[int] = []
        crcs = [0] * len(views)
        with torch.no_grad():
            for i, (dst, src) in enumerate(zip(views, tensors)):
                if defer and src.is_cpu and src.data_ptr() in defer:
                    later.append(i)
                else:
                    dst.copy_(src)
                    crcs[i] = tensor_crc([dst])
        record = {"parlay_snapshot": FORMAT_VERSION, "key": self.key, "step": int(step),
                  "slot": slot, "layout": lay, "skeleton": skeleton, "crcs": crcs,
                  "rank": self.rank}
        if not later:
            self._commit(record)
            self.last_save_s = time.perf_counter() - t0
            return

        def commit() -> None:
            for i, crc in zip(later, job.crcs):
                crcs[i] = crc
            self._commit(record)

        settle_before_optimizer_steps(self)
        job = self._job = DeferredCopy([(views[i], tensors[i]) for i in later], commit)
        self._job.seconds = time.perf_counter() - t0
        self._job.start()

    def _commit(self, record: dict[str, Any]) -> None:
        step, slot = record["step"], record["slot"]
        text = json.dumps({**record, "check": _record_crc(record)})
        write_atomic(self._meta_path(step, slot), lambda f: f.write(text.encode()))
        self._held.append((step, slot))

    def _settle(self) -> None:
        """Finish the pending copy; keep a failure for the next :meth:`wait` (an optimizer
        step must not fail because a snapshot did)."""
        try:
            self.wait()
        except CheckpointError as e:
            self._error = e

    def wait(self) -> None:
        """Finish the pending deferred copy and commit now.

        Raises:
            CheckpointError: It failed.
        """
        job, self._job = self._job, None
        if job is not None:
            job.finish()
            self.last_save_s = job.seconds
            if job.error is not None and self._error is None:
                self._error = job.error if isinstance(job.error, CheckpointError) else \
                    CheckpointError(f"could not copy snapshot tensors into {self.directory}: "
                                    f"{type(job.error).__name__}: {job.error}")
        error, self._error = self._error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ reading
    def supersede(self, step: int) -> None:
        """Delete the records of ``step`` but the newest (see :meth:`save`'s ``replace``)."""
        self._settle()
        for old in [h for h in self._held if h[0] == step][:-1]:
            self._meta_path(*old).unlink(missing_ok=True)
            self._held.remove(old)

    def records(self) -> list[tuple[int, int]]:
        """``(step, slot)`` of every committed snapshot on this rank: a step held twice
        (:meth:`save`'s ``replace``) is there twice."""
        self._settle()
        return self._committed()

    def load(self, step: int, slot: int | None = None) -> dict[str, Any]:
        """The state saved for ``step`` (the record in ``slot``, if given).

        Raises:
            CheckpointError: No committed snapshot of ``step``, or it is corrupt, or it
                belongs to another run or format.
        """
        self._settle()
        slots = [v for s, v in self._committed() if s == step and slot in (None, v)]
        if not slots:
            raise CheckpointError(f"no snapshot of step {step} in {self.directory} (it holds "
                                  f"{self.steps()}).")
        path = self._meta_path(step, slots[0])
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise CheckpointError(f"snapshot record {path} is unreadable ({e}). Hint: it is "
                                  "truncated or corrupt; the previous snapshot or the disk "
                                  "checkpoint is used instead.") from e
        if isinstance(meta, dict) and meta.pop("check", None) != _record_crc(meta):
            raise CheckpointError(f"snapshot record {path} fails its "
                                  f"checksum (corrupt); it is not used. {_INSTEAD}")
        if not (isinstance(meta, dict) and meta.get("parlay_snapshot") == FORMAT_VERSION
                and meta.get("key") == self.key and meta.get("step") == step
                and meta.get("slot") == slots[0]):
            raise CheckpointError(f"{path} is not a format-{FORMAT_VERSION} snapshot of run "
                                  f"{self.key!r} at step {step}. Hint: delete it.")
        if meta.get("rank", self.rank) != self.rank:
            raise CheckpointError(f"snapshot {path} was written by rank {meta['rank']}, this is "
                                  f"rank {self.rank} (its folder was moved); it is not used. "
                                  f"{_INSTEAD}")
        data_path = self._data_path(slots[0])
        data = read_atomic(data_path, "snapshot", f"it is truncated or corrupt. {_INSTEAD}")
        tensors = data.get("tensors") if isinstance(data, dict) else None
        if not (isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors)
                and data.get("layout") == meta.get("layout") == layout(tensors)):
            raise CheckpointError(f"snapshot data of step {step} in {self.directory} does not "
                                  "match its commit record (corrupt). Hint: delete the folder.")
        crcs = meta.get("crcs")
        bad = [i for i, t in enumerate(tensors)
               if not isinstance(crcs, list) or i >= len(crcs) or tensor_crc([t]) != crcs[i]]
        if bad:
            raise CheckpointError(f"snapshot {data_path} of step {step} fails "
                                  f"its checksum ({len(bad)} of {len(tensors)} tensors differ "
                                  f"from what was written, the first is #{bad[0]}): it is "
                                  f"not used. {_INSTEAD}")
        try:
            state = decode(meta["skeleton"], tensors)
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
            raise CheckpointError(f"snapshot {path} has a corrupt structure ({e}).") from e
        if not isinstance(state, dict):
            raise CheckpointError(f"snapshot {path} does not hold a dict.")
        return state

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest readable snapshot as ``(step, state)``, or ``None``."""
        for step in reversed(self.steps()):
            try:
                return step, self.load(step)
            except CheckpointError as e:
                log.warning("%s", e)
        return None

    def drop_after(self, step: int) -> None:
        """Delete this rank's snapshots of steps after ``step`` (states no longer trusted)."""
        self._settle()
        for held in [h for h in self._committed() if h[0] > step]:
            self._meta_path(*held).unlink(missing_ok=True)
            if held in self._held:
                self._held.remove(held)

    # ------------------------------------------------------------------ teardown
    def close(self, *, keep_live: bool = False) -> None:
        """Finish the pending copy and unmap the data files (snapshots stay; the next
        :meth:`save` maps them again); ``keep_live``: hold the run id (``live``) on, until
        :meth:`clear`."""
        try:
            self._settle()
        finally:
            self._maps.clear()
            if self._live_fd >= 0 and not keep_live:
                release_live(self._live_fd)
                self._live_fd = -1
                _live.pop(live_path(self.root, self.key, self.rank), None)

    def clear_at_exit(self) -> None:
        """:meth:`clear` when this process exits without an uncaught exception (one that
        escapes keeps the snapshots for a restart), unless a launcher owns the run: it removes
        them when the whole job ends (a peer may still fail after this process ended). A
        store opened ``live`` later in this process clears it at once."""
        _ended.append(self)

    def clear(self) -> None:
        """Delete this rank's snapshots (and the run's folder once no rank has one left); once
        (a later store of this process may use the folder again)."""
        if self._cleared:
            return
        self._cleared = True
        if self._live_fd >= 0:  # removed while still held: the run is over
            live_path(self.root, self.key, self.rank).unlink(missing_ok=True)
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        try:  # only when empty: other ranks' folders are there, or another rank removed it
            self.directory.parent.rmdir()
        except OSError:
            pass
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1


_ended: list[SnapshotStore] = []  # this process's stores whose training ended
#: live file -> this process's store holding it (weak: a store dropped unclosed goes as before)
_live: weakref.WeakValueDictionary[Path, SnapshotStore] = weakref.WeakValueDictionary()
atexit.register(_clear_ended, at_exit=True)
