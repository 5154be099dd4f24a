"""Who owns a run's snapshot folders, and sweeping the folders whose owner is gone.

Snapshots must outlive the processes that wrote them (a restarted job reads them), so the death
of a rank removes nothing. Folders of a run are removed

* by a rank whose training ended, when its process exits without an uncaught exception or
  the Trainer is closed (:meth:`~parlay.snapshot.SnapshotStore.clear_at_exit`), for a run id
  without an owner;
* by ``parlay run`` when it exits, for a run id it generated itself: no later job can have
  that id, so nothing could ever read them again;
* by the next ``parlay run`` on the host, for generated ids whose launcher is gone (killed
  with SIGKILL, by the OOM killer, or with its whole process group): the launcher holds an
  shared ``flock`` on ``<root>/<run>.owner`` for its lifetime, so does every rank's
  :class:`~parlay.snapshot.SnapshotStore` of that run (workers may outlive a killed launcher),
  and the kernel drops a lock when its process dies, however it dies. An exclusive lock that
  can be taken means every process of the run is gone. (A lock, not a pid: pids are reused,
  and a pid in another container's namespace says nothing here.)

Run ids a user chose (``PARLAY_RUN_ID``, ``SLURM_JOB_ID``, ``parlay run --rdzv-id``) have no
owner file and are never swept: relaunching the job with the same id resumes from them.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from parlay.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no owner files, nothing swept
    fcntl = None  # type: ignore[assignment]

__all__ = ["run_name", "RunOwner", "claim", "sweep", "hold", "hold_live", "release_live",
           "default_root", "other_recipes"]

log = logging.getLogger("parlay")

_OWNER = ".owner"
_STALE_TMP_S = 60.0  # a claim's temporary file older than this was left by a dead launcher
_DIGEST = r"-[0-9a-f]{12}"  # what run_key appends to the run name


def default_root() -> Path:
    """``$PARLAY_SNAPSHOT_DIR``, else ``/dev/shm/parlay`` (host memory), else a temp folder."""
    env = os.environ.get("PARLAY_SNAPSHOT_DIR")
    if env:
        return Path(env).expanduser()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "parlay"
    return Path(tempfile.gettempdir()) / "parlay-snapshots"


def run_name(run_id: str) -> str:
    """The part of a snapshot key (a folder name) that names run ``run_id``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:100]


def _folders(root: Path, name: str) -> list[Path]:
    pattern = re.compile(re.escape(name) + _DIGEST)
    return [d for d in root.iterdir() if d.is_dir() and pattern.fullmatch(d.name)]


def _remove_run(root: Path, name: str) -> None:
    for d in _folders(root, name):
        shutil.rmtree(d, ignore_errors=True)
    for live in root.glob(f"{glob.escape(name)}.rank*.live"):
        live.unlink(missing_ok=True)


class RunOwner:
    """The lock a live launcher holds on its run's snapshot folders (see :func:`claim`)."""

    def __init__(self, root: Path, name: str, fd: int) -> None:
        self.root, self.name, self._fd = root, name, fd

    @property
    def path(self) -> Path:
        """The owner file."""
        return self.root / f"{self.name}{_OWNER}"

    def release(self) -> None:
        """Remove the run's snapshot folders and the owner file, then drop the lock."""
        if self._fd < 0:
            return
        try:
            _remove_run(self.root, self.name)
            self.path.unlink(missing_ok=True)
        except OSError as e:
            log.debug("could not remove the snapshots of run %s: %s", self.name, e)
        finally:
            os.close(self._fd)
            self._fd = -1


