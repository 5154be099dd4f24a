"""Data-parallel throughput: PyTorch DDP vs a naive per-parameter allreduce loop vs parlay.

Two gloo processes (one thread each) train the same MLP with SGD. The contestants are timed
interleaved step by step (``time_interleaved`` of the shared harness, ``tools/bench``): each
round takes one step of every contestant, in an order drawn afresh each round (the same on
every rank), each step between barriers, so machine noise hits all of them alike. Ratios are
medians over rounds of per-round ratios. The perfect-scaling limit is 2 x the samples/s of one
process alone, measured in the same rounds (rank 0 steps alone while rank 1 waits).

    python benchmarks/dp_throughput.py [--quick] [--json out.json]

``--rows shard`` times the shard levels instead (issue 26) on the big MLP at 2 and 4 ranks,
with Adam, interleaved the same way: DDP, parlay ``shard="optimizer"``, ``"gradients"``,
``"parameters"`` and FSDP2 (``fully_shard`` per Linear and the root,
``reshard_after_forward=False``), every contestant on the same model and the same batch.

    python benchmarks/dp_throughput.py --rows shard [--worlds 2,4] [--rounds 10] [--json out.json]
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

    m_ddp = nn.parallel.DistributedDataParallel(_mlp(widths), bucket_cap_mb=bucket_mb)
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


SHARD_IMPLS = ("ddp", "shard_optimizer", "shard_gradients", "shard_parameters", "fsdp2")


def _fsdp2(widths: list[int]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = _mlp(widths), init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh, reshard_after_forward=False)


def _shard_rank(model_name: str, rounds: int, bucket_mb: float) -> tuple[list[dict], str]:
    """DDP, the three shard levels and FSDP2, all with Adam, timed interleaved."""
    widths, batch = MODELS[model_name]
    gen = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own batch
    x = torch.randn(batch, widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    models: dict[str, nn.Module] = {"ddp": nn.parallel.DistributedDataParallel(
        _mlp(widths), bucket_cap_mb=bucket_mb)}
    opts: dict[str, torch.optim.Optimizer] = {"ddp": torch.optim.Adam(models["ddp"].parameters())}
    for level in ("optimizer", "gradients", "parameters"):
        m = models[f"shard_{level}"] = _mlp(widths)
        opts[f"shard_{level}"] = parlay.DistributedOptimizer(
            torch.optim.Adam(m.parameters()), named_parameters=m.named_parameters(),
            bucket_cap_mb=bucket_mb, shard=level, model=m if level == "parameters" else None)
    fsdp_error = ""
    try:
        models["fsdp2"] = _fsdp2(widths)
        opts["fsdp2"] = torch.optim.Adam(models["fsdp2"].parameters())
    except Exception as e:  # noqa: BLE001 - reported in the output instead of a row
        fsdp_error = f"{type(e).__name__}: {e}"

    def stepper(name: str):  # type: ignore[no-untyped-def]
        def step() -> None:
            opts[name].zero_grad()
            loss_fn(models[name](x), y).backward()
            opts[name].step()
        return step

    contestants = {name: stepper(name) for name in models}
    for fn in contestants.values():  # warm-up (allocator, gloo connections, Adam state)
        fn()
    world = dist.get_world_size()
    rows = [{"model": model_name, "world": world, "round": r, "impl": name,
             "step_s": times[name], "samples_per_s": batch * world / times[name]}
            for r, times in enumerate(time_interleaved(contestants, rounds))
            for name in contestants]
    return rows, fsdp_error


def _shard_rows(args: argparse.Namespace) -> None:
    results: list[dict] = []
    summary: list[dict] = []
    ratios: dict[str, float] = {}
    notes: dict[str, str] = {}
    rounds = args.rounds or (5 if args.quick else 10)
    for world in (int(w) for w in args.worlds.split(",")):
        rows, fsdp_error = run_world(_shard_rank, world, "big", rounds, args.bucket_mb,
                                     timeout=1800, comm_timeout=600)[0]
        results += rows
        if fsdp_error:
            notes[f"fsdp2_{world}"] = fsdp_error
            print(f"FSDP2 could not run at {world} ranks: {fsdp_error}")
        by = {(r["round"], r["impl"]): r["samples_per_s"] for r in rows}
        impls = [i for i in SHARD_IMPLS if (0, i) in by]

        def vs(a: str, b: str, by: dict = by) -> float:
            return median([by[(i, a)] / by[(i, b)] for i in range(rounds)])

        for impl in impls:
            summary.append({"world": world, "impl": impl,
                            "samples/s": median([by[(i, impl)] for i in range(rounds)]),
                            "vs_ddp": vs(impl, "ddp"),
                            "vs_fsdp2": vs(impl, "fsdp2") if "fsdp2" in impls else None})
        for level in ("optimizer", "gradients", "parameters"):
            ratios[f"big/parlay_shard_{level}_vs_ddp@{world}"] = vs(f"shard_{level}", "ddp")
        if "fsdp2" in impls:
            ratios[f"big/parlay_shard_parameters_vs_fsdp2@{world}"] = \
                vs("shard_parameters", "fsdp2")
            ratios[f"big/fsdp2_vs_ddp@{world}"] = vs("fsdp2", "ddp")
    for key in [k for k in ratios if k.endswith(f"@{args.worlds.split(',')[0]}")]:
        ratios[key.split("@")[0]] = min(v for k, v in ratios.items()   # the worst world
                                        if k.split("@")[0] == key.split("@")[0])
    print(table(summary, ["world", "impl", "samples/s", "vs_ddp", "vs_fsdp2"]))
    print()
    for k, v in ratios.items():
        print(f"{k:>44}: {v:.3f}")
    write_json(args.json, "dp_throughput", ratios, results, rounds=rounds, optimizer="Adam",
               bucket_mb=args.bucket_mb, timing="interleaved step by step", notes=notes)


def default_rounds(model_name: str, quick: bool) -> int:
    """Timed rounds of a model of the dense rows: as "small" (120, --quick 24) under 5M
    parameters, else as "big" (48, --quick 12)."""
    widths = MODELS[model_name][0]
    if sum(a * b for a, b in zip(widths, widths[1:])) < 5_000_000:
        return 24 if quick else 120
    return 12 if quick else 48


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: a bad one ends in one line naming it (exit status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 2 min)")
    ap.add_argument("--json", default=None, help="write the JSON document here")
    ap.add_argument("--models", default="small,big")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds, each one step of every contestant (default: small "
                         "120, big 48; --quick 24 and 12; --rows shard 10, --quick 5)")
    ap.add_argument("--steps", type=int, default=None,
                    help="alias of --rounds (each contestant takes one timed step a round)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--no-overlap", action="store_true",
                    help="parlay starts every bucket in step() instead of during backward")
    ap.add_argument("--rows", choices=("dense", "shard"), default="dense",
                    help="dense: DDP/naive/parlay with SGD (default); shard: DDP, the three "
                         "shard levels and FSDP2 with Adam on the big MLP")
    ap.add_argument("--worlds", default="2,4", help="ranks for --rows shard")
    args = ap.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else args.steps
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds/--steps must be at least 1, got {args.rounds}. Hint: drop it for "
                 "the default")
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(map(repr, unknown))}. Hint: one or more of "
                 f"{','.join(MODELS)}")
    if not all(w.strip().isdigit() and int(w) >= 2 for w in args.worlds.split(",")):
        ap.error(f"--worlds takes rank counts of at least 2, got {args.worlds!r}. Hint: "
                 "--worlds 2,4")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rows == "shard":
        _shard_rows(args)
        return
    results: list[dict] = []
    summary: list[dict] = []
    ratios: dict[str, float] = {}
    counts: dict[str, int] = {}
    for model_name in args.models.split(","):
        rounds = counts[model_name] = args.rounds or default_rounds(model_name, args.quick)
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
