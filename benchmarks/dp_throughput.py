"""Data-parallel throughput: PyTorch DDP vs a naive per-parameter allreduce loop vs parlay.

Two gloo processes (one thread each) train the same MLP with SGD. The contestants are timed
interleaved step by step (``time_interleaved`` of the shared harness, ``tools/bench``): each
round takes one step of every contestant, in an order drawn afresh each round (the same on
every rank), each step between barriers, so machine noise hits all of them alike. Ratios are
medians over rounds of per-round ratios. The perfect-scaling limit is 2 x the samples/s of one
process alone, measured in the same rounds (rank 0 steps alone while rank 1 waits).

    python benchmarks/dp_throughput.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MODELS, median, table, time_interleaved, write_json  # noqa: E402
from _common import mlp as _mlp  # noqa: E402

import parlay  # noqa: E402
from parlay.testing import run_world  # noqa: E402


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


def _bench_rank(model_name: str, rounds: int, bucket_mb: float,
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
        if dist.get_rank() == 0:  # one process alone; the other waits at the barrier
            o_single.zero_grad()
            loss_fn(m_single(x), y).backward()
            o_single.step()

    contestants = {"ddp": step_ddp, "naive": step_naive, "parlay": step_parlay,
                   "single": step_single}
    for fn in contestants.values():  # warm-up (allocator, gloo connections)
        fn()
    rows = []
    for r, times in enumerate(time_interleaved(contestants, rounds)):
        for name in contestants:
            per_rank = 1 if name == "single" else dist.get_world_size()
            rows.append({"model": model_name, "round": r, "impl": name, "step_s": times[name],
                         "samples_per_s": batch * per_rank / times[name]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 2 min)")
    ap.add_argument("--json", default=None, help="write the JSON document here")
    ap.add_argument("--models", default="small,big")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds, each one step of every contestant (default: small "
                         "120, big 48; --quick 24 and 12)")
    ap.add_argument("--steps", type=int, default=None,
                    help="alias of --rounds (each contestant takes one timed step a round)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--no-overlap", action="store_true",
                    help="parlay starts every bucket in step() instead of during backward")
    args = ap.parse_args()
    results: list[dict] = []
    summary: list[dict] = []
    ratios: dict[str, float] = {}
    counts: dict[str, int] = {}
    for model_name in args.models.split(","):
        default = {"small": 24 if args.quick else 120, "big": 12 if args.quick else 48}
        rounds = counts[model_name] = args.rounds or args.steps or default[model_name]
        out = run_world(_bench_rank, 2, model_name, rounds, args.bucket_mb,
                        not args.no_overlap, timeout=1800, comm_timeout=600)
        rows = out[0]  # the slowest rank's step times: the same rows on every rank
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
    write_json(args.json, "dp_throughput", ratios, results, rounds=counts,
               bucket_mb=args.bucket_mb, timing="interleaved step by step")


if __name__ == "__main__":
    main()
