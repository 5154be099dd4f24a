"""Fault handling shared by parameter-server ranks: where to resume, and the launcher marker.

* :func:`agree_resume`: at start every rank lists the checkpoint steps it holds (servers their
  shard files, workers the Trainer's files) and all resume the newest step held by every rank,
  so server shards and worker state never come from different steps. Tensors only.
* :func:`mark_droppable`: an ``async``/``stale`` worker tells ``parlay run`` that losing it
  need not stop the job (the other workers go on without it); :func:`server_loss_is_fatal`
  takes that back when the worker fails because it lost a server (the job must stop, and
  ``--max-restarts`` restart it).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Iterator

import torch

from parlay import comm
from parlay.errors import CommError

__all__ = ["agree_resume", "mark_droppable", "server_loss_is_fatal", "HELD_SLOTS"]

log = logging.getLogger("parlay.ps")

#: Newest checkpoint steps each rank offers when agreeing where to resume.
HELD_SLOTS = 32


def agree_resume(held: Iterable[int], tagged: bool, world: int,
                 group: Any) -> tuple[bool, int | None]:
    """Agree, over every rank of ``group``, on the checkpoint step to resume (one allgather).

    Args:
        held: Checkpoint steps this rank holds.
        tagged: This rank keeps step-tagged checkpoints (a Trainer worker); if any rank does,
            servers checkpoint when the workers ask and resume the agreed step.
        world: Size of ``group``.
        group: Every server and worker.

    Returns:
        ``(tagged on any rank, newest step every rank holds or None)``.
    """
    steps = sorted(set(int(t) for t in held))[-HELD_SLOTS:]
    row = torch.full((HELD_SLOTS + 1,), -1, dtype=torch.int64)
    row[0] = int(tagged)
    row[1: 1 + len(steps)] = torch.tensor(steps, dtype=torch.int64)
    out = torch.empty(world * row.numel(), dtype=torch.int64)
    rows = comm.allgather_into(out, row, group=group).view(world, -1)
    any_tagged = bool(rows[:, 0].max() > 0)
    common = set.intersection(*({t for t in r[1:].tolist() if t >= 0} for r in rows))
    return any_tagged, (max(common) if any_tagged and common else None)


def mark_droppable(rank: int) -> None:
    """Write ``$PARLAY_RUN_DIR/droppable/<rank>``: ``parlay run`` keeps the other ranks running
    when a rank so marked fails. Nothing happens without ``PARLAY_RUN_DIR``."""
    path = _marker(rank)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8"):
            pass
    except OSError as e:
        log.warning("could not write %s (%s): losing this worker will stop the job under "
                    "parlay run", path, e)


def _marker(rank: int) -> str | None:
    run_dir = os.environ.get("PARLAY_RUN_DIR")
    return os.path.join(run_dir, "droppable", str(rank)) if run_dir else None


@contextlib.contextmanager
def server_loss_is_fatal(rank: int, num_servers: int) -> Iterator[None]:
    """A worker whose error names a lost server (ranks ``0..num_servers-1``) removes its
    droppable marker before the error propagates."""
    try:
        yield
    except CommError as e:
        path = _marker(rank)
        if path and e.peer is not None and 0 <= e.peer < num_servers:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise
