"""Resume a checkpoint written by another number of ranks: ``Trainer(reshard=True)``.

A Trainer checkpoint is one file per rank. At the same number of ranks each rank resumes its
own file, bit for bit. Asked to reshard (mode ``"allreduce"``), a run at another number of
ranks reads every file of the newest complete step (each verified by its CRC) and builds its
own state from them:

* what every rank held alike (the model of a replicated run, the step, the loss scale, the
  learning-rate schedule) comes from rank 0's file;
* the shards of ``shard=`` runs are re-split exactly: each unit's chunks are joined in rank
  order and cut anew for this world (:func:`rechunk`);
* what belonged to a rank and has no counterpart at another world size starts afresh: its RNG
  and compression residuals. The epoch goes on from the same number of samples consumed,
  sharded over the new ranks, so the data order changes; a warning says so.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from parlay._validate import ceil_div
from parlay.checkpoint import CheckpointManager, load
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError
from parlay.rngstate import rng_state
from parlay.runinfo import LAYOUT_FIELDS, describe_mismatch

__all__ = ["load_resharded", "rechunk"]

def _newest_complete(ckpt: CheckpointManager) -> tuple[int, int] | None:
    """``(step, ranks)`` of the newest step whose files ``rank0..rank(n-1)`` are all there."""
    ranks = ckpt.written()
    for step in sorted(ranks, reverse=True):
        if ranks[step] == set(range(len(ranks[step]))):
            return step, len(ranks[step])
    return None


def rechunk(chunks: list[torch.Tensor], numel: int, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s chunk, at ``world`` ranks, of the unit of ``numel`` elements whose
    chunks (in rank order, as another number of ranks held them) are ``chunks``: exact, the
    padding zero (the layout of :mod:`parlay.dp.shard`)."""
    full = torch.cat([c.reshape(-1) for c in chunks])[:numel]
    size = ceil_div(numel, world)
    out = full.new_zeros(size)
    piece = full[rank * size:(rank + 1) * size]
    out[:piece.numel()] = piece
    return out


def _reshard_optimizer(opts: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
    # Join the chunks in the order they tile each unit (a host-first layout's differs from
    # the ranks').
    opts = sorted(opts, key=lambda o: int(o.get("parlay_shard", {}).get("rank", 0)))
    out = copy.copy(opts[0])
    out.pop("parlay_compression", None)  # each rank's residuals: they start afresh
    layout = out.get("parlay_shard")
    if layout is None:
        return out  # replicated: rank 0's is every rank's
    units, order = layout["units"], layout["order"]
    state: dict[Any, dict[str, Any]] = {}
    for k, entry in opts[0]["state"].items():
        numel = units[order[int(k)]]
        state[k] = {key: rechunk([o["state"][k][key] for o in opts], numel, world, rank)
                    if getattr(v, "dim", lambda: 0)() > 0 else v for key, v in entry.items()}
    out["state"] = state
    out["parlay_shard"] = {**layout, "world": world, "rank": rank}
    if "params" in layout:
        out["parlay_shard"]["params"] = [
            rechunk([o["parlay_shard"]["params"][u] for o in opts], units[u], world, rank)
            for u in range(len(units))]
    return out


def load_resharded(ckpt: CheckpointManager, identity: dict[str, Any], world: int,
                   rank: int, chunk: int | None = None) -> dict[str, Any] | None:
    """This rank's state from the newest checkpoint in ``ckpt``'s directory when it was
    written by another number of ranks; ``None`` when it was not (resume as usual) or there is
    none. ``chunk``: the chunk of every unit this rank holds (default ``rank``; another one
    where it reduces host first).

    Raises:
        CheckpointError: A file is unreadable, or the checkpoint is another run's (model,
            mode, batch size or settings differ).
    """
    found = _newest_complete(ckpt)
    if found is None or found[1] == world:
        return None
    step, old = found
    if identity.get("mode") != "allreduce":
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} was written by {old} "
                              f"rank(s), this run has {world}; reshard=True resumes mode "
                              "'allreduce' only. Fix: relaunch with the layout that wrote it.")
    states = [load(ckpt.path(step, r)) for r in range(old)]
    saved = {k: v for k, v in (states[0].get("identity") or {}).items()
             if k not in LAYOUT_FIELDS}
    problem = describe_mismatch(saved, {k: v for k, v in identity.items()
                                        if k not in LAYOUT_FIELDS})
    if problem:
        raise CheckpointError(f"cannot reshard checkpoint step {step} in {ckpt.directory}: "
                              f"{problem.rstrip('.')}. Nothing was deleted.")
    state = dict(states[0])
    strategy = dict(state["strategy"])
    strategy["optimizer"] = _reshard_optimizer([s["strategy"]["optimizer"] for s in states],
                                               world, rank if chunk is None else chunk)
    state["strategy"] = strategy
    trainer, sampler = dict(state["trainer"]), dict(state["sampler"])
    batch = int(state["identity"]["batch_size"])
    batches = trainer["batch_in_epoch"] * old // world  # the same samples consumed, re-sharded
    sampler.update(world=world, num_replicas=world, rank=rank, position=batches * batch)
    per_epoch = ceil_div(len(ShardedSampler(sampler["n"], world, rank, shuffle=sampler["shuffle"],
                                            drop_last=sampler["drop_last"],
                                            even=sampler["even"])), batch)
    # The schedule goes on from the steps this many ranks would have taken by now.
    trainer.update(batch_in_epoch=batches, schedule_shift=trainer["epoch"] * per_epoch
                   + batches - trainer["step"])
    state.update(trainer=trainer, sampler=sampler, rng=rng_state())
    ckpt.continue_run(str(saved.get("run_id", "")) or None)
    warnings.warn(f"resharded checkpoint step {step} written by {old} rank(s) onto {world}: "
                  "parameters and optimizer state are re-split exactly; the data order, the RNG "
                  "and any compression residuals change.", stacklevel=3)
    return state
