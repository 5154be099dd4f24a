"""Resume a checkpoint written by another number of ranks: ``Trainer(reshard=True)``.

A Trainer checkpoint is one file per rank (and, for ``shard=`` runs, the shards in
``torch.distributed.checkpoint`` form beside them). At the same number of ranks each rank
resumes its own file, bit for bit. Asked to reshard (mode ``"allreduce"``), a run at another
number of ranks resumes the newest step whose files every old rank wrote:

* what every rank held alike (the model of a replicated run, the step, the loss scale, the
  learning-rate schedule) comes from rank 0's file;
* the shards of ``shard=`` runs: each rank's chunks are loaded by ``dcp.load`` at this world,
  reading only the ranges they cover (:func:`parlay.dp.shard_dcp.load_dcp`), exactly;
* what belonged to a rank and has no counterpart at another world size starts afresh: its RNG
  and compression residuals. The epoch goes on from the same number of samples consumed,
  sharded over the new ranks, so the data order changes; a warning says so.
"""
from __future__ import annotations

import warnings
from typing import Any

from parlay._validate import ceil_div
from parlay.checkpoint import CheckpointManager
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError
from parlay.rngstate import rng_state
from parlay.runinfo import LAYOUT_FIELDS, describe_mismatch

__all__ = ["load_resharded"]


def load_resharded(ckpt: CheckpointManager, identity: dict[str, Any], world: int,
                   rank: int, chunk: int | None = None) -> dict[str, Any] | None:
    """This rank's state from the newest checkpoint in ``ckpt``'s directory when it was
    written by another number of ranks; ``None`` when it was not (resume as usual) or there is
    none. ``chunk``: the chunk of every unit this rank holds (default ``rank``; another one
    where it reduces host first). A step whose files fail their checks is skipped by every
    rank, with a warning, for the previous complete one.

    Raises:
        CheckpointError: No complete step is usable, it holds shards without their DCP form
            (written before Trainer checkpoints had one), or the checkpoint is another run's
            (model, mode, batch size or settings differ).
    """
    # Per step holding rank 0's file: how many ranks 0..n-1 wrote theirs. Its writer's world
    # (rank 0's identity) says the rest: torn if larger; files of higher ranks are leftovers.
    have = {s: min(set(range(len(r) + 1)) - r) for s, r in ckpt.written().items() if 0 in r}
    state: dict[str, Any] | None = None
    torn: set[int] = set()
    for step in sorted(have, reverse=True):
        state = ckpt.first_usable([step], lambda s: ckpt.path(s, 0))  # (it warns if not)
        old = have[step] if state is None else (state.get("identity") or {}).get(
            "world_size", have[step])
        if state is not None and old > have[step]:  # ranks 0..n-1 of a larger run: torn
            state = None
            torn.add(step)
            warnings.warn(f"checkpoint step {step} holds the files of {have[step]} of its {old} "
                          "ranks (the job ended while writing it): falling back to the "
                          "previous one.", stacklevel=3)
        if state is not None and old == world:  # this world's: resume as usual
            return None
        if state is not None:
            break
    if state is None:
        if torn == set(have):  # only steps left incomplete: resume as usual (which says so)
            return None
        raise CheckpointError(f"no checkpoint in {ckpt.directory} is usable on every rank (see "
                              "the warnings). Nothing was deleted.")
    if identity.get("mode") != "allreduce":
        raise CheckpointError(f"checkpoint step {step} in {ckpt.directory} was written "
                              f"by {old} rank(s), this run has {world}; "
                              "reshard=True resumes mode 'allreduce' only. Fix: relaunch with "
                              "the layout that wrote it.")
    saved = {k: v for k, v in (state.get("identity") or {}).items() if k not in LAYOUT_FIELDS}
    problem = describe_mismatch(saved, {k: v for k, v in identity.items()
                                        if k not in LAYOUT_FIELDS})
    opt = dict(state["strategy"]["optimizer"])
    layout = opt.get("parlay_shard")
    if layout is not None and "dcp" not in state:
        problem = problem or ("its shards were written before Trainer checkpoints kept them in "
                              f"torch.distributed.checkpoint form: resume it at {old} ranks")
    if problem:
        raise CheckpointError(f"cannot reshard checkpoint step {step} in {ckpt.directory}: "
                              f"{problem.rstrip('.')}. Nothing was deleted.")
    opt.pop("parlay_compression", None)  # each rank's residuals: they start afresh
    if layout is not None:  # its chunks come from the DCP form, at this world
        opt["parlay_shard"] = {**layout, "world": world, "rank": rank if chunk is None else chunk}
    state["strategy"] = {**state["strategy"], "optimizer": opt}
    trainer, sampler = dict(state["trainer"]), dict(state["sampler"])
    batch = int(state["identity"]["batch_size"])
    # The samples consumed, re-sharded: rounded down to whole steps of the new world, so up to
    # one step's samples less one are trained again (rather than skipped).
    batches = trainer["batch_in_epoch"] * old // world
    sampler.update(world=world, num_replicas=world, rank=rank, position=batches * batch)
    per_epoch = ceil_div(len(ShardedSampler(sampler["n"], world, rank, shuffle=sampler["shuffle"],
                                            drop_last=sampler["drop_last"],
                                            even=sampler["even"])), batch)
    # The schedule goes on from the steps this many ranks would have taken by now.
    trainer.update(batch_in_epoch=batches, schedule_shift=trainer["epoch"] * per_epoch
                   + batches - trainer["step"])
    state.update(trainer=trainer, sampler=sampler, rng=rng_state())
    state.pop("metrics", None)  # one rank's share of the epoch's loss: not this rank's now
    ckpt.continue_run(str(saved.get("run_id", "")) or None)
    warnings.warn(f"resharded checkpoint step {step} written by {old} rank(s) onto {world}: "
                  "parameters and optimizer state are re-split exactly; the data order, the RNG "
                  "and any compression residuals change.", stacklevel=3)
    return state
