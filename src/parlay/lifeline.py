"""A rank started by ``parlay run`` ends with its launcher.

torchrun starts every worker in a session of its own, so a launcher killed with SIGKILL (or by
the OOM killer) would leave its workers training on, unseen, perhaps beside a relaunched job of
the same run. ``parlay run`` exports its pid as ``PARLAY_LAUNCHER_PID``; a rank whose parent is
that process asks the kernel (Linux ``PR_SET_PDEATHSIG``) for SIGKILL when its parent goes.
torchrun's agent starts the workers from the launcher's main thread, which lives as long as the
launcher does (the kernel ties the signal to the thread that forked the child).

Ranks of one job share the launcher's stdout and stderr. Under ``PYTHONUNBUFFERED`` (set in
many containers and CI runners) ``print`` writes a line's text and its newline separately, so two
ranks' lines could splice into one. A bound rank writes whole lines instead: its streams become
line buffered, one ``write`` per line, flushed at every newline as before.

A rank's uncaught exception, from the moment parlay is imported (before ``parlay.init()``
too), goes to torchrun's error file (``TORCHELASTIC_ERROR_FILE``, torch's format) instead of
stderr: ``parlay run`` prints the traceback of the rank that caused a
failure once, with one line saying what failed, rather than every rank's consequences.

A rank's exit: ``parlay.shutdown()`` (also run at exit) destroys every group, which joins its
gloo threads, unless an object still holds the group (a pipeline stage or a parameter server
keeps its subgroups as long as the Trainer lives, so to the end of a script). Such a group's
threads outlive the interpreter's atexit stage, and one that frees a just-finished operation's
tensors during finalisation needs the GIL, can no longer take it and aborts the process
("terminate called without an active exception"). :func:`settle_groups` gives those threads a
moment with the GIL released before finalisation.
"""
from __future__ import annotations

import ctypes
import io
import json
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["bind_to_launcher", "whole_lines", "record", "record_uncaught", "track_groups",
           "settle_groups"]

_groups: list[weakref.ref[Any]] = []

_PR_SET_PDEATHSIG = 1


def bind_to_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Die with the ``parlay run`` launcher that started this process; whether it is bound.

    Only a direct child of the launcher binds (a process a rank starts itself, e.g. a data
    loader worker, has another parent and is left alone). Elsewhere than Linux, or outside
    ``parlay run``, nothing happens.
    """
    env = os.environ if environ is None else environ
    pid = env.get("PARLAY_LAUNCHER_PID", "")
    if not _launched(env):
        return False
    whole_lines()  # a rank of `parlay run`, whether or not the kernel binds it below
    record_uncaught(env.get("TORCHELASTIC_ERROR_FILE", ""))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != int(pid):  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _launched(env: Mapping[str, str]) -> bool:
    """Whether this process is a rank that ``parlay run`` started (on Linux)."""
    pid = env.get("PARLAY_LAUNCHER_PID", "")
    return sys.platform.startswith("linux") and pid.isdigit() and os.getppid() == int(pid)


def whole_lines(streams: Iterable[object] | None = None) -> None:
    """Make each text stream write one whole line per ``write`` (line buffered, no write-through).

    Streams that are not ``io.TextIOWrapper`` (replaced by a test harness or a notebook) are
    left as they are.
    """
    for stream in (sys.stdout, sys.stderr) if streams is None else streams:
        if not isinstance(stream, io.TextIOWrapper) or (stream.line_buffering
                                                        and not stream.write_through):
            continue
        try:
            stream.flush()
            stream.reconfigure(line_buffering=True, write_through=False)
        except (OSError, ValueError):
            pass


def record(value: BaseException, stack: str = "", path: str | None = None) -> bool:
    """Write ``value`` to the error file ``path`` (default ``TORCHELASTIC_ERROR_FILE``) as an
    uncaught exception is written, with ``stack`` as its traceback (``""``: the launcher
    prints none); whether it was written. ``parlay run`` names it in its summary and does
    not restart a job that failed on ``ConfigError`` only."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "") if path is None else path
    if not path:
        return False
    data = {"message": {"message": f"{type(value).__name__}: {value}", "extraInfo": {
        "py_callstack": stack, "timestamp": str(int(time.time()))}}}
    # Whole or not at all: the agent reads the file as soon as the process is gone, and
    # stops the other ranks with a signal, which may land in the middle of this write
    # (an empty file failed the agent's JSON parsing, and with it the restart).
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def record_uncaught(path: str) -> None:
    """Write this process's uncaught exception to ``path`` (torch's error-file format) instead
    of stderr; stderr still gets it if the file cannot be written. Nothing for ``path=""``."""
    if not path or getattr(sys.excepthook, "error_file", None) == path:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not record(value, "".join(traceback.format_exception(kind, value, tb)), path):
            previous(kind, value, tb)

    hook.error_file = path  # type: ignore[attr-defined]  # installed once per file
    sys.excepthook = hook


def track_groups(groups: Any = None) -> None:
    """Remember ``groups`` (default: every group torch has registered) weakly, so that
    :func:`settle_groups` sees which outlived their destruction."""
    if groups is None:
        from torch.distributed import distributed_c10d

        world = getattr(distributed_c10d, "_world", None)
        groups = list(getattr(world, "pg_map", {}))
    _prune()  # an init/shutdown loop leaves no trail of dead references
    for group in groups:
        try:
            _groups.append(weakref.ref(group))
        except TypeError:  # not weak-referenceable: nothing to settle for it
            pass


def settle_groups(wait_s: float = 0.02) -> int:
    """After the groups were destroyed: the number of tracked groups still alive (held by an
    object); when there are any, release the GIL for ``wait_s`` so that their threads finish
    freeing what they hold while the interpreter can still serve them."""
    _prune()
    if _groups:
        time.sleep(wait_s)
    return len(_groups)


def _prune() -> None:
    _groups[:] = [ref for ref in _groups if ref() is not None]


if _launched(os.environ):  # a rank of `parlay run`: recorded from import on, not from init()
    record_uncaught(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
