"""Work a thread does while it waits for communication, instead of blocking.

A data-parallel step spends part of its time waiting for gradients from the other ranks. Work
that must be finished before some later point anyway (an in-memory snapshot's copy must be
done before the next optimizer step changes what it copies) can fill that time instead of
adding to the step or competing with it from another thread. :func:`while_waiting` queues such
work on the calling thread; :meth:`parlay.comm.Handle.wait` runs it while the operation is in
flight. Whatever is left when the deadline comes is finished by its owner.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["while_waiting", "discard", "idle_until"]

_local = threading.local()


def while_waiting(work: Callable[[], bool]) -> None:
    """Call ``work()`` whenever this thread waits for communication still in flight, until it
    returns False (done). The wait returns only between calls, so each call should take well
    under a millisecond (a chunk of the work); an exception drops the work (its owner finds
    out when it finishes the rest)."""
    queue = getattr(_local, "queue", None)
    if queue is None:
        queue = _local.queue = []
    queue.append(work)


def discard(work: Callable[[], bool]) -> None:
    """Unqueue ``work`` from this thread (its owner finished it): the queue keeps nothing alive
    that is done."""
    queue = getattr(_local, "queue", None)
    if queue and work in queue:
        queue.remove(work)


def idle_until(done: Callable[[], bool]) -> None:
    """Run this thread's queued work until ``done()`` (polled between calls) or none is left."""
    queue = getattr(_local, "queue", None)
    while queue and not done():
        work = queue[0]
        try:
            more = work()
        except Exception:  # noqa: BLE001 - see while_waiting
            more = False
        if not more and queue and queue[0] is work:
            queue.pop(0)
