"""Fallback resume: a rank that lost its snapshots gets the replicated state from a replica.

When no step is held by every rank (e.g. one host's ``/dev/shm`` is gone with the host), the
ranks take the newest step that at least one member of every *replica group* holds (the ranks
whose model and optimizer state are identical: all data-parallel ranks, or one pipeline stage
across its replicas). In each replica group with a rank lacking that step, the lowest holder
broadcasts the replicated part of its state over c10d: a JSON description and then the tensors,
so nothing is unpickled from the network. Holders resume exactly; the others get the model,
optimizer and step, and the caller re-derives what is private to a rank. Only when that saves
more than one step over resuming exactly from the disk checkpoint (or the start).
"""
from __future__ import annotations

import json
import logging
from typing import Any
from collections.abc import Callable

import torch

from parlay import comm
from parlay.errors import CheckpointError
from parlay.snapshot.codec import decode, encode
from parlay.snapshot.store import SnapshotStore

__all__ = ["share_newest"]

log = logging.getLogger("parlay")

_WIDTH = 17  # replica-group id + the newest 16 steps of each rank


def _newest_covered(rows: list[list[int]], bad: set[tuple[int, int]]) -> int | None:
    """Newest step of which every replica group has a holder not known to be unreadable."""
    groups = {row[0] for row in rows}
    steps = sorted({s for row in rows for s in row[1:] if s >= 0}, reverse=True)
    for step in steps:
        if all(any(row[0] == g and step in row[1:] and (r, step) not in bad
                   for r, row in enumerate(rows)) for g in groups):
            return step
    return None


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"a peer described a snapshot tensor of dtype {name!r}.")
    return dt


def _broadcast(payload: dict[str, Any] | None, src: int, group: Any) -> dict[str, Any]:
    """Send ``payload`` (on group rank ``src``) to every member of ``group``: tensors only."""
    tensors: list[torch.Tensor] = []
    desc = b""
    if payload is not None:
        skeleton = encode(payload, tensors)
        desc = json.dumps({"skeleton": skeleton, "tensors": [
            [str(t.dtype), list(t.shape)] for t in tensors]}).encode()
    dev = comm.group_device(group)  # CUDA for a NCCL-only group; the state returns on CPU
    size = torch.tensor([len(desc)], dtype=torch.int64, device=dev)
    comm.broadcast(size, src, group)
    buf = (torch.frombuffer(bytearray(desc), dtype=torch.uint8).to(dev) if payload is not None
           else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
    comm.broadcast(buf, src, group)
    meta = json.loads(bytes(buf.cpu().tolist()).decode())
    if payload is not None:
        tensors = [t.to(dev).contiguous() for t in tensors]
    else:
        tensors = [torch.empty(shape, dtype=_dtype(name), device=dev)
                   for name, shape in meta["tensors"]]
    for t in tensors:
        if t.numel():
            comm.broadcast(t, src, group)
    return decode(meta["skeleton"], [t.cpu() for t in tensors])


def _load_newest(store: SnapshotStore, rows: list[list[int]], me: int,
                 group: Any) -> tuple[int, dict[str, Any] | None, list[int]] | None:
    """Agree on the step (skipping copies some holder cannot read) and load it on holders."""
    bad: set[tuple[int, int]] = set()
    while True:
        step = _newest_covered(rows, bad)
        if step is None:
            return None
        state = None
        holds = step in rows[me][1:]
        if holds:
            try:
                state = store.load(step)
            except CheckpointError as e:
                log.warning("rank %d: %s", store.rank, e)
        flag = 1 if state is not None else (0 if holds else -1)
        flag_list = [r[0] for r in comm.gather_ints([flag], 1, group)]
        bad |= {(r, step) for r, f in enumerate(flag_list) if f == 0}
        if _newest_covered(rows, bad) == step:
            return step, state, flag_list


def share_newest(store: SnapshotStore, group: Any, replica_group: Any, after: int,
                 replicated: Callable[[dict[str, Any]], dict[str, Any]]
                 ) -> tuple[int, dict[str, Any], bool] | None:
    """Resume from the newest step above ``after`` that every replica group holds somewhere.

    Every rank of ``group`` must call this. Returns ``(step, state, exact)``: a rank that holds
    the step gets its own state (``exact``); a rank that does not gets ``replicated(state)`` of
    the lowest holder in its ``replica_group``. ``None`` when some replica group holds nothing
    newer than ``after + 1`` (every rank gets the same answer): resuming exactly from ``after``
    (the disk checkpoint, or the start) then costs at most the one step that an inexact resume
    would save. That is the usual case after a kill: the killed rank's newest snapshot was not
    committed yet while the survivors committed theirs, one step ahead, before they noticed.
    """
    me = comm.group_rank(group)
    head = comm.to_global_rank(replica_group, 0)
    recent = [s for s in store.steps() if s > after][-(_WIDTH - 1):]
    rows = comm.gather_ints([head] + recent, _WIDTH, group)
    newest = _newest_covered(rows, set())
    if newest is None or newest <= after + 1:
        return None  # see above: sharing would save at most one step over an exact resume
    found = _load_newest(store, rows, me, group)
    if found is None or found[0] <= after + 1:
        return None
    step, state, flags = found
    members = [r for r, row in enumerate(rows) if row[0] == head]
    holders = [r for r in members if flags[r] == 1]
    if len(holders) == len(members):
        return step, state, True  # type: ignore[return-value]
    lacking = [comm.to_global_rank(group, r) for r in members if flags[r] != 1]
    src_global = comm.to_global_rank(group, holders[0])
    replicas = [comm.to_global_rank(replica_group, i)
                for i in range(comm.group_size(replica_group))]
    log.warning("rank(s) %s hold no usable snapshot of step %d: rank %d sends them its model "
                "and optimizer state", lacking, step, src_global)
    payload = replicated(state) if me == holders[0] else None  # type: ignore[arg-type]
    got = _broadcast(payload, replicas.index(src_global), replica_group)
    if state is not None:
        return step, state, True
    return step, got, False
