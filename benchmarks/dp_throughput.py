"""Data-parallel throughput: PyTorch DDP vs a naive per-parameter allreduce loop vs parlay.

Two gloo processes (one thread each) train the same MLP with SGD; each round times every
contestant for the same number of steps, in an order that rotates from round to round, so
machine noise hits all of them alike. Ratios are medians over rounds of per-round ratios.
The perfect-scaling limit is 2 x the samples/s of one process alone, measured in the same rounds
(rank 0 trains alone while rank 1 waits).

    python benchmarks/dp_throughput.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, mlp as _mlp, table, write_json  # noqa: E402

import parlay  # noqa: E402
from parlay.testing import run_world  # noqa: E402

MODELS = {
    "small": ([784, 800, 800, 10], 500),
    "big": ([784, 4096, 4096, 4096, 10], 64),
}


class _Naive:
    """After backward, allreduce every gradient one by one (no fusion, no overlap)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def step(self) -> None:
        w = dist.get_world_size()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(w)
        self.opt.step()


def _bench_rank(model_name: str, steps: int, rounds: int, bucket_mb: float,
                overlap: bool = True) -> list[dict]:
    widths, batch = MODELS[model_name]
    x = torch.randn(batch, widths[0])
    y = torch.randint(0, widths[-1], (batch,))
    loss_fn = nn.CrossEntropyLoss()

    m_ddp = nn.parallel.DistributedDataParallel(_mlp(widths))
    o_ddp = torch.optim.SGD(m_ddp.parameters(), lr=0.01)
    m_nv = _mlp(widths)
    nv = _Naive(m_nv, torch.optim.SGD(m_nv.parameters(), lr=0.01))
    m_pl = _mlp(widths)
    o_pl = parlay.DistributedOptimizer(torch.optim.SGD(m_pl.parameters(), lr=0.01),
                                       named_parameters=m_pl.named_parameters(),
                                       bucket_cap_mb=bucket_mb, overlap=overlap)
    m_single = _mlp(widths)
    o_single = torch.optim.SGD(m_single.parameters(), lr=0.01)

    def step_ddp() -> None:
        o_ddp.zero_grad()
        loss_fn(m_ddp(x), y).backward()
        o_ddp.step()

    def step_naive() -> None:
        nv.opt.zero_grad()
        loss_fn(m_nv(x), y).backward()
        nv.step()

    def step_parlay() -> None:
        o_pl.zero_grad()
        loss_fn(m_pl(x), y).backward()
        o_pl.step()

    def step_single() -> None:
        o_single.zero_grad()
        loss_fn(m_single(x), y).backward()
        o_single.step()

    contestants = {"ddp": step_ddp, "naive": step_naive, "parlay": step_parlay,
                   "single": step_single}
    names = list(contestants)
    rows = []
    for fn in contestants.values():  # warm-up (allocator, gloo connections)
        if fn is step_single:
            if dist.get_rank() == 0:
                fn()
        else:
            fn()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            parlay.comm.barrier()
            t0 = time.perf_counter()
            if name == "single":
                if dist.get_rank() == 0:
                    for _ in range(steps):
                        step_single()
            else:
                for _ in range(steps):
                    contestants[name]()
            dt = time.perf_counter() - t0
            parlay.comm.barrier()
            per_rank = 1 if name == "single" else dist.get_world_size()
            rows.append({"model": model_name, "round": r, "impl": name,
                         "samples_per_s": steps * batch * per_rank / dt})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 2 min)")
    ap.add_argument("--json", default=None, help="write the JSON document here")
    ap.add_argument("--models", default="small,big")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--no-overlap", action="store_true",
                    help="parlay starts every bucket in step() instead of during backward")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    results: list[dict] = []
    summary: list[dict] = []
    ratios: dict[str, float] = {}
    for model_name in args.models.split(","):
        steps = args.steps or {"small": 6 if args.quick else 20, "big": 3 if args.quick else 8}[model_name]
        out = run_world(_bench_rank, 2, model_name, steps, rounds, args.bucket_mb,
                        not args.no_overlap,
                        timeout=1800, comm_timeout=600)
        rows = out[0]
        results += rows
        by = {(r["round"], r["impl"]): r["samples_per_s"] for r in rows}
        vs_ddp = [by[(i, "parlay")] / by[(i, "ddp")] for i in range(rounds)]
        vs_naive = [by[(i, "parlay")] / by[(i, "naive")] for i in range(rounds)]
        naive_ddp = [by[(i, "naive")] / by[(i, "ddp")] for i in range(rounds)]
        limit = {impl: [by[(i, impl)] / (2 * by[(i, "single")]) for i in range(rounds)]
                 for impl in ("ddp", "naive", "parlay")}
        ratios[f"{model_name}/parlay_vs_ddp"] = median(vs_ddp)
        ratios[f"{model_name}/parlay_vs_naive"] = median(vs_naive)
        ratios[f"{model_name}/naive_vs_ddp"] = median(naive_ddp)
        for impl in ("single", "ddp", "naive", "parlay"):
            summary.append({
                "model": model_name, "impl": impl,
                "samples/s": median([by[(i, impl)] for i in range(rounds)]),
                "frac_of_limit": median(limit[impl]) if impl != "single" else 0.5,
                "vs_ddp": median([by[(i, impl)] / by[(i, "ddp")] for i in range(rounds)]),
            })
    print(table(summary, ["model", "impl", "samples/s", "frac_of_limit", "vs_ddp"]))
    print()
    for k, v in ratios.items():
        print(f"{k:>24}: {v:.3f}")
    write_json(args.json, "dp_throughput", ratios, results, rounds=rounds,
               bucket_mb=args.bucket_mb)


if __name__ == "__main__":
    main()
