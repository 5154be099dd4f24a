"""Horovod's elastic API (``hvd.elastic``) on parlay's snapshot-and-restart path.

An elastic Horovod script runs with only the import changed::

    import parlay.horovod as hvd
    hvd.init()
    ...
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                                     # one step
            state.commit()

    train(state)

and ``parlay run -n 4 --max-restarts 3 train.py`` instead of ``horovodrun``.

**The world does not shrink or grow.** parlay's elasticity is restart-based (min = max = np):
when a rank dies, torchrun's agent stops every worker and starts them all again, up to
``--max-restarts`` times. What survives a restart is what :meth:`State.commit` wrote. A commit
copies the state in memory (for :meth:`~State.restore`, as in Horovod) and, when the launcher
can restart (``--max-restarts`` > 0) and the job has a run id (``parlay run`` gives one; on
several nodes pass ``--rdzv-id`` or set ``PARLAY_RUN_ID``), hands it to this rank's
:class:`parlay.snapshot.SnapshotStore` (host shared memory, ``$PARLAY_SNAPSHOT_DIR`` to move
it), which writes it off the critical path and atomically. In a restarted worker, :func:`run`
then (1) agrees with the other ranks, exchanging tensors, on the newest commit that every rank
holds and can read, and loads it, (2) runs the reset callbacks, (3) :meth:`~State.sync`\\ s
rank 0's state to every rank, as Horovod does, and (4) calls the training function again. Only
the steps since the last commit are recomputed (at most one when committing every batch: a
kill can cut short the write of the newest commit).

A failing collective inside the function (a :class:`~parlay.errors.CommError`, which
``HorovodInternalError`` is) is handled as in Horovod: restore the last commit, re-initialise
the process group, run the reset callbacks, sync, call the function again. When the failure is
a dead peer under ``parlay run``, the agent tears the surviving workers down within its monitor
interval anyway, so the recovery is the restart above. The in-process retry recovers when every
rank is alive (e.g. ranks that called a collective inconsistently); without a launcher that
restarts, a lost peer surfaces as a ``CommError`` from the re-initialisation, after up to twice
the timeout (the collective's, then the rendezvous'). After three retries without a commit in
between, the error is raised.

What a commit holds: ``state_dict()`` of the model, the optimizer (with compression residuals)
and any other attribute that has one (LR schedulers, ``GradScaler``, :class:`ElasticSampler`),
plain attributes (None, numbers, strings, tensors and lists/tuples/dicts of them; checked at
construction and at every commit), and this rank's random-number generators (so a retried step
draws the same dropout masks and shuffles). Snapshots are read without unpickling, and
:meth:`~State.sync` sends rank 0's state as bytes in a tensor read back with
``torch.load(weights_only=True)``, so no process can make another run code. Every rank must
commit at the same points (Horovod's commit is collective too). Snapshots are deleted once
every rank has returned from the function.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from parlay import runtime
from parlay.errors import CommError
from parlay.horovod.elastic.sampler import ElasticSampler
from parlay.horovod.elastic.state import ObjectState, State, TorchState

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "run", "MAX_RETRIES"]

log = logging.getLogger("parlay")

#: In-process retries of a failing function without a commit in between before giving up.
MAX_RETRIES = 3


def _reinit() -> None:
    """Re-create the process group with the same backend and timeout (after a failure)."""
    be, td = runtime.backend(), runtime.timeout()
    runtime.shutdown()
    runtime.init(backend=be if be in ("gloo", "nccl", "mpi") else "auto", timeout=td)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, *args, **kwargs)`` elastically (Horovod's ``hvd.elastic.run``).

    On the first call in a restarted worker, the newest commit every rank holds is loaded and
    the reset callbacks run. Before every call ``state.sync()`` makes rank 0's state everyone's.
    A :class:`~parlay.errors.CommError` (``HorovodInternalError``) raised inside ``func`` restores
    the last commit, re-initialises the process group, runs the reset callbacks and calls
    ``func`` again; after :data:`MAX_RETRIES` such failures with no commit in between, it is
    raised. Every rank must call the decorated function: entering it is collective.

    Raises:
        CommError: The function kept failing, or a restart could not re-form the group.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        reset = state._resume()
        failures, commits_seen = 0, state._commits
        while True:
            if reset:
                state.on_reset()
            state.sync()
            try:
                result = func(state, *args, **kwargs)
                break
            except CommError as e:
                failures = failures + 1 if state._commits == commits_seen else 1
                commits_seen = state._commits
                if failures > MAX_RETRIES:
                    raise
                log.warning("rank %d: restoring commit %d and retrying after: %s",
                            runtime.rank(), state._commits, e)
                state.restore()
                _reinit()
                reset = True
        state._finish()
        return result

    return wrapper
