"""A snapshot's copies that may wait: done while the rank waits for communication, at the
latest before the next optimizer step.

Parameters and optimizer state (most of a snapshot's bytes) change only inside an optimizer
step, so their copy into the snapshot can be done any time before the next one. A
:class:`DeferredCopy` does it in chunks of about ``CHUNK_BYTES`` while the training thread waits
in :meth:`parlay.comm.Handle.wait` for the gradient reduction (:func:`parlay.idle.while_waiting`:
time the thread would spend blocked, on the core it already holds; no second thread competes
with it for the core or the GIL), then commits the snapshot. Whatever is left when an optimizer
step begins is finished first: every optimizer step in the process waits for the deferred copies
of the live stores (a global step pre-hook, registered once).
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any
from collections.abc import Callable

import torch

from parlay.idle import discard, while_waiting
from parlay.integrity import tensor_crc

__all__ = ["DeferredCopy", "CHUNK_BYTES", "settle_before_optimizer_steps"]

#: Bytes copied per call while waiting: small, so a wait returns at most one chunk's copy late.
CHUNK_BYTES = 1 << 19

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_HOOKED = False


def _before_optimizer_step(*_: Any) -> None:
    for store in list(_LIVE):
        store._settle()  # noqa: SLF001


def settle_before_optimizer_steps(store: Any) -> None:
    """Make every optimizer step in this process, and its exit, first call ``store._settle()``
    (``store`` is held weakly)."""
    global _HOOKED
    _LIVE.add(store)
    with _HOOK_LOCK:
        if not _HOOKED:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(_before_optimizer_step)
            atexit.register(_before_optimizer_step)  # an exit keeps the newest snapshot too
            _HOOKED = True


class DeferredCopy:
    """Copies ``dst.copy_(src)`` of ``pairs`` in chunks, then calls ``commit``; :attr:`crcs`
    holds each ``dst``'s CRC-32 (:func:`parlay.integrity.tensor_crc`), computed chunk by chunk
    right after the copy, while the bytes are still in the cache.

    :meth:`step` (queued by :meth:`start` to run while this thread waits for communication)
    does one chunk; :meth:`finish` does the rest at once, on any thread. A failure of a copy
    or of ``commit`` is kept in :attr:`error` and ends the work; :attr:`seconds` adds up the
    time spent in both (plus what the caller put there to start with).
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 commit: Callable[[], None]) -> None:
        self._pairs = pairs
        self._commit = commit
        self._i = 0      # next pair
        self._off = 0    # elements of it already copied
        self._lock = threading.Lock()
        self.done = False
        self.error: Exception | None = None
        self.seconds = 0.0
        self.crcs = [0] * len(pairs)

    def start(self) -> DeferredCopy:
        """Queue the chunks on this thread's waits for communication."""
        while_waiting(self.step)
        return self

    def step(self) -> bool:
        """Copy one chunk (or commit); False once everything is done."""
        with self._lock:
            if not self.done:
                t0 = time.perf_counter()
                self._advance(chunked=True)
                self.seconds += time.perf_counter() - t0
            return not self.done

    def finish(self) -> None:
        """Copy what is left and commit."""
        with self._lock:
            t0 = time.perf_counter()
            while not self.done:
                self._advance(chunked=False)
            self.seconds += time.perf_counter() - t0
        discard(self.step)  # on the thread that queued it, else done and dropped at its next wait

    def _advance(self, chunked: bool) -> None:
        try:
            if self._i == len(self._pairs):
                self.done = True
                self._commit()
                return
            dst, src = self._pairs[self._i]
            with torch.no_grad():
                chunk = CHUNK_BYTES // max(1, src.element_size())
                if chunked and src.is_contiguous() and dst.numel() - self._off > chunk:
                    end = self._off + chunk
                    piece = dst.view(-1)[self._off:end]
                    piece.copy_(src.view(-1)[self._off:end])
                    self.crcs[self._i] = tensor_crc([piece], self.crcs[self._i])
                    self._off = end
                    return
                if self._off:
                    piece = dst.view(-1)[self._off:]
                    piece.copy_(src.view(-1)[self._off:])
                else:
                    piece = dst
                    dst.copy_(src)
                self.crcs[self._i] = tensor_crc([piece], self.crcs[self._i])
            self._i, self._off = self._i + 1, 0
        except Exception as e:  # noqa: BLE001 - reported by the store's wait()
            self.done, self.error = True, e
