"""Checkpoints: atomic per-rank files, keep-last-N, resume from the latest valid one.

Every rank that trains writes its own file, ``ckpt-<step>.rank<r>.pt``, because ranks own
different state (compression residuals, parameter-server versions, pipeline stages). A file is
written to a temporary name, flushed and ``fsync``-ed, then ``os.replace``-d into place, so a
crash leaves either the old file or the new one, never half of one. A checkpoint counts only
when every rank wrote its file (the ranks agree with one small allreduce), and older ones are
pruned only after that, so a failed save never leaves the run without a usable checkpoint.

Resuming picks the newest step that every rank holds and can read; an unreadable (e.g.
truncated) file makes all ranks fall back to the previous checkpoint together. Files are read
with ``torch.load(weights_only=True)``: a checkpoint cannot execute code.
"""
from __future__ import annotations

import logging
import os
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parlay import comm
from parlay.errors import CheckpointError, ConfigError

__all__ = ["save_atomic", "load", "CheckpointManager", "FORMAT_VERSION", "rng_state", "set_rng_state"]

log = logging.getLogger("parlay")

#: Bumped when the layout of the saved dictionary changes incompatibly.
FORMAT_VERSION = 1
_KEY = "parlay_checkpoint"
_NAME = re.compile(r"^ckpt-(\d{10})\.rank(\d+)\.pt$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` atomically: temp file, flush, fsync, rename.

    Raises:
        CheckpointError: The file could not be written (the previous file, if any, is intact).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except Exception as e:  # noqa: BLE001 - disk errors and unpicklable state alike
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {path}: {e}. Hint: check free disk "
                              "space and write permission of the checkpoint directory, and that the state "
                              "holds only tensors and plain Python values.") from e


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :class:`CheckpointManager` (``weights_only=True``).

    Raises:
        CheckpointError: Missing, truncated, corrupt, not a parlay checkpoint, or holding
            objects that ``weights_only`` loading refuses.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError...
        kind = "refused by weights_only loading" if "weights_only" in str(e) else "unreadable"
        raise CheckpointError(
            f"checkpoint {path} is {kind} ({type(e).__name__}: {str(e).splitlines()[0]}). "
            "Hint: the file is truncated or corrupt (e.g. the disk filled up, or the copy was "
            "cut short); delete it and the previous checkpoint is used.") from e
    if not isinstance(obj, dict) or _KEY not in obj:
        raise CheckpointError(f"{path} is not a parlay checkpoint (expected a dict with "
                              f"{_KEY!r}, got {type(obj).__name__}).")
    if obj[_KEY] != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {obj[_KEY]}, this parlay reads "
                              f"format {FORMAT_VERSION}.")
    return obj


class CheckpointManager:
    """Save and resume one rank's checkpoints in ``directory``, in step with the other ranks.

    Every rank of ``group`` must call :meth:`save` and :meth:`load_latest` at the same points.

    Args:
        directory: Folder shared by the ranks (created if missing).
        keep_last: Checkpoints to keep (older ones are deleted after a successful save).
        rank: This rank's id in file names (default: its global rank).
        group: Process group of the ranks that checkpoint together (default: the world).

    Raises:
        ConfigError: ``keep_last`` < 1.
    """

    def __init__(self, directory: str | os.PathLike[str], keep_last: int = 3,
                 rank: int | None = None, group: Any = None) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be an int >= 1, got {keep_last!r}.")
        self.directory = Path(directory).expanduser()
        self.keep_last = keep_last
        self.group = group
        self.rank = int(rank) if rank is not None else (
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {e}") from e
        for stale in self.directory.glob(f".ckpt-*.rank{self.rank}.pt.tmp*"):
            stale.unlink(missing_ok=True)  # left by a crash in the middle of a save

    # ------------------------------------------------------------------ helpers
    def path(self, step: int, rank: int | None = None) -> Path:
        """File of ``rank`` (default: this rank) for ``step``."""
        return self.directory / f"ckpt-{int(step):010d}.rank{self.rank if rank is None else rank}.pt"

    def steps(self) -> list[int]:
        """Steps this rank has a file for, ascending."""
        out = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m and int(m.group(2)) == self.rank:
                out.append(int(m.group(1)))
        return sorted(out)

    def _world(self) -> int:
        if not torch.distributed.is_initialized():
            return 1
        return comm.group_size(self.group)

    def _all(self, ok: bool) -> bool:
        if self._world() == 1:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        comm.allreduce(t, "min", group=self.group)
        return bool(t.item())

    # ------------------------------------------------------------------ save / load
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write this rank's ``state`` for ``step``; prune old checkpoints once all ranks did.

        Raises:
            CheckpointError: Any rank failed to write (raised on every rank; older
                checkpoints are kept).
        """
        payload = dict(state)
        payload[_KEY] = FORMAT_VERSION
        payload["step"] = int(step)
        path = self.path(step)
        err: CheckpointError | None = None
        try:
            save_atomic(payload, path)
        except CheckpointError as e:
            err = e
        if not self._all(err is None):
            path.unlink(missing_ok=True)
            raise err or CheckpointError(f"checkpoint at step {step} failed on another rank; "
                                         "previous checkpoints are kept (see that rank's log).")
        for old in self.steps()[:-self.keep_last]:
            self.path(old).unlink(missing_ok=True)
        return path

    def load_latest(self) -> dict[str, Any] | None:
        """The newest checkpoint every rank can read, or ``None`` when there is none.

        Unreadable files are skipped with a warning on every rank (all ranks fall back to the
        same older step).
        """
        mine = self.steps()
        if self._world() > 1:
            everyone = comm.allgather_object(mine, group=self.group)
            common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        else:
            common = set(mine)
        for step in sorted(common, reverse=True):
            state: dict[str, Any] | None = None
            problem = ""
            try:
                state = load(self.path(step))
                if state.get("step") != step:
                    problem = f"it says step {state.get('step')}, its name says {step}"
                    state = None
            except CheckpointError as e:
                problem = str(e)
            if self._all(state is not None):
                return state
            msg = (f"checkpoint step {step} is not usable on every rank"
                   + (f" (rank {self.rank}: {problem})" if problem else "")
                   + "; falling back to the previous one.")
            warnings.warn(msg, stacklevel=2)
            log.warning(msg)
        return None


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, NumPy and Python RNG states, as tensors and plain values
    (so ``weights_only`` loading accepts them)."""
    np_state: Any = np.random.get_state()
    py = random.getstate()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": {"version": py[0], "state": torch.tensor(py[1], dtype=torch.int64),
                   "gauss": py[2]},
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = st["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
