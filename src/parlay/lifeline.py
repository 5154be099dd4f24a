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
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Mapping

__all__ = ["bind_to_launcher", "whole_lines"]

_PR_SET_PDEATHSIG = 1


def bind_to_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Die with the ``parlay run`` launcher that started this process; whether it is bound.

    Only a direct child of the launcher binds (a process a rank starts itself, e.g. a data
    loader worker, has another parent and is left alone). Elsewhere than Linux, or outside
    ``parlay run``, nothing happens.
    """
    env = os.environ if environ is None else environ
    pid = env.get("PARLAY_LAUNCHER_PID", "")
    if not sys.platform.startswith("linux") or not pid.isdigit() or os.getppid() != int(pid):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != int(pid):  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    whole_lines()
    return True


def whole_lines(streams=None) -> None:
    """Make each text stream write one whole line per ``write`` (line buffered, no write-through).

    Streams that are not ``io.TextIOWrapper`` (replaced by a test harness or a notebook) are
    left as they are.
    """
    for stream in (sys.stdout, sys.stderr) if streams is None else streams:
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None or (stream.line_buffering and not stream.write_through):
            continue
        try:
            stream.flush()
            reconfigure(line_buffering=True, write_through=False)
        except (OSError, ValueError):
            pass
