"""Training script the multi-node tests launch with ``parlay run`` on every simulated host.

    parlay run -n 2 --nnodes 2 --node-rank K --rdzv-endpoint HOST0:PORT \\
        tests/dist/multinode_train.py --mode allreduce|ps|hybrid --out DIR

Every rank writes ``DIR/rank<R>.json`` (where it ran, what the runtime detected) and the ranks
holding the result write ``DIR/params-*.pt``. :func:`oracle` is the single-process run the test
compares with: the same float64 model and SGD steps over the concatenated batch.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import torch.nn as nn

import parlay

STEPS, PER_RANK, LR = 3, 4, 0.1


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def batch(step: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = replicas * PER_RANK
    return (torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def oracle(replicas: int) -> dict[str, torch.Tensor]:
    """Single-process SGD over the concatenated batch of ``replicas`` replicas."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for s in range(STEPS):
        opt.zero_grad()
        x, y = batch(s, replicas)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in m.named_parameters()}


def _mine(step: int, replicas: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step, replicas)
    sl = slice(index * PER_RANK, (index + 1) * PER_RANK)
    return x[sl], y[sl]


def run_allreduce(out: str, hierarchical: str) -> None:
    m = model()
    h: bool | str = {"true": True, "false": False}.get(hierarchical, hierarchical)
    kw = {"hierarchical": h} if h is not False else {}
    opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR),
                                      named_parameters=m.named_parameters(), **kw)
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _mine(s, parlay.size(), parlay.rank())
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    if parlay.rank() == 0:
        torch.save({n: p.detach() for n, p in m.named_parameters()}, f"{out}/params-0.pt")
    _report(out, hierarchical=getattr(opt, "hierarchical", None))


def run_ps(out: str) -> None:
    spec = parlay.TaskSpec.from_env()
    m = model()
    workers, index = spec.num_workers, parlay.rank() - spec.num_ps
    with parlay.DistributedSession(task_spec=spec, model=m, optimizer=torch.optim.SGD,
                                   optimizer_args={"lr": LR}, consistency="sync",
                                   max_steps=STEPS) as sess:
        step = 0
        while not sess.should_stop():
            sess.train_step(_mine(step, workers, index), nn.functional.mse_loss)
            step += 1
    if index == 0:
        torch.save({n: p.detach() for n, p in m.named_parameters()}, f"{out}/params-0.pt")
    _report(out, is_ps=spec.is_ps)


def run_hybrid(out: str) -> None:
    from parlay.pipeline import Pipeline

    pipe = Pipeline(model(), nn.functional.mse_loss, stages=2, chunks=2)
    opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=LR))
    for s in range(STEPS):
        opt.zero_grad()
        pipe.step(*_mine(s, pipe.mesh.dp, pipe.mesh.dp_rank))
        opt.step()
    torch.save({n: p.detach() for n, p in pipe.named_parameters()},
               f"{out}/params-{parlay.rank()}.pt")
    _report(out, dp_rank=pipe.mesh.dp_rank, pp_rank=pipe.mesh.pp_rank,
            placement=getattr(pipe.mesh, "placement", None))


def _report(out: str, **extra: object) -> None:
    c = parlay.runtime.cluster()
    info = dict(rank=c.rank, world_size=c.world_size, local_rank=c.local_rank,
                node_rank=c.node_rank, num_nodes=c.num_nodes, role=c.role,
                host=int(os.environ.get("PARLAY_CLUSTER_HOST", "-1")), **extra)
    with open(f"{out}/rank{c.rank}.json", "w") as f:
        json.dump(info, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["allreduce", "ps", "hybrid"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hierarchical", default="false")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    torch.set_num_threads(1)
    parlay.init(timeout=60)
    try:
        if args.mode == "allreduce":
            run_allreduce(args.out, args.hierarchical)
        elif args.mode == "ps":
            run_ps(args.out)
        else:
            run_hybrid(args.out)
    finally:
        parlay.shutdown()


if __name__ == "__main__":
    main()
