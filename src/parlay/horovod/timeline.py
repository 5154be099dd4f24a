"""Timeline: a Chrome-trace JSON (chrome://tracing, Perfetto) of the negotiated collectives.

As in Horovod, rank 0 writes it: one row per operation name, a ``NEGOTIATE_<OP>`` span from
submission until every rank asked for it, then an ``<OP>`` span while it runs, and with
``mark_cycles`` an instant ``CYCLE_START`` event per negotiation cycle. Start it with
``HOROVOD_TIMELINE=/path/file.json`` at init or with :func:`start_timeline`; the file is valid
JSON once :func:`stop_timeline` (or shutdown) closed it.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, TextIO

from parlay import runtime
from parlay.errors import ConfigError

__all__ = ["start_timeline", "stop_timeline"]


class _Timeline:
    def __init__(self, path: str, mark_cycles: bool) -> None:
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._f: TextIO = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._t0 = time.time()
        self._rows: dict[str, int] = {}
        self._kinds: dict[str, str] = {}
        self._f.write("[\n")
        self._emit({"name": "start_time_since_epoch_in_micros", "ph": "M", "pid": 0,
                    "args": {"start_time_since_epoch_in_micros": int(self._t0 * 1e6)}})

    def _ts(self) -> int:
        return int((time.time() - self._t0) * 1e6)

    def _emit(self, ev: dict[str, Any]) -> None:
        self._f.write(json.dumps(ev) + ",\n")

    def _row(self, key: str) -> int:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = len(self._rows) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": row, "args": {"name": key}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": row,
                        "args": {"sort_index": row}})
        return row

    def span(self, key: str, name: str, ph: str) -> None:
        with self._lock:
            if not self._f.closed:
                self._emit({"name": name, "ph": ph, "ts": self._ts(), "pid": self._row(key),
                            "tid": 0})

    def instant(self, name: str) -> None:
        with self._lock:
            if not self._f.closed:
                self._emit({"name": name, "ph": "i", "s": "g", "ts": self._ts(), "pid": 0,
                            "tid": 0})

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.write(json.dumps({"name": "end", "ph": "i", "s": "g", "ts": self._ts(),
                                          "pid": 0, "tid": 0}) + "\n]\n")
                self._f.close()


_tl: _Timeline | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline to ``file_path`` (rank 0 writes; a no-op elsewhere).

    Starting again switches to the new file (the old one is closed first).

    Args:
        file_path: Output JSON file.
        mark_cycles: Also mark every negotiation cycle.

    Raises:
        ConfigError: parlay is not initialised, or the file cannot be opened.
    """
    global _tl
    if not runtime.is_initialized():
        raise ConfigError("start_timeline needs hvd.init() first.")
    if runtime.rank() != 0:
        return
    stop_timeline()
    try:
        _tl = _Timeline(file_path, mark_cycles)
    except OSError as e:
        raise ConfigError(f"cannot write the timeline to {file_path!r}: {e}") from e


def stop_timeline() -> None:
    """Stop the timeline and close its file (a no-op when none is running)."""
    global _tl
    tl, _tl = _tl, None
    if tl is not None:
        tl.close()


# ------------------------------------------------------------------ engine callbacks
def negotiate_start(key: str, kind: str, rank: int) -> None:
    tl = _tl
    if tl is not None:
        tl._kinds[key] = kind.upper()
        tl.span(key, f"NEGOTIATE_{kind.upper()}", "B")


def negotiate_end(key: str, rank: int) -> None:
    tl = _tl
    if tl is not None and key in tl._kinds:
        tl.span(key, f"NEGOTIATE_{tl._kinds[key]}", "E")
        tl.span(key, tl._kinds[key], "B")


def op_end(key: str) -> None:
    tl = _tl
    if tl is not None and key in tl._kinds:
        tl.span(key, tl._kinds.pop(key), "E")


def cycle(rank: int) -> None:
    tl = _tl
    if tl is not None and tl.mark_cycles:
        tl.instant("CYCLE_START")
