"""Bytes on the wire of sharded data parallel, read from the simulated hosts' NIC counters.

Every host of a :class:`~tools.cluster.Cluster` runs :func:`main` under ``parlay run``; each
contestant is built on the same model (same seed), takes ``warmup`` steps, then ``steps`` steps
between two barriers with the host's ``eth0`` byte counters read around them. Contestants:
``ddp`` (torch DistributedDataParallel), ``parlay`` (dense ``DistributedOptimizer``),
``shard_<level>`` (``shard=level``), and single collectives on a buffer of the model's size:
``allreduce`` (gloo's), ``reduce_scatter`` and ``all_gather`` (the shard engine's ring).
One contestant at a time, freed before the next (each holds a whole model).

    python -m tools.cluster.shard_bytes --spec JSON --out PREFIX   # under parlay run, each host
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.cluster import spec_run

__all__ = ["launch", "main"]

_NIC = "/sys/class/net/eth0/statistics"


def _nic() -> dict[str, int]:
    return {k: int(Path(f"{_NIC}/{k}_bytes").read_text()) for k in ("tx", "rx")}


def _build(name: str, widths: list[int], x: Any, y: Any) -> tuple[Callable[[], None], Any]:
    """``(one step, what to keep alive)`` of contestant ``name``."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from parlay.horovod import DistributedOptimizer  # what parlay.DistributedOptimizer is
    from tools.bench.harness import mlp

    torch.manual_seed(0)
    model = mlp(widths)
    numel = sum(p.numel() for p in model.parameters())
    if name == "allreduce":
        buf = torch.ones(numel)
        return lambda: dist.all_reduce(buf), buf
    if name in ("reduce_scatter", "all_gather"):
        from parlay.dp.ring import CommThread

        n = dist.get_world_size()
        buf, thread = torch.ones(-(-numel // n) * n), CommThread()
        fn = getattr(thread.ring, name)
        return lambda: thread.submit(lambda: fn(buf)).result(), (buf, thread)
    if name == "ddp":  # same seed on every rank: no start-up broadcast needed
        model = nn.parallel.DistributedDataParallel(model, init_sync=False)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        level = None if name == "parlay" else name.removeprefix("shard_")
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(), shard=level,
            model=model if level == "parameters" else None)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step, (model, opt)


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's rows: NIC bytes per step of each contestant (inside a process group)."""
    import torch

    import parlay
    from parlay import comm
    from tools.bench.harness import MODELS, model_params

    torch.set_num_threads(1)
    widths, batch = MODELS[spec["model"]]
    g = torch.Generator().manual_seed(1 + parlay.rank())
    x, y = torch.randn(batch, widths[0], generator=g), torch.randint(0, widths[-1], (batch,),
                                                                     generator=g)
    rows = []
    for name in spec["contestants"]:
        step, keep = _build(name, widths, x, y)
        for _ in range(int(spec.get("warmup", 2))):
            step()
        n = int(spec.get("steps", 3))
        comm.barrier()
        before = _nic()
        for _ in range(n):
            step()
        comm.barrier()
        after = _nic()
        rows.append(dict(contestant=name, steps=n, host=parlay.runtime.cluster().node_rank,
                         params=model_params(widths), world=parlay.size(),
                         **{k: (after[k] - before[k]) / n for k in after}))
        if isinstance(keep, tuple) and hasattr(keep[-1], "close"):
            keep[-1].close()
        del step, keep
        gc.collect()
    return rows


def launch(spec: dict[str, Any], hosts: int = 4, rate: str | None = None,
           timeout: float = 900.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``spec`` on ``hosts`` simulated hosts of one rank each; ``(rows, cluster report)``."""
    return spec_run.launch("tools.cluster.shard_bytes", spec, hosts, rate, timeout)


def main(argv: list[str] | None = None) -> None:
    """One rank under ``parlay run`` on a simulated host: rows go to PREFIX.rankN.json."""
    spec_run.rank_main(run, "shard-bytes", 600, argv)


if __name__ == "__main__":
    main()
