"""In-memory snapshots: every rank keeps its newest training states in host shared memory.

A snapshot is written after every ``snapshot_every`` steps, off the critical path and atomically,
so a restarted job loses at most one step instead of everything since the last disk checkpoint.
Each rank owns a folder ``<root>/<key>/rank<r>/`` (root: ``$PARLAY_SNAPSHOT_DIR``, else
``/dev/shm/parlay``) holding

* ``data-<slot>.pt``: the large tensors of one snapshot, a ``torch.save`` file that the writer
  maps ``MAP_SHARED`` once and then copies into in place: one memory copy per step and no
  serialisation (a fresh ``torch.save`` of a 15 MB MLP state costs ~10x more CPU here);
* ``snap-<step>.s<slot>.pt``: the commit record (step, slot, the state's structure as JSON and
  its small tensors), written by a background thread to a temporary name and renamed.

Before a slot is overwritten its commit record is deleted, so a process killed half way through
a copy leaves the slot uncommitted and the previous snapshot intact. ``keep`` slots rotate: the
newest ``keep`` committed snapshots survive. Everything is read back with
``torch.load(weights_only=True)`` and ``json``: a snapshot cannot execute code.
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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from parlay.errors import CheckpointError, ConfigError

__all__ = ["SnapshotStore", "default_root", "FORMAT_VERSION"]

log = logging.getLogger("parlay")

#: Bumped when the snapshot layout changes incompatibly.
FORMAT_VERSION = 1
_META = re.compile(r"^snap-(\d{10})\.s(\d+)\.pt$")
# Tensors at least this large live in the mapped data slot; smaller ones are cloned into the
# commit record (their copy is cheaper than a storage record in the slot file).
_BIG_BYTES = 16 * 1024


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
def _is_big(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.numel() * t.element_size() >= _BIG_BYTES


def _encode(obj: Any, big: list[torch.Tensor], small: list[torch.Tensor]) -> Any:
    """JSON-able structure of ``obj``; tensors are appended to ``big``/``small`` (small ones
    cloned to the CPU now, big ones referenced and copied by the caller)."""
    if isinstance(obj, torch.Tensor):
        if _is_big(obj):
            big.append(obj.detach())
            return {"B": len(big) - 1}
        small.append(obj.detach().to("cpu", copy=True))
        return {"S": len(small) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {"D": [[_encode(k, big, small), _encode(v, big, small)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"L" if isinstance(obj, list) else "U": [_encode(v, big, small) for v in obj]}
    raise CheckpointError(f"a snapshot holds tensors, numbers, strings, None, lists, tuples and "
                          f"dicts; the state has a {type(obj).__name__}. Hint: store it as a "
                          "tensor or a plain value in state_dict().")


def _decode(node: Any, big: list[torch.Tensor], small: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    (tag, value), = node.items()
    if tag == "B":
        return big[value]
    if tag == "S":
        return small[value]
    if tag == "D":
        return {_decode(k, big, small): _decode(v, big, small) for k, v in value}
    items = [_decode(v, big, small) for v in value]
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
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create snapshot folder {self.directory}: {e}. Hint: "
                                  "set PARLAY_SNAPSHOT_DIR to a writable folder.") from e
        for stale in self.directory.glob(".*.tmp*"):
            stale.unlink(missing_ok=True)  # left by a process killed while writing
        for step, slot in self._committed():
            if slot >= keep:  # written with a larger keep: its slot is never rotated again
                self._meta_path(step, slot).unlink(missing_ok=True)
        self._maps: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    # ------------------------------------------------------------------ files
    def _meta_path(self, step: int, slot: int) -> Path:
        return self.directory / f"snap-{int(step):010d}.s{slot}.pt"

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

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as of ``step``; returns once the state was copied.

        The large tensors are copied into this slot's shared-memory file on the calling thread
        (so training may change them right after); the commit record is written and renamed
        by a background thread. Waits for the previous commit first.

        Raises:
            CheckpointError: This or the previous snapshot could not be written (the older
                committed snapshots are intact).
        """
        self.wait()
        big: list[torch.Tensor] = []
        small: list[torch.Tensor] = []
        skeleton = json.dumps(_encode(state, big, small))
        layout = _layout(big)
        slot = self._slot_for_next()
        for old_step, old_slot in self._committed():
            if old_slot == slot or old_step == step:
                self._meta_path(old_step, old_slot).unlink(missing_ok=True)
        views = self._mapped(slot, big, layout)
        with torch.no_grad():
            for dst, src in zip(views, big):
                dst.copy_(src)
        meta = {"parlay_snapshot": FORMAT_VERSION, "key": self.key, "step": int(step),
                "slot": slot, "layout": layout, "skeleton": skeleton, "small": small}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="parlay-snapshot")
        self._pending = self._pool.submit(self._commit, meta, self._meta_path(step, slot))

    @staticmethod
    def _commit(meta: dict[str, Any], path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            torch.save(meta, tmp)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write snapshot {path}: {e}. Hint: host shared "
                                  "memory (/dev/shm) may be full; set PARLAY_SNAPSHOT_DIR or "
                                  "snapshot_every=0.") from e

    def wait(self) -> None:
        """Block until the pending commit finished.

        Raises:
            CheckpointError: It failed.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------------ reading
    def load(self, step: int) -> dict[str, Any]:
        """The state saved for ``step``.

        Raises:
            CheckpointError: No committed snapshot of ``step``, or it is corrupt, or it
                belongs to another run or format.
        """
        self.wait()
        slots = [slot for s, slot in self._committed() if s == step]
        if not slots:
            raise CheckpointError(f"rank {self.rank} holds no snapshot of step {step} in "
                                  f"{self.directory} (it has {self.steps()}).")
        path = self._meta_path(step, slots[0])
        meta = _read(path)
        if not (isinstance(meta, dict) and meta.get("parlay_snapshot") == FORMAT_VERSION
                and meta.get("key") == self.key and meta.get("step") == step):
            raise CheckpointError(f"{path} is not a format-{FORMAT_VERSION} snapshot of run "
                                  f"{self.key!r} at step {step}. Hint: delete it.")
        data = _read(self._data_path(slots[0]))
        tensors = data.get("tensors") if isinstance(data, dict) else None
        if not isinstance(tensors, list) or data.get("layout") != meta.get("layout") \
                or _layout(tensors) != meta.get("layout"):
            raise CheckpointError(f"snapshot data of step {step} in {self.directory} does not "
                                  "match its commit record (corrupt). Hint: delete the folder.")
        try:
            state = _decode(json.loads(meta["skeleton"]), tensors, list(meta["small"]))
        except (ValueError, KeyError, IndexError, TypeError) as e:
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
        """Finish the pending commit and stop the writer thread (snapshots stay)."""
        try:
            self.wait()
        finally:
            self._maps.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def clear(self) -> None:
        """Delete this rank's snapshots (and the run's folder once no rank has one left)."""
        try:
            self.close()
        except CheckpointError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            self.directory.parent.rmdir()
        except OSError:
            pass  # other ranks' folders are still there
