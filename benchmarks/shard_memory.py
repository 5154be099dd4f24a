"""Sharded data parallel memory (issue 26): per-rank bytes of each shard level against DDP's,
and a model whose training state does not fit one rank's memory limit.

Part 1, on 4 gloo ranks, with Adam on the big MLP: each of DDP and the three shard levels runs
in a world of its own (so ``ru_maxrss`` is its own peak) and takes 3 steps; each rank then
counts the bytes it holds (distinct storages): the optimizer state (``opt.optimizer.state``),
the gradients (``opt.local_gradients()`` and any ``p.grad`` left on the model) and the
parameters (the model's tensors, the wrapped optimizer's chunk parameters and the engine's
flat unit buffers: with ``"parameters"``, the unit ``step()`` gathered for the next forward,
once that gather has landed). A level must hold at most ``1/N + 10%`` of DDP's bytes of what
it shards: ``"optimizer"`` the state, ``"gradients"`` state and gradients, ``"parameters"`` all
three.

Part 2, "beyond one rank": every rank process caps its own memory with ``RLIMIT_DATA`` at its
data size at start plus ``--budget-mb``, sized below the model's full fp32 parameters, gradients
and Adam state but above a quarter of them plus a few gathered layers. ``shard="parameters"``
on 4 ranks trains a few steps; DDP under the same cap fails with an out-of-memory error.
``RLIMIT_DATA`` rather than ``RLIMIT_AS``: the address space also counts each thread's
reserved malloc arena and stack (gloo's and the shard level's communication thread), which
differ between contestants and dwarf the data (``--calibrate`` prints both for an empty rank).
Every rank fixes glibc's mmap threshold at 1 MiB (:func:`_exact_malloc`) so freed tensors go
back to the system and the data size follows the tensors held.

    python benchmarks/shard_memory.py [--part 1|2|both] [--budget-mb 320] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MODELS, table, write_json  # noqa: E402
from _common import mlp as _mlp  # noqa: E402

import parlay  # noqa: E402
from parlay.testing import run_world  # noqa: E402

_MB = 1 << 20
WORLD = 4
BIG_WIDTHS = [2048] * 7  # part 2: 6 layers of 2048x2048, 25.2M parameters


def _vm() -> dict[str, int]:
    """This process's VmPeak, VmSize, VmData and VmRSS in bytes, and its thread count."""
    out = {}
    for line in open("/proc/self/status"):
        key, *val = line.split()
        if key in ("VmPeak:", "VmSize:", "VmData:", "VmRSS:", "Threads:"):
            out[key[:-1]] = int(val[0]) * (1024 if key != "Threads:" else 1)
    return out


def _exact_malloc() -> None:
    """Serve every allocation of 1 MiB or more with its own mmap, returned on free: glibc's
    dynamic threshold otherwise moves freed tensors of up to 32 MiB into heaps it keeps, and
    the data size would count memory no tensor holds (the same for every contestant)."""
    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _nbytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _build(widths: list[int], level: str) -> tuple[nn.Module, nn.Module, Any]:
    """(module called, module holding the parameters, optimizer) for DDP or a shard level."""
    model = _mlp(widths)
    if level == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, model, torch.optim.Adam(model.parameters())
    opt = parlay.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                      named_parameters=model.named_parameters(), shard=level,
                                      model=model if level == "parameters" else None)
    return model, model, opt


