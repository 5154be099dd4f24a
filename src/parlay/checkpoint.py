"""Checkpoints: atomic per-rank files, keep-last-N, resume from the latest valid one.

Every rank that trains writes its own file, ``ckpt-<step>.rank<r>.pt``, because ranks own
different state (compression residuals, parameter-server versions, pipeline stages). A file is
written atomically and verified when read (:mod:`parlay.statefile`): a crash leaves either the
old file or the new one, never half of one. A checkpoint counts only when every rank wrote its
file (the ranks agree with one small allreduce), and older ones are pruned only after that, so
a failed save never leaves the run without a usable checkpoint. A state holding a NaN or an
infinity is never written.

Resuming picks the newest step that every rank holds and can read; an unreadable (empty,
truncated, corrupt) file makes all ranks fall back to the previous checkpoint together. Each
checkpoint records the identity of its run (layout, batch size, model fingerprint, run id; see
:mod:`parlay.runinfo`) and a resume that could not continue it exactly is refused with the
reason. The ranks agree using integer tensors only (no pickled objects cross the network), and
files are read with ``torch.load(weights_only=True)``: a checkpoint cannot execute code.
A sharded run's shards go to ``ckpt-<step>.dcp/`` first (``torch.distributed.checkpoint``; a
folder per pipeline stage in mode ``"hybrid"``); every rank's file then records the CRC-32 of
each file there, checked (each rank a share) before a resume uses them.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from parlay import comm
from parlay.errors import CheckpointError, ConfigError
from parlay.integrity import file_crcs
from parlay.nonfinite import first_nonfinite_entry
from parlay.rngstate import rng_state, set_rng_state  # re-exported: checkpoints hold them
from parlay.runinfo import DirLock, describe_mismatch
from parlay.statefile import (CRC_KEY, read_atomic, remove_temporaries, save_atomic, verify,
                              write_atomic)

__all__ = ["save_atomic", "write_atomic", "read_atomic", "verify", "load",
           "CheckpointManager", "FORMAT_VERSION", "CRC_KEY", "rng_state", "set_rng_state"]

log = logging.getLogger("parlay")

#: Bumped when the layout of the saved dictionary changes incompatibly (2: a checksum).
FORMAT_VERSION = 2
_KEY = "parlay_checkpoint"
_NAME = re.compile(r"^ckpt-(\d{10})\.rank(\d+)\.pt$")


def load(path: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :class:`CheckpointManager` (``weights_only=True``); with
    ``step``, the one its name says it is.

    Raises:
        CheckpointError: Missing, truncated, corrupt, not a parlay checkpoint, holding
            objects that ``weights_only`` loading refuses, or of another step than ``step``.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    obj = read_atomic(path)
    if not isinstance(obj, dict) or _KEY not in obj:
        raise CheckpointError(f"{path} is not a parlay checkpoint (expected a dict with "
                              f"{_KEY!r}, got {type(obj).__name__}).")
    version = obj[_KEY]
    if not _is_int(version) or version not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{path} has checkpoint format {_show(version)}, this parlay reads "
                              f"formats 1 and {FORMAT_VERSION}.")
    verify(obj, path, required=version >= 2)  # format 1 predates checksums
    if "step" in obj and not (_is_int(obj["step"]) and obj["step"] >= 0):
        raise CheckpointError(f"{path} is corrupt: its step is {_show(obj['step'])}, expected an "
                              "int >= 0. Hint: delete it and the previous checkpoint is used.")
    identity = obj.get("identity")
    if identity is not None and not (isinstance(identity, dict) and all(
            isinstance(k, str) and _is_plain(v) for k, v in identity.items())):
        raise CheckpointError(f"{path} is corrupt: its identity record is not a mapping of plain "
                              "values. Hint: delete it and the previous checkpoint is used.")
    if step is not None and obj.get("step") != step:
        raise CheckpointError(f"it says step {obj.get('step')}, its name says {step}")
    return obj


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_plain(v: Any, depth: int = 0) -> bool:
    """Numbers, strings, None and (shallow) lists/tuples/dicts of them: what identities hold."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if depth < 4 and isinstance(v, (list, tuple)):
        return all(_is_plain(x, depth + 1) for x in v)
    if depth < 4 and isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x, depth + 1) for k, x in v.items())
    return False


