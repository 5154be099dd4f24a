"""In-memory snapshots: every rank keeps its newest training states in host shared memory.

A snapshot is written after every ``snapshot_every`` steps, off the critical path and atomically,
so a restarted job loses at most one step instead of everything since the last disk checkpoint.
Each rank owns a folder ``<root>/<key>/rank<r>/`` (root: ``$PARLAY_SNAPSHOT_DIR``, else
``/dev/shm/parlay``) holding

* ``data-<slot>.pt``: the tensors of one snapshot, a ``torch.save`` file that the writer maps
  ``MAP_SHARED`` once (and again only when the state's shapes change) and then copies into in
  place: one memory copy per step, no serialisation and no allocation;
* ``snap-<step>.s<slot>.json``: the commit record (step, slot, layout and the state's structure
  with its plain values), written to a temporary name and renamed.

Before a slot is overwritten its commit record is deleted, so a process killed half way through
a copy leaves the slot uncommitted and the previous snapshot intact. ``keep`` slots rotate: the
newest ``keep`` committed snapshots survive. Data is read back with
``torch.load(weights_only=True)`` and records with ``json``: a snapshot cannot execute code.

Off the critical path: the copy is the write (the file lives in host memory), and the record is
a few kilobytes; a fresh ``torch.save`` per step took ~10x the in-place copy here (15 MB MNIST
MLP with Adam), and a background ``torch.save`` cost the training thread more in GIL waits than
it saved. Tensors that training changes only inside an optimizer step (parameters, optimizer
state: the bulk of the bytes; the caller names them with ``defer``) are copied by a background
thread while the next forward and backward run (``copy_`` releases the GIL), then the record is
committed; every optimizer step in the process first waits for that copy (a global step
pre-hook). Everything else is copied before :meth:`SnapshotStore.save` returns. Files survive
the death of the process (the page cache is the file), not of the host: that is what disk
checkpoints are for, so nothing here is ``fsync``-ed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from parlay.errors import CheckpointError, ConfigError

__all__ = ["SnapshotStore", "default_root", "FORMAT_VERSION"]

log = logging.getLogger("parlay")

FORMAT_VERSION = 1  #: Bumped when the snapshot layout changes incompatibly.
_META = re.compile(r"^snap-(\d{10})\.s(\d+)\.json$")
_MKDIR_TRIES = 20  # tries to create a rank's folder while other ranks clear the run folder
_LIVE: "weakref.WeakSet[SnapshotStore]" = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_HOOKED = False


def _before_optimizer_step(*_: Any) -> None:
    for store in list(_LIVE):
        store._settle()  # noqa: SLF001


def _hook_optimizers() -> None:
    """Make every optimizer step in this process wait for pending deferred copies."""
    global _HOOKED
    with _HOOK_LOCK:
        if not _HOOKED:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(_before_optimizer_step)
            _HOOKED = True


def default_root() -> Path:
    """``$PARLAY_SNAPSHOT_DIR``, else ``/dev/shm/parlay`` (host memory), else a temp folder."""
    env = os.environ.get("PARLAY_SNAPSHOT_DIR")
    if env:
        return Path(env).expanduser()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "parlay"
    return Path(tempfile.gettempdir()) / "parlay-snapshots"


# ---------------------------------------------------------------------- structure codec
def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able structure of ``obj``; its tensors are appended to ``tensors`` (referenced,
    not copied) and replaced by their index."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            raise CheckpointError(f"snapshots hold dense tensors; the state has a {obj.layout} "
                                  "one. Hint: snapshot_every=0 for this model.")
        tensors.append(obj.detach())
        return {"T": len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {"D": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"L" if isinstance(obj, list) else "U": [_encode(v, tensors) for v in obj]}
    raise CheckpointError(f"a snapshot holds tensors, numbers, strings, None, lists, tuples and "
                          f"dicts; the state has a {type(obj).__name__}. Hint: store it as a "
                          "tensor or a plain value in state_dict().")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    (tag, value), = node.items()
    if tag == "T":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"tensor index {value!r}")
        return tensors[value]
    if tag == "D":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
    if tag not in ("L", "U") or not isinstance(value, list):
        raise ValueError(f"node {tag!r}")
    items = [_decode(v, tensors) for v in value]
    return items if tag == "L" else tuple(items)


def _layout(tensors: list[torch.Tensor]) -> str:
    sig = repr([(str(t.dtype), tuple(t.shape)) for t in tensors])
    return hashlib.sha1(sig.encode()).hexdigest()[:16]


def _read(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError...
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"snapshot file {path} is unreadable ({type(e).__name__}: {text}). "
                              "Hint: it is truncated or corrupt; the previous snapshot or the "
                              "disk checkpoint is used instead.") from e


class SnapshotStore:
    """One rank's in-memory snapshots of one run.

    Args:
        key: Identifies the run: stable across restarts of one job, distinct across jobs.
            Snapshots of another key are never read.
        rank: This rank (one folder per rank).
        root: Parent folder (default :func:`default_root`).
        keep: Committed snapshots kept (the newest ones); 2 lets a rank killed while writing
            step t still hold step t-1.

    Raises:
        ConfigError: Bad key or keep.
        CheckpointError: The folder cannot be created.
    """

    def __init__(self, key: str, rank: int, root: str | os.PathLike[str] | None = None,
                 keep: int = 2) -> None:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", key):
            raise ConfigError(f"snapshot key must be 1-200 letters, digits, '.', '_' or '-', "
                              f"got {key!r}.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}.")
        self.key, self.rank, self.keep = key, int(rank), keep
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.directory = self.root / key / f"rank{self.rank}"
        self._make_folder()
        for stale in self.directory.glob(".*.tmp*"):
            stale.unlink(missing_ok=True)  # left by a process killed while writing
        for step, slot in self._committed():
            if slot >= keep:  # written with a larger keep: its slot is never rotated again
                self._meta_path(step, slot).unlink(missing_ok=True)
        self._maps: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._error: CheckpointError | None = None

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
        held = self._committed()
        used = {slot for _, slot in held}
        free = [s for s in range(self.keep) if s not in used]
        return free[0] if free else held[0][1]

    def _mapped(self, slot: int, tensors: list[torch.Tensor], layout: str) -> list[torch.Tensor]:
        """Writable views of ``slot``'s data file with ``layout`` (the file is (re)written when
        it is missing or holds another layout, e.g. once the optimizer created its state)."""
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == layout:
            return cached[1]
        self._maps.pop(slot, None)
        path = self._data_path(slot)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            try:
                data = torch.load(path, mmap=True, weights_only=True)
                ok = isinstance(data, dict) and data.get("layout") == layout
            except Exception:  # noqa: BLE001 - missing or unreadable: write it afresh
                ok = False
            if not ok:
                tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
                try:
                    torch.save({"parlay_snapshot_data": FORMAT_VERSION, "layout": layout,
                                "tensors": [t.to("cpu", copy=True) for t in tensors]}, tmp)
                    os.replace(tmp, path)
                except OSError as e:
                    tmp.unlink(missing_ok=True)
                    raise CheckpointError(f"could not write snapshot data {path}: {e}. Hint: "
                                          "host shared memory (/dev/shm) may be full; set "
                                          "PARLAY_SNAPSHOT_DIR or snapshot_every=0.") from e
                data = torch.load(path, mmap=True, weights_only=True)
        self._maps[slot] = (layout, data["tensors"])
        return data["tensors"]

    def save(self, step: int, state: dict[str, Any], *,
             defer: frozenset[int] | set[int] = frozenset()) -> None:
        """Snapshot ``state`` as of ``step``.

        Copies every tensor into a free slot's shared-memory file (the slot of the oldest kept
        snapshot is reused once ``keep`` are held; its record is deleted first) and renames the
        commit record into place. CPU tensors whose ``data_ptr()`` is in ``defer`` (those that
        change only in an optimizer step) are copied, and the record committed, by a background
        thread; everything else is copied before this returns.

        Raises:
            CheckpointError: This or the previous snapshot could not be written (the other
                committed snapshots are intact), or the state holds something other than
                tensors and plain values.
        """
        self.wait()
        tensors: list[torch.Tensor] = []
        skeleton = _encode(state, tensors)
        layout = _layout(tensors)
        slot = self._slot_for_next()
        for old_step, old_slot in self._committed():
            if old_slot == slot or old_step == step:
                self._meta_path(old_step, old_slot).unlink(missing_ok=True)
        views = self._mapped(slot, tensors, layout)
        later = []
        with torch.no_grad():
            for dst, src in zip(views, tensors):
                if defer and src.device.type == "cpu" and src.data_ptr() in defer:
                    later.append((dst, src))
                else:
                    dst.copy_(src)
        record = {"parlay_snapshot": FORMAT_VERSION, "key": self.key, "step": int(step),
                  "slot": slot, "layout": layout, "skeleton": skeleton}
        if not later:
            self._commit(record, self._meta_path(step, slot))
            return
        _hook_optimizers()
        _LIVE.add(self)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="parlay-snapshot")
        self._pending = self._pool.submit(self._finish, later, record,
                                          self._meta_path(step, slot))

    def _finish(self, later: list[tuple[torch.Tensor, torch.Tensor]], record: dict[str, Any],
                path: Path) -> None:
        with torch.no_grad():
            for dst, src in later:
                dst.copy_(src)
        self._commit(record, path)

    @staticmethod
    def _commit(record: dict[str, Any], path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write snapshot {path}: {e}. Hint: host shared "
                                  "memory (/dev/shm) may be full; set PARLAY_SNAPSHOT_DIR or "
                                  "snapshot_every=0.") from e

    def _settle(self) -> None:
        """Wait for the pending copy; keep a failure for the next :meth:`wait` (an optimizer
        step must not fail because a snapshot did)."""
        try:
            self.wait()
        except CheckpointError as e:
            self._error = e

    def wait(self) -> None:
        """Block until the pending background copy and commit finished.

        Raises:
            CheckpointError: It failed.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        error, self._error = self._error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ reading
    def load(self, step: int) -> dict[str, Any]:
        """The state saved for ``step``.

        Raises:
            CheckpointError: No committed snapshot of ``step``, or it is corrupt, or it
                belongs to another run or format.
        """
        self._settle()
        slots = [slot for s, slot in self._committed() if s == step]
        if not slots:
            raise CheckpointError(f"rank {self.rank} holds no snapshot of step {step} in "
                                  f"{self.directory} (it has {self.steps()}).")
        path = self._meta_path(step, slots[0])
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise CheckpointError(f"snapshot record {path} is unreadable ({e}). Hint: it is "
                                  "truncated or corrupt; the previous snapshot or the disk "
                                  "checkpoint is used instead.") from e
        if not (isinstance(meta, dict) and meta.get("parlay_snapshot") == FORMAT_VERSION
                and meta.get("key") == self.key and meta.get("step") == step
                and meta.get("slot") == slots[0]):
            raise CheckpointError(f"{path} is not a format-{FORMAT_VERSION} snapshot of run "
                                  f"{self.key!r} at step {step}. Hint: delete it.")
        data = _read(self._data_path(slots[0]))
        tensors = data.get("tensors") if isinstance(data, dict) else None
        if not (isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors)
                and data.get("layout") == meta.get("layout") == _layout(tensors)):
            raise CheckpointError(f"snapshot data of step {step} in {self.directory} does not "
                                  "match its commit record (corrupt). Hint: delete the folder.")
        try:
            state = _decode(meta["skeleton"], tensors)
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

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Finish the pending copy, stop the writer thread and unmap the data files (snapshots
        stay; the next :meth:`save` maps them again)."""
        try:
            self._settle()
        finally:
            self._maps.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def clear(self) -> None:
        """Delete this rank's snapshots (and the run's folder once no rank has one left)."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        try:  # only when empty: other ranks' folders are there, or another rank removed it
            self.directory.parent.rmdir()
        except OSError:
            pass
