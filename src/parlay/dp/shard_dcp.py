"""A sharded optimizer's state in ``torch.distributed.checkpoint`` (DCP) form.

Each unit's parameter chunk and optimizer-state chunks become ``DTensor`` s sharded along
dimension 0 over the data-parallel group: the unit layout of :mod:`parlay.dp.shard` (chunks of
``ceil(numel / N)``, the last ones shorter or empty) is ``Shard(0)``'s own. ``dcp.save`` then
writes each rank's chunks, and ``dcp.load`` at another number of ranks reads exactly the ranges
each new chunk covers (resharding). Scalars (Adam's ``step``) are saved once, replicated.

    from parlay.dp.shard_dcp import dcp_state_dict, load_dcp
    dcp.save(dcp_state_dict(opt), checkpoint_id=path)     # every rank
    load_dcp(opt, path)                                   # any number of ranks, same model

(The Trainer's own checkpoints are per-rank files with CRCs, resharded on request by
:mod:`parlay.trainer.reshard`; this form is for scripts that keep DCP checkpoints.)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parlay.dp.shard import ShardedBuckets
from parlay.errors import ConfigError

__all__ = ["dcp_state_dict", "load_dcp"]


def _mesh(eng: ShardedBuckets, group: Any) -> DeviceMesh:
    if eng.rank != (dist.get_rank(group) if group is not None else dist.get_rank()):
        raise ConfigError("a host-first (hierarchical) shard layout has no DCP form: its chunks "
                          "are not in rank order. Hint: Trainer(reshard=True) reshards it.")
    device = eng.shards[0].device.type if eng.shards else "cpu"
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    return DeviceMesh.from_group(pg, device)


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
    return _state(_engine(opt), opt.optimizer, opt.process_group)


def _state(eng: ShardedBuckets, optimizer: torch.optim.Optimizer,
           group: Any) -> dict[str, Any]:
    mesh = _mesh(eng, group)
    out: dict[str, Any] = {}
    for b, (bucket, shard) in enumerate(zip(eng.plan.buckets, eng.shards)):
        out[f"param/{b}"] = _dtensor(shard.detach(), bucket.numel, eng, b, mesh)
        for name, v in optimizer.state.get(shard, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"state/{b}/{name}"] = (_dtensor(v, bucket.numel, eng, b, mesh)
                                            if v.shape == shard.shape else v)
    return out


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
    template = _state(eng, optimizer, group)
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