def _show(v: Any) -> str:
    text = repr(v) if not isinstance(v, torch.Tensor) else f"a tensor of shape {tuple(v.shape)}"
    return text if len(text) <= 60 else text[:57] + "..."


class CheckpointManager:
    """Save and resume one rank's checkpoints in ``directory``, in step with the other ranks.

    Every rank of ``group`` must call :meth:`save` and :meth:`load_latest` at the same points.

    Args:
        directory: Folder shared by the ranks (created if missing).
        keep_last: Checkpoints to keep (older ones are deleted after a successful save).
        rank: This rank's id in file names (default: its global rank).
        group: Process group of the ranks that checkpoint together (default: the world).
        identity: What a resume must match exactly (layout, batch size, mode, model
            fingerprint; see :mod:`parlay.runinfo`); recorded in every checkpoint together with
            the run id. ``None``: nothing is checked.
        lock: Hold an exclusive lock on ``<directory>/.lock`` (taken by the group's first
            rank) until :meth:`close`, so a second run cannot share the directory.

    Raises:
        ConfigError: ``keep_last`` < 1.
        CheckpointError: The directory cannot be created, or another run holds its lock.
    """

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 3,
                 rank: int | None = None, group: Any = None, *,
                 identity: dict[str, Any] | None = None, lock: bool = False) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be an int >= 1, got {keep_last!r}.")
        self.directory = Path(directory).expanduser()
        self.keep_last = keep_last
        self.group = group
        self.identity = dict(identity) if identity is not None else None
        self.run_id: str | None = None
        self.dcp_share: tuple[int, int] | None = None  # (rank, ranks) checking the shard files
        self.rank = int(rank) if rank is not None else (
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {e}") from e
        self._lock = DirLock(self.directory)
        if lock:
            self._take_lock()
        remove_temporaries(self.directory, f"ckpt-*.rank{self.rank}.pt")

    def _take_lock(self) -> None:
        chief = not torch.distributed.is_initialized() or comm.group_rank(self.group) == 0
        holder = self._lock.acquire({"world_size": self._world()}) if chief else None
        if comm.all_ok(holder is None, self.group):
            return
        self._lock.release()
        holder = holder or self._lock.holder()
        raise CheckpointError(
            f"checkpoint_dir {self.directory} is in use by {holder}: two runs sharing one "
            "directory would resume from and prune each other's checkpoints. Fix: give this "
            "run its own checkpoint_dir, or wait for (or stop) the other run.")

    def close(self) -> None:
        """Release the directory lock (the process's exit releases it too)."""
        self._lock.release()

    # ------------------------------------------------------------------ helpers
    def path(self, step: int, rank: int | None = None) -> Path:
        """File of ``rank`` (default: this rank) for ``step``."""
        owner = self.rank if rank is None else rank
        return self.directory / f"ckpt-{int(step):010d}.rank{owner}.pt"

    def dcp_path(self, step: int) -> Path:
        """Folder of ``step``'s shards (``torch.distributed.checkpoint`` files)."""
        return self.directory / f"ckpt-{int(step):010d}.dcp"

    def steps(self) -> list[int]:
        """Steps this rank has a file for, ascending."""
        return sorted(s for s, ranks in self.written().items() if self.rank in ranks)

    def written(self) -> dict[int, set[int]]:
        """Every checkpoint file in the directory: step -> the ranks that wrote one."""
        out: dict[int, set[int]] = collections.defaultdict(set)
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m:
                out[int(m.group(1))].add(int(m.group(2)))
        return out

    def _world(self) -> int:
        if not torch.distributed.is_initialized():
            return 1
        return comm.group_size(self.group)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """``values`` as int64 on the device the group reduces (CUDA for NCCL alone)."""
        return torch.tensor(values, dtype=torch.int64, device=comm.group_device(self.group))

    # ------------------------------------------------------------------ save / load
    def save(self, step: int, state: dict[str, Any], *,
             allow_inf: Callable[[torch.Tensor], bool] | None = None,
             shards: Callable[[Path], dict[str, int]] | None = None) -> Path:
        """Write this rank's ``state`` for ``step``; prune old checkpoints once all ranks did.
        ``shards(folder)``: every rank writes the step's shards into :meth:`dcp_path` first
        and returns the CRC-32 of each file there (:func:`file_crcs`), kept under ``"dcp"``.

        A state holding a NaN, or an infinity outside tensors ``allow_inf`` accepts (e.g. a
        model's ``-inf`` attention-mask buffers), is refused on every rank: it would replace
        the good checkpoints it is meant to protect. Pruning keeps the ``keep_last - 1``
        newest older steps every rank holds besides this one (a rank holding none, new since a
        resharded resume, does not count), so the newest good checkpoint always stays (a step
        only some ranks hold is deleted). Where a process group writes ranks 0..N-1, its first rank
        also deletes the files of other ranks (left by a larger run) of this step and of the
        pruned ones.

        Raises:
            CheckpointError: Any rank failed to write or held a non-finite value (raised on
                every rank; older checkpoints are kept).
        """
        payload = dict(state)
        payload[_KEY] = FORMAT_VERSION
        payload["step"] = int(step)
        if self.identity is not None:
            if self.run_id is None:  # saving without a load_latest() first: a new run
                self.run_id = self._new_run_id()
            payload["identity"] = {**self.identity, "run_id": self.run_id}
        path = self.path(step)
        err: CheckpointError | None = None
        bad = first_nonfinite_entry(state, allow_inf)
        if bad is not None:
            err = CheckpointError(f"refusing to write the checkpoint of step {step}: {bad} "
                                  "holds a NaN or an infinity. The previous checkpoints are "
                                  "kept. Hint: Trainer(nonfinite='raise') stops before such "
                                  "an update; lower the learning rate or clip gradients.")
        chief = self._world() == 1 or comm.group_rank(self.group) == 0
        if shards is not None and chief:  # a stale one (a step saved again after a fallback)
            shutil.rmtree(self.dcp_path(step), ignore_errors=True)
        if shards is not None and comm.all_ok(err is None, self.group):
            try:
                payload["dcp"] = shards(self.dcp_path(step))
            except CheckpointError as e:
                err = e
        if err is None:
            try:
                save_atomic(payload, path)
            except CheckpointError as e:
                err = e
        if not comm.all_ok(err is None, self.group):
            if bad is None:  # (its shards go with the next save's pruning)
                path.unlink(missing_ok=True)
            raise err or CheckpointError(f"checkpoint at step {step} failed on another rank "
                                         "(see that rank's error); previous checkpoints are kept.")
        # Keep the newest keep_last - 1 older steps every rank holds: a step some rank lacks
        # (the job ended while writing it) can never be resumed, so it must not count. A rank
        # holding none (new since a resharded resume onto more ranks) does not veto them.
        held = self._held([s for s in self.steps() if s < step])
        common = sorted(set.intersection(*([h for h in held.values() if h] or [set()])))
        keep = set(common[max(0, len(common) - (self.keep_last - 1)):])
        for old in held[self.rank] - keep:
            self.path(old).unlink(missing_ok=True)
        if chief and torch.distributed.is_initialized() and sorted(held) == [*range(len(held))]:
            # This group writes ranks 0..W-1: another rank's file (seen on a shared file
            # system) is a removed rank's. Those of this step and of the pruned steps go.
            for s, ranks in self.written().items():
                if s == step or (s < step and s not in keep):
                    for r in ranks - set(range(len(held))) if s == step else ranks:
                        self.path(s, r).unlink(missing_ok=True)
        kept = {self.dcp_path(s) for s in {*self.steps(), step}}
        for folder in set(self.directory.glob("ckpt-*.dcp")) - kept if chief else ():
            shutil.rmtree(folder, ignore_errors=True)  # the shards of steps no longer kept
        return path

    def _held(self, mine: list[int]) -> dict[int, set[int]]:
        """Each rank of the group (by the rank in its file names) -> the steps of ``mine`` it
        holds (an int64 allgather: no pickles cross the network)."""
        if self._world() == 1:
            return {self.rank: set(mine)}
        counts = self._tensor([len(mine)])
        comm.allreduce(counts, "max", group=self.group)
        rows = comm.gather_ints([self.rank, *mine], int(counts.item()) + 1, self.group)
        return {r[0]: {s for s in r[1:] if s >= 0} for r in rows}

    def _common_steps(self, mine: list[int]) -> tuple[list[int], int]:
        """Steps every rank holds, and the most files any rank holds."""
        held = self._held(mine)
        return sorted(set.intersection(*held.values())), max(map(len, held.values()))

    def _new_run_id(self) -> str:
        """A fresh run id, drawn by the group's first rank and sent to the others as a tensor."""
        t = self._tensor([secrets.randbits(62)])
        if self._world() > 1:
            comm.broadcast(t, src=0, group=self.group)
        return f"{int(t.item()):016x}"

    def _check_identity(self, step: int, state: dict[str, Any]) -> None:
        """Refuse (on every rank) a checkpoint this run cannot continue exactly."""
        saved = state.get("identity") if isinstance(state.get("identity"), dict) else None
        problem = (describe_mismatch(saved, self.identity)
                   if saved is not None and self.identity is not None else None)
        rid = saved.get("run_id") if saved is not None else None
        h = int(hashlib.sha256(str(rid).encode()).hexdigest()[:15], 16)
        t = self._tensor([0 if problem else 1, h, -h])
        if self._world() > 1:
            comm.allreduce(t, "min", group=self.group)
        agreed, low, neg_high = t.tolist()
        mixed = low != -neg_high
        if problem or agreed == 0 or mixed:
            why = problem or (f"its files were written by different runs (this rank's, "
                              f"{self.path(step)}, by run {rid}; each rank's file of one step "
                              "must come from one run). Fix: put back the files of one run, or "
                              f"move step {step}'s files away to resume the step before it"
                              if mixed else
                              "another rank found its file incompatible (see that rank's error)")
            raise CheckpointError(
                f"cannot resume from checkpoint step {step} in {self.directory} (rank "
                f"{self.rank}): {why.rstrip('.')}. Nothing was deleted.")
        self.continue_run(rid if isinstance(rid, str) else None)

    def continue_run(self, run_id: str | None) -> None:
        """Go on as run ``run_id`` (a new one when ``None``), resumed by other means than
        :meth:`load_latest` (a resharded resume reads rank 0's file itself)."""
        self.run_id = run_id or self._new_run_id()
        self._lock.update({"run_id": self.run_id, "world_size": self._world()})

    def first_usable(self, steps: list[int],
                     path: Callable[[int], Path]) -> dict[str, Any] | None:
        """The state in ``path(step)`` of the newest of ``steps`` that every rank can read
        (with its shard files, each rank checking a share), or ``None``. A step unusable on
        any rank is skipped by all, with a warning naming the file and the rank."""
        for step in sorted(steps, reverse=True):
            state: dict[str, Any] | None = None
            problem = ""
            try:
                state = load(path(step), step)
                if "dcp" in state:
                    names, (me, size) = sorted(state["dcp"]), self.dcp_share or (
                        (comm.group_rank(self.group), self._world()) if self._world() > 1
                        else (0, 1))
                    for n, crc in zip(names, file_crcs(self.dcp_path(step), names, me, size)):
                        if crc not in (-2, state["dcp"][n]):
                            raise CheckpointError(f"sharded checkpoint file {self.dcp_path(step)}"
                                                  f"/{n} is missing or fails its CRC-32")
            except CheckpointError as e:
                problem, state = str(e), None
            if comm.all_ok(state is not None, self.group):
                return state
            msg = (f"checkpoint step {step} is not usable on every rank"
                   + (f" (rank {self.rank}: {problem})" if problem else "")
                   + "; falling back to the previous one.")
            warnings.warn(msg, stacklevel=3)
            log.warning(msg)
        return None

    def _incomplete(self) -> bool:
        """Some ranks hold checkpoint files, no step every rank: whether those steps were
        left incomplete by this run's layout (a rank died while saving them; warned: they
        are never resumed). Raises when the files record another run's identity (mode first);
        ``False`` when they name none, or other rank numbers (:meth:`_layout_message`).
        Each rank checks its newest file (one without: the newest step's first one), and the
        ranks agree with a max allreduce."""
        written, mine = self.written(), self.steps()
        step = max(mine or written, default=-1)
        owner = self.rank if mine else min(written.get(step, ()), default=-1)
        saved: Any = None
        if owner >= 0 and self.identity is not None:
            try:
                saved = load(self.path(step, owner), step).get("identity")
            except CheckpointError:
                pass  # unreadable: says nothing
        why, code = None, 0  # 0: unknown, 1: this layout's, 2: other rank numbers, 3: other run
        if isinstance(saved, dict) and self.identity is not None:
            why = describe_mismatch(*({k: v for k, v in d.items() if k != "dp_rank"}
                                      for d in (saved, self.identity)))
            code = 3 if why else 0 if owner != self.rank else \
                2 if describe_mismatch(saved, self.identity) else 1
        t = self._tensor([code])
        if self._world() > 1:
            comm.allreduce(t, "max", group=self.group)
        if int(t.item()) == 3:
            raise CheckpointError(
                f"cannot resume from checkpoint step {step} in {self.directory} (rank "
                f"{self.rank}): {why.rstrip('.')}. Nothing was deleted." if why else
                f"cannot resume from {self.directory}: another rank's checkpoint file was "
                "written by another run (see that rank's error). Nothing was deleted.")
        if int(t.item()) == 1:
            msg = (f"checkpoint step(s) {', '.join(map(str, sorted(written)))} in "
                   f"{self.directory} were written by only some ranks (the job ended while "
                   "saving them) and cannot be resumed: starting as with no checkpoint (from "
                   "the in-memory snapshots, if any).")
            warnings.warn(msg, stacklevel=4)
            log.warning(msg)
        return int(t.item()) == 1

    def _layout_message(self) -> str:
        """Some ranks hold checkpoints and others none: say which ranks wrote the newest one
        and which checkpoint now (called on every rank of the group)."""
        newest = self.written()
        step = max(newest, default=-1)
        had = sorted(newest.get(step, ()))
        now = sorted(r for row in comm.gather_ints([self.rank], 1, self.group) for r in row) \
            if self._world() > 1 else [self.rank]
        moved = (" The same number of ranks under other rank numbers: did the number of "
                 "parameter servers change (parlay run --ps; servers take the first ranks)?"
                 if len(had) == len(now) else "")
        return (f"cannot resume from {self.directory}: some ranks of this run hold checkpoint "
                f"files and others none (its newest checkpoint, step {step}, was written by "
                f"{len(had)} rank(s): {', '.join(map(str, had))}; this run has {len(now)} that "
                f"checkpoint: {', '.join(map(str, now))}).{moved} A run with another layout "
                "cannot continue it exactly (each rank's data shard, compression residuals and "
                "RNG are its own). Fix: relaunch with the layout that wrote it (e.g. "
                f"{len(had)} training ranks: ranks {', '.join(map(str, had))}), or start afresh "
                "with a new (or emptied) checkpoint_dir. Nothing was deleted.")

    def load_latest(self, newest: int | None = None) -> dict[str, Any] | None:
        """The newest checkpoint every rank can read (of step ``newest`` or older, when
        given), or ``None`` when there is none.

        Unreadable files are skipped with a warning on every rank (all ranks fall back to the
        same older step). With an ``identity``, the checkpoint must match it.

        Raises:
            CheckpointError: Some ranks hold checkpoints and others none (a different number
                of ranks, or another run, wrote them; steps this layout left incomplete are
                skipped with a warning), none is usable on every rank, the files of one step
                come from different runs, or the
                checkpoint's identity differs from this run's (the message says why and how
                to fix it). Raised on every rank; nothing is deleted and the lock is released.
        """
        try:
            return self._load_latest(newest)
        except CheckpointError:
            self.close()
            raise

    def _load_latest(self, newest: int | None) -> dict[str, Any] | None:
        common, most = self._common_steps(self.steps())
        if not common and most and not self._incomplete():
            raise CheckpointError(self._layout_message())
        common = [t for t in common if newest is None or t <= newest]
        state = self.first_usable(common, self.path)
        if state is not None:
            self._check_identity(state["step"], state)
        elif common:  # starting afresh would write over them: the evidence would be gone
            raise CheckpointError(
                f"no checkpoint in {self.directory} is usable on every rank (steps "
                f"{', '.join(map(str, sorted(common)))}; see the warnings). Fix: restore the "
                "files, or start afresh with a new (or emptied) checkpoint_dir. Nothing was "
                "deleted.")
        else:
            self.continue_run(None)
        return state
