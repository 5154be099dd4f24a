"""A sharded optimizer's state in ``torch.distributed.checkpoint`` (DCP) form.

Each unit's parameter chunk and optimizer-state chunks become ``DTensor`` s sharded along
dimension 0 over the data-parallel group: the unit layout of :mod:`parlay.dp.shard` (chunks of
``ceil(numel / N)``, the last ones shorter or empty) is ``Shard(0)``'s own. ``dcp.save`` then
writes each rank's chunks, and ``dcp.load`` at another number of ranks reads exactly the ranges
each new chunk covers (resharding). Scalars (Adam's ``step``) are saved once, replicated. A
host-first layout (``hierarchical``), whose ranks hold the chunks in another order, shards over
a mesh listing the ranks in chunk order.

    from parlay.dp.shard_dcp import dcp_state_dict, load_dcp
    dcp.save(dcp_state_dict(opt), checkpoint_id=path)     # every rank
    load_dcp(opt, path)                                   # any number of ranks, same model

The Trainer's checkpoints of ``shard=`` runs in mode ``"allreduce"`` write this form with
:func:`save_dcp` beside their per-rank files, which record its CRCs (:mod:`parlay.checkpoint`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parlay import comm
from parlay.integrity import file_crcs
from parlay.dp.shard import ShardedBuckets
from parlay.errors import CheckpointError, ConfigError
from parlay.nonfinite import first_nonfinite_entry

__all__ = ["dcp_state_dict", "load_dcp", "save_dcp"]


def _mesh(eng: ShardedBuckets, group: Any) -> DeviceMesh:
    """The group as a 1-D mesh whose coordinate of each rank is the chunk it holds (every
    rank calls it: the ranks tell each other their chunks)."""
    device = eng.shards[0].device.type if eng.shards else "cpu"
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    chunks = [row[0] for row in comm.gather_ints([eng.rank], 1, pg)]
    if chunks == sorted(chunks):
        return DeviceMesh.from_group(pg, device)
    ranks = dist.get_process_group_ranks(pg)  # host first: list them in chunk order
    order = sorted(range(len(ranks)), key=chunks.__getitem__)
    return DeviceMesh(device, torch.tensor([ranks[g] for g in order], dtype=torch.int),
                      _init_backend=False)


def _dtensor(local: torch.Tensor, numel: int, eng: ShardedBuckets, b: int,
             mesh: DeviceMesh) -> DTensor:
    valid = max(0, min(eng.chunk[b], numel - eng.rank * eng.chunk[b]))
    return DTensor.from_local(local[:valid], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def _engine(opt: Any) -> ShardedBuckets:
    eng = getattr(opt, "shard_engine", None)
    if not isinstance(eng, ShardedBuckets):
        raise ConfigError("DCP shard states are for DistributedOptimizer(shard=...); an "
                          "unsharded optimizer's state_dict() is the same on every rank.")
    return eng


def dcp_state_dict(opt: Any) -> dict[str, Any]:
    """The chunks of sharded ``opt`` (a :class:`~parlay.DistributedOptimizer`) on this rank as
    a DCP state dict (``param/u``, ``state/u/<name>`` for each unit ``u``)."""
    eng = _engine(opt)
    return _state(eng, opt.optimizer, _mesh(eng, opt.process_group))


def _state(eng: ShardedBuckets, optimizer: torch.optim.Optimizer,
           mesh: DeviceMesh) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b, (bucket, shard) in enumerate(zip(eng.plan.buckets, eng.shards)):
        out[f"param/{b}"] = _dtensor(shard.detach(), bucket.numel, eng, b, mesh)
        for name, v in optimizer.state.get(shard, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"state/{b}/{name}"] = (_dtensor(v, bucket.numel, eng, b, mesh)
                                            if v.shape == shard.shape else v)
    return out


def save_dcp(opt: Any, folder: Path) -> dict[str, int]:
    """:func:`dcp_state_dict` of ``opt`` saved into ``folder`` (every rank), then the CRC-32 of
    each file there, each read back by one rank and shared (int64 tensors).

    Raises:
        CheckpointError: On every rank: a chunk holds a NaN or an infinity (nothing is
            written), or the folder could not be written or read back.
    """
    group, shards = opt.process_group, dcp_state_dict(opt)
    bad = first_nonfinite_entry({k: v.to_local() if isinstance(v, DTensor) else v
                                 for k, v in shards.items()}, where="shards")
    if not comm.all_ok(bad is None, group):
        raise CheckpointError(f"refusing to write {folder}: {bad or 'a chunk of another rank'} "
                              "holds a NaN or an infinity. The previous checkpoints are kept.")
    try:
        meta = dcp.save(shards, checkpoint_id=folder, process_group=group)
        names = sorted({".metadata", *(m.relative_path for m in meta.storage_data.values())})
        rows = comm.gather_ints(
            file_crcs(folder, names, comm.group_rank(group), comm.group_size(group)),
            len(names), group)
    except Exception as e:  # noqa: BLE001 - DCP raises every rank's failure on every rank
        raise CheckpointError(f"could not write the sharded checkpoint {folder}: {e}. Hint: "
                              "check free disk space and write permission.") from e
    crcs = {n: max(r[i] for r in rows) for i, n in enumerate(names)}
    if min(crcs.values()) < 0:
        raise CheckpointError(f"could not read back the sharded checkpoint {folder}.")
    return crcs


def load_dcp(opt: Any, path: str) -> None:
    """Load what :func:`dcp_state_dict` saved at ``path`` into sharded ``opt``, at any number
    of ranks (every rank calls it).

    Raises:
        ConfigError: The checkpoint holds other units (another model or bucket size).
    """
    eng, optimizer, group = _engine(opt), opt.optimizer, opt.process_group
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    numels = {k: int(m.size[0]) for k, m in saved.items()
              if k.startswith("param/") and isinstance(m, TensorStorageMetadata)}
    mine = {f"param/{b}": bucket.numel for b, bucket in enumerate(eng.plan.buckets)}
    if numels != mine:
        raise ConfigError(f"the DCP checkpoint at {path} holds units {sorted(numels.values())}, "
                          f"this optimizer {sorted(mine.values())}: build the same model with the "
                          "same bucket_cap_mb (and shard level) as the run that saved it.")
    mesh = _mesh(eng, group)
    template = _state(eng, optimizer, mesh)
    chunks: dict[str, torch.Tensor] = {}
    for key, meta in saved.items():
        if not key.startswith("state/") or not isinstance(meta, TensorStorageMetadata):
            continue
        b = int(key.split("/")[1])
        shard = eng.shards[b]
        if len(meta.size) == 1 and meta.size[0] == eng.plan.buckets[b].numel:
            chunks[key] = torch.zeros_like(shard, dtype=meta.properties.dtype)
            template[key] = _dtensor(chunks[key], eng.plan.buckets[b].numel, eng, b, mesh)
        else:
            template[key] = chunks[key] = torch.zeros(meta.size, dtype=meta.properties.dtype)
    for b in range(len(eng.shards)):
        eng.release(b)  # nothing gathered from the chunks about to change
    dcp.load(template, checkpoint_id=path, process_group=group)  # in place, into the views
    for key, value in chunks.items():
        _, unit, name = key.split("/", 2)
        optimizer.state[eng.shards[int(unit)]][name] = value
    eng.gather_all()  # every rank's loaded chunks into the parameters