def claim(run_id: str, root: str | os.PathLike[str] | None = None) -> RunOwner | None:
    """Make this process the owner of run ``run_id``'s snapshot folders until it exits or calls
    :meth:`RunOwner.release`; ``None`` where it cannot (no ``fcntl``, folder not writable:
    the run then simply has no owner and is never swept).

    The owner file is locked before it gets its name (a temporary file renamed into place),
    so a concurrent :func:`sweep` never sees it unlocked.
    """
    if fcntl is None:
        return None
    base = Path(root).expanduser() if root is not None else default_root()
    name = run_name(run_id)
    try:
        base.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=base, prefix=f".{name}.", suffix=".tmp")
    except OSError as e:
        log.debug("no owner file for run %s in %s: %s", name, base, e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        os.replace(tmp, base / f"{name}{_OWNER}")
    except OSError as e:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        log.debug("no owner file for run %s in %s: %s", name, base, e)
        return None
    return RunOwner(base, name, fd)


def _run_of(key: str) -> str | None:
    """The run name of snapshot key ``key`` (``None``: the key has no digest)."""
    m = re.fullmatch(r"(.+)" + _DIGEST, key)
    return m.group(1) if m else None


def hold(root: Path, key: str) -> int:
    """A shared lock on the owner file of snapshot key ``key``'s run, held by a rank while it
    keeps snapshots (released when the fd is closed or the process dies); ``-1`` when the run
    has no owner file (a user-chosen id: never swept)."""
    name = _run_of(key)
    if fcntl is None or name is None:
        return -1
    try:
        fd = os.open(root / f"{name}{_OWNER}", os.O_RDONLY)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while a sweep checks it (microseconds)
    except OSError:
        os.close(fd)
        return -1
    return fd


def other_recipes(root: Path, key: str, rank: int) -> list[Path]:
    """This rank's snapshot folders of the same run id as ``key`` but another recipe (another
    digest of :func:`~parlay.snapshot.resume.run_key`): a job of this recipe cannot resume
    them."""
    name = _run_of(key)
    if name is None or not root.is_dir():
        return []
    return [d / f"rank{int(rank)}" for d in _folders(root, name)
            if d.name != key and any((d / f"rank{int(rank)}").glob("*"))]


def live_path(root: Path, key: str, rank: int) -> Path:
    """The file a live rank of snapshot key ``key``'s run holds locked (see :func:`hold_live`)."""
    return root / f"{_run_of(key) or key}.rank{int(rank)}.live"


#: Live-file locks this process holds (fd -> the file's device and inode). A forked child (a
#: DataLoader worker) closes its copies: an flock belongs to the open file, so a worker orphaned
#: by its rank's SIGKILL kept the rank's lock for seconds and the restart was refused as a
#: second live job.
_live_fds: dict[int, tuple[int, int]] = {}


def _close_live_in_child() -> None:
    for fd, file in _live_fds.items():
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == file:  # (not a number reused after a plain close)
                os.close(fd)
    _live_fds.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_close_live_in_child)


def release_live(fd: int) -> None:
    """Drop a lock :func:`hold_live` returned."""
    _live_fds.pop(fd, None)
    os.close(fd)


def hold_live(root: Path, key: str, rank: int) -> int:
    """An exclusive lock on this rank's live file of snapshot key ``key``'s run *id* (whatever
    its recipe): held while the rank keeps snapshots, dropped by the kernel when the process
    dies, so a restart of the same job takes it again while a second live job with the same
    run id is refused; ``-1`` without ``fcntl``.

    Raises:
        ConfigError: Another live process holds it (the message names it).
        OSError: The file cannot be created (the snapshot folder is not writable).
    """
    if fcntl is None:
        return -1
    path = live_path(root, key, rank)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 300).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(
            f"run id {path.name.rsplit('.rank', 1)[0]!r} is in use by a live job on this host: "
            f"{holder} holds rank {rank} ({path}). Two jobs under one run id would resume from "
            "and overwrite each other's snapshots. Fix: give this job its own PARLAY_RUN_ID "
            "(or parlay run --rdzv-id), or stop the other job.") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    st = os.fstat(fd)
    _live_fds[fd] = (st.st_dev, st.st_ino)
    return fd


def _owner_gone(path: Path) -> bool:
    """Whether ``path``'s lock is free (its owner died); a free lock is left unlocked again."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # removed meanwhile by another sweep or its owner
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: the owner lives
    finally:
        os.close(fd)
    return True


def sweep(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the snapshot folders of every run whose owner is gone; returns their names.

    Folders without an owner file (ids a user chose) are left alone.
    """
    if fcntl is None:
        return []
    base = Path(root).expanduser() if root is not None else default_root()
    if not base.is_dir():
        return []
    gone = []
    try:
        for path in base.glob(f"*{_OWNER}"):
            name = path.name[: -len(_OWNER)]
            if _owner_gone(path):
                _remove_run(base, name)
                path.unlink(missing_ok=True)
                gone.append(name)
        now = time.time()
        for tmp in base.glob(".*.tmp"):  # a launcher killed while claiming
            if now - tmp.stat().st_mtime > _STALE_TMP_S and _owner_gone(tmp):
                tmp.unlink(missing_ok=True)
    except OSError as e:  # another sweep raced us: the next one finishes the job
        log.debug("snapshot sweep of %s stopped: %s", base, e)
    if gone:
        log.info("removed the snapshots of %d run(s) whose launcher is gone: %s", len(gone),
                 ", ".join(gone))
    return gone