def _train(run: nn.Module, opt: Any, widths: list[int], steps: int, batch: int) -> None:
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(batch, widths[0], generator=gen)
        y = torch.randint(0, widths[-1], (batch,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(run(x), y).backward()
        opt.step()


def _count_rank(level: str, model_name: str = "big") -> dict[str, Any]:
    _exact_malloc()
    widths, batch = MODELS[model_name]
    run, model, opt = _build(widths, level)
    _train(run, opt, widths, 3, batch)
    inner = opt if level == "ddp" else opt.optimizer
    state = [t for s in inner.state.values() for t in s.values()]
    grads = [p.grad for p in model.parameters()]
    params = list(model.parameters())
    if level != "ddp":
        grads += opt.local_gradients()
        params += [p for g in inner.param_groups for p in g["params"]]
        eng = opt.shard_engine
        eng.thread.submit(lambda: None).result()  # step()'s prefetch of a unit has landed
        params += eng.flats  # "parameters": that unit, gathered for the next forward
    return {"level": level, "state": _nbytes(state), "grads": _nbytes(grads),
            "params": _nbytes(params),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def part1() -> tuple[list[dict[str, Any]], bool]:
    """Bytes per rank of each level against DDP's, on 4 ranks."""
    per: dict[str, list[dict[str, Any]]] = {}
    for level in ("ddp", "optimizer", "gradients", "parameters"):
        per[level] = run_world(_count_rank, WORLD, level, timeout=900, comm_timeout=300)
    sharded = {"ddp": (), "optimizer": ("state",), "gradients": ("state", "grads"),
               "parameters": ("state", "grads", "params")}
    ddp0 = per["ddp"][0]
    rows, ok = [], True
    for level, ranks in per.items():
        held = max(sum(r[k] for k in sharded[level]) for r in ranks) if sharded[level] else 0
        base = sum(ddp0[k] for k in sharded[level])
        ratio = held / base if base else 1.0
        holds = ratio <= 1 / WORLD + 0.10
        ok &= holds or level == "ddp"
        rows.append({"level": level, "state_MB": max(r["state"] for r in ranks) / _MB,
                     "grads_MB": max(r["grads"] for r in ranks) / _MB,
                     "params_MB": max(r["params"] for r in ranks) / _MB,
                     "sharded": "+".join(sharded[level]) or "-",
                     "ratio_to_ddp": ratio if base else None,
                     "<=1/N+10%": holds if base else None,
                     "peak_rss_MB": max(r["peak_rss"] for r in ranks) / _MB,
                     "rss_vs_ddp": max(r["peak_rss"] for r in ranks)
                     / max(r["peak_rss"] for r in per["ddp"])})
    return rows, ok


def _limited_rank(level: str, budget_mb: int, steps: int) -> dict[str, Any]:
    _exact_malloc()
    start = _vm()
    limit = start["VmData"] + budget_mb * _MB
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    out: dict[str, Any] = {"level": level, "vmdata_start_MB": start["VmData"] / _MB,
                           "limit_MB": limit / _MB, "steps": 0, "error": ""}
    try:
        run, _, opt = _build(BIG_WIDTHS, level)
        for _ in range(steps):
            _train(run, opt, BIG_WIDTHS, 1, 16)
            out["steps"] += 1
    except (RuntimeError, MemoryError) as e:
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    vm = _vm()
    out.update(vmdata_end_MB=vm["VmData"] / _MB, threads=vm["Threads"],
               peak_rss_MB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def _calibrate_rank() -> dict[str, float]:
    """An empty rank's address space and data size, then after a tiny DDP and a tiny
    ``shard="parameters"`` optimizer made and stepped (their threads started)."""
    out = {f"empty_{k}": v / _MB for k, v in _vm().items() if k != "Threads"}
    for level in ("ddp", "parameters"):
        run, _, opt = _build([64, 64, 10], level)
        _train(run, opt, [64, 64, 10], 2, 4)
        out.update({f"{level}_{k}": v / _MB for k, v in _vm().items() if k != "Threads"})
    return out


def part2(budget_mb: int, steps: int) -> list[dict[str, Any]]:
    """DDP and ``shard="parameters"`` on 4 ranks, each rank capped at start + budget."""
    n = sum(a * b + b for a, b in zip(BIG_WIDTHS[:-1], BIG_WIDTHS[1:]))
    print(f"part 2 model: {BIG_WIDTHS}, {n / 1e6:.1f}M params; fp32 params + grads + Adam = "
          f"{16 * n / _MB:.0f} MB per DDP rank (+ {4 * n / _MB:.0f} MB DDP buckets); "
          f"a quarter of it {4 * n / _MB:.0f} MB; budget {budget_mb} MB above VmData at start")
    rows = []
    for level in ("parameters", "ddp"):
        ranks = run_world(_limited_rank, WORLD, level, budget_mb, steps, timeout=300,
                          comm_timeout=120, return_exceptions=True)
        for r, res in enumerate(ranks):
            if isinstance(res, BaseException):  # a rank died outright (not a caught OOM)
                res = {"level": level, "steps": 0, "error": f"rank died: {res}"[:300]}
            rows.append({"rank": r, **res})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("1", "2", "both"), default="both")
    ap.add_argument("--budget-mb", type=int, default=320,
                    help="part 2: each rank's RLIMIT_DATA above its data size at start")
    ap.add_argument("--steps", type=int, default=3, help="part 2: training steps")
    ap.add_argument("--calibrate", action="store_true",
                    help="print an empty rank's VmPeak/VmSize/VmData before and after a tiny "
                         "DDP and shard='parameters' optimizer, then stop")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.calibrate:
        for k, v in run_world(_calibrate_rank, WORLD, timeout=300)[0].items():
            print(f"{k:>22}: {v:8.1f} MB")
        return
    rows1: list[dict[str, Any]] = []
    rows2: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    if args.part in ("1", "both"):
        rows1, ok = part1()
        print(table(rows1, ["level", "state_MB", "grads_MB", "params_MB", "sharded",
                            "ratio_to_ddp", "<=1/N+10%", "peak_rss_MB", "rss_vs_ddp"]))
        print(f"every level within 1/N + 10% of DDP: {ok}\n")
        ratios.update({f"big/shard_{r['level']}_bytes_vs_ddp": r["ratio_to_ddp"]
                       for r in rows1 if r["ratio_to_ddp"] is not None})
        ratios.update({f"big/shard_{r['level']}_rss_vs_ddp": r["rss_vs_ddp"]
                       for r in rows1 if r["level"] != "ddp"})
    if args.part in ("2", "both"):
        rows2 = part2(args.budget_mb, args.steps)
        print(table(rows2, ["level", "rank", "vmdata_start_MB", "limit_MB", "steps",
                            "vmdata_end_MB", "peak_rss_MB", "threads"]))
        for r in rows2:
            if r["error"]:
                print(f"{r['level']} rank {r['rank']}: {r['error']}")
    write_json(args.json, "shard_memory", ratios, rows1 + rows2, world=WORLD,
               budget_mb=args.budget_mb, limit="RLIMIT_DATA")


if __name__ == "__main__":
    main()
