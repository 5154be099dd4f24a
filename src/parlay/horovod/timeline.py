"""Timeline: a Chrome trace (chrome://tracing, Perfetto) of the Horovod-style operations,
recorded by ``torch.profiler`` on rank 0 (as in Horovod, rank 0 writes it).

Each operation shows as a span named after it (``allreduce.grads``) holding a
``NEGOTIATE_<OP>`` span while ranks agree on it and an ``<OP>`` span while it runs; with
``mark_cycles`` every negotiation round is a ``CYCLE_START`` span. The profiler's own CPU events
come with them. Start it with ``HOROVOD_TIMELINE=/path/file.json`` at init or with
:func:`start_timeline`; the file is written when :func:`stop_timeline` (or shutdown) runs.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import torch.profiler

from parlay import runtime
from parlay.errors import ConfigError

__all__ = ["start_timeline", "stop_timeline"]

_state: dict[str, Any] = {}   # "prof", "path", "cycles", "t0" while a timeline records


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a timeline for ``file_path`` (rank 0 records; a no-op elsewhere).

    Starting again writes the running timeline to its file and starts a new one.

    Args:
        file_path: Output JSON file.
        mark_cycles: Also mark every negotiation round.

    Raises:
        ConfigError: parlay is not initialised, or the file cannot be written.
    """
    if not runtime.is_initialized():
        raise ConfigError("start_timeline needs hvd.init() first.")
    if runtime.rank() != 0:
        return
    stop_timeline()
    try:
        open(file_path, "w", encoding="utf-8").close()   # fail now, not at stop
    except OSError as e:
        raise ConfigError(f"cannot write the timeline to {file_path!r}: {e}") from e
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    prof.start()
    _state.update(prof=prof, path=file_path, cycles=mark_cycles, t0=time.time())


def stop_timeline() -> None:
    """Stop the timeline and write its file (a no-op when none is running)."""
    if not _state:
        return
    prof, path, t0 = _state["prof"], _state["path"], _state["t0"]
    _state.clear()
    prof.stop()
    prof.export_chrome_trace(path)
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    # Horovod's timeline names its epoch; tools that merge ranks' timelines read it.
    trace["start_time_since_epoch_in_micros"] = int(t0 * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)


@contextlib.contextmanager
def span(key: str | None, name: str) -> Iterator[None]:
    """Record ``name`` (inside a span named ``key``) while a timeline records."""
    if not _state:
        yield
        return
    with contextlib.ExitStack() as stack:
        if key is not None:
            stack.enter_context(torch.profiler.record_function(key))
        stack.enter_context(torch.profiler.record_function(name))
        yield


def cycle() -> contextlib.AbstractContextManager[Any]:
    """A ``CYCLE_START`` span around one negotiation round (with ``mark_cycles``)."""
    if _state.get("cycles"):
        return torch.profiler.record_function("CYCLE_START")
    return contextlib.nullcontext()
