"""Pipeline bubble per schedule vs theory, and parlay vs hand-written torch.distributed.pipelining.

Bubble. Every rank measures, per step, the wall time of the schedule and the time it spent
computing (inside forward, backward and loss; parlay's InstrumentedStage times them). The rest
is idle: blocked in a receive waiting for a neighbour (the bubble) or posting sends. The bubble
fraction is idle / wall, averaged over ranks and steps, compared with (S-1)/(m+S-1)
(interleaved 1F1B with v=2 virtual stages per rank: (S-1)/(2m+S-1)).

On a host with fewer cores than ranks (2 cores, 4 stages) real compute is distorted: when all
stages compute at once they time-share the cores, so "compute" stretches and the bubble
shrinks. The ``sleep`` workload therefore makes each layer's cost a sleep proportional to the
micro-batch size (forward c, backward 2c per sample) that needs no core; the schedule, the
point-to-point transfers and the autograd work are real. The ``mlp`` workload is real compute
and is reported too, with ``core_share`` = CPU seconds / wall seconds of compute (1.0 means
the rank had a core whenever it computed).

Throughput. The same MLP, split the same way, trained with the same schedule and m by parlay's
Pipeline (with its DistributedOptimizer) and by PipelineStage + Schedule written by hand, timed
interleaved step by step (the shared harness's ``time_interleaved``: each round one step of
each, in a fresh order the same on every rank); the ratio is the median of per-round ratios.

    python benchmarks/pipeline.py [--quick] [--json out.json]
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
from _common import median, table, time_interleaved, write_json  # noqa: E402

from parlay.pipeline import Pipeline, theoretical_bubble  # noqa: E402
from parlay.testing import run_world  # noqa: E402


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``c`` and backward ``2c`` seconds per sample."""

    @staticmethod
    def forward(ctx, x, c):  # type: ignore[override]
        ctx.t = 2 * c * x.shape[0]
        time.sleep(c * x.shape[0])
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(ctx.t)
        return g, None


class SleepLayer(nn.Module):
    def __init__(self, width: int, c: float) -> None:
        super().__init__()
        self.fc, self.c = nn.Linear(width, width), c

    def forward(self, x):
        return _Sleep.apply(torch.tanh(self.fc(x)), self.c)


def _model(workload: str, stages: int, width: int, c: float) -> nn.Sequential:
    torch.manual_seed(0)
    if workload == "sleep":  # two half-cost layers per rank, so interleaving (v=2) can split
        return nn.Sequential(*[SleepLayer(width, c / 2) for _ in range(2 * stages)])
    layers: list[nn.Module] = []
    for _ in range(2 * stages):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _batch(batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _bubble_rank(workload: str, schedules: list[str], chunks: list[int], steps: int,
                 batch: int, width: int, c: float) -> list[dict]:
    s = dist.get_world_size()
    x, y = _batch(batch, width)
    rows = []
    for sched in schedules:
        for m in chunks:
            pipe = Pipeline(_model(workload, s, width, c), nn.functional.mse_loss, stages=s,
                            chunks=m, schedule=sched)
            opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=1e-3))
            samples = []
            for k in range(steps + 1):
                opt.zero_grad()
                out = pipe.step(x, y)
                opt.step()
                if k:  # step 0 infers shapes and warms the sub-communicators
                    samples.append(out)
            rows.append({"workload": workload, "S": s, "schedule": sched, "m": m,
                         "ran": samples[-1].schedule, "rank": dist.get_rank(),
                         "wall_s": sum(o.wall_s for o in samples) / len(samples),
                         "bubble": sum(o.bubble for o in samples) / len(samples),
                         "core_share": sum(o.compute_cpu_s for o in samples)
                         / max(1e-9, sum(o.compute_s for o in samples))})
    return rows


def _throughput_rank(schedule: str, m: int, rounds: int, batch: int,
                     width: int) -> list[dict]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    s, r = dist.get_world_size(), dist.get_rank()
    x, y = _batch(batch, width)
    pipe = Pipeline(_model("mlp", s, width, 0.0), nn.functional.mse_loss, stages=s, chunks=m,
                    schedule=schedule)
    popt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=1e-3))
    # By hand: the same layers per rank (same split), PyTorch's stage and schedule directly.
    hand_model = _model("mlp", s, width, 0.0)
    part = pipe.partition.build(hand_model, r)
    stage = PipelineStage(part, r, s, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    hsched = cls(stage, m, loss_fn=nn.functional.mse_loss)
    hopt = torch.optim.SGD(part.parameters(), lr=1e-3)

    def parlay_step() -> None:
        popt.zero_grad()
        pipe.step(x, y)
        popt.step()

    def hand_step() -> None:
        hopt.zero_grad()
        # return_outputs=False: the same work as parlay's step (which does not merge outputs).
        if r == 0:
            hsched.step(x, return_outputs=False)
        elif r == s - 1:
            hsched.step(target=y, return_outputs=False)
        else:
            hsched.step(return_outputs=False)
        hopt.step()

    contestants = {"parlay": parlay_step, "hand": hand_step}
    for f in contestants.values():  # warm-up: shape inference, communicators
        f()
    # Samples/s of the slowest stage's step, and this rank's CPU seconds per step (what the
    # host's load does not inflate, so overhead shows there even when wall time is noisy).
    return [{"round": k, **{n: batch / t[n] for n in contestants},
             **{f"{n}_cpu_ms": 1e3 * t[n + "_cpu"] for n in contestants}}
            for k, t in enumerate(time_interleaved(contestants, rounds))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: a bad one ends in one line naming it (exit status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (< 2 min)")
    ap.add_argument("--json", default=None, help="write the JSON document here")
    ap.add_argument("--stages", default="2,4", help="pipeline depths, each at least 2")
    ap.add_argument("--workloads", default="sleep,mlp")
    ap.add_argument("--sleep-ms", type=float, default=None,
                    help="sleep per sample in forward (backward: twice); default 4 quick, 24 full")
    args = ap.parse_args(argv)
    # One stage has no bubble (theory 0): nothing to compare, and no pipeline to time.
    if not all(v.strip().isdigit() and int(v) >= 2 for v in args.stages.split(",")):
        ap.error(f"--stages takes pipeline depths of at least 2, got {args.stages!r} (one stage "
                 "has no bubble to measure). Hint: --stages 2,4")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    steps, rounds, tsteps = (2, 10, 2) if args.quick else (3, 30, 3)
    # Interleaved 1F1B (v=2 virtual stages per rank) only in the full run (time budget).
    schedules = ["gpipe", "1f1b"] + ([] if args.quick else ["interleaved"])
    # Theory counts compute only; each inter-stage message costs a fixed ~0.6-1 ms here (gloo
    # point-to-point + the schedule's Python), the same with hand-written pipelining. The full
    # run gives a micro-batch enough compute (m=8: 4 samples x 24 ms) for that to be small;
    # --quick's 4 ms shows the overhead.
    sleep_ms = args.sleep_ms or (4.0 if args.quick else 24.0)
    stages = [int(v) for v in args.stages.split(",")]
    chunks = [1, 4, 8]
    results: list[dict] = []
    ratios: dict[str, float] = {}
    bubble_rows = []
    for wl in args.workloads.split(","):
        for s in stages:
            width, batch = (16, 32) if wl == "sleep" else (1024, 256)
            per_rank = run_world(_bubble_rank, s, wl, schedules, chunks, steps, batch,
                                 width, sleep_ms / 1e3, timeout=600, comm_timeout=300)
            flat = [row for rows in per_rank for row in rows]
            results += [{"kind": "bubble_rank", **row} for row in flat]
            for sched in schedules:
                for m in chunks:
                    mine = [row for row in flat if row["schedule"] == sched and row["m"] == m]
                    v = 2 if sched == "interleaved" else 1
                    theory = theoretical_bubble(s, m, v)
                    meas = sum(row["bubble"] for row in mine) / len(mine)
                    rel = (meas - theory) / theory
                    wall = max(row["wall_s"] for row in mine)
                    bubble_rows.append({"workload": wl, "S": s, "schedule": sched,
                                        "ran": mine[0]["ran"], "m": m, "theory": theory,
                                        "measured": meas, "rel_err": rel,
                                        "step_ms": 1e3 * wall,
                                        # Idle beyond theory per message a rank receives
                                        # (2mv per step): latency + wake-up + overhead.
                                        "excess_ms_per_msg":
                                            1e3 * (meas - theory) * wall / (2 * m * v),
                                        "core_share": min(row["core_share"] for row in mine)})
                    ratios[f"bubble_{wl}_S{s}_{sched}_m{m}_measured_over_theory"] = meas / theory
    print("Bubble (idle fraction per rank, mean over ranks and steps):")
    print(table(bubble_rows, ["workload", "S", "schedule", "ran", "m", "theory", "measured",
                              "rel_err", "step_ms", "excess_ms_per_msg", "core_share"]))
    results += [{"kind": "bubble", **row} for row in bubble_rows]
    tp_rows = []
    for s in stages:
        for sched, m in (("gpipe", 4), ("1f1b", 8)):
            per_rank = run_world(_throughput_rank, s, sched, m, rounds * tsteps, 256, 512,
                                 timeout=600, comm_timeout=300)
            rows = per_rank[0]  # wall times are the slowest rank's: the same on every rank
            rs = sorted(row["parlay"] / row["hand"] for row in rows)
            ratio = median(rs)
            cpu = median([sum(r[k]["hand_cpu_ms"] / r[k]["parlay_cpu_ms"] for r in per_rank)
                          / len(per_rank) for k in range(len(rows))])
            tp_rows.append({"S": s, "schedule": sched, "m": m,
                            "parlay_samples_s": median([row["parlay"] for row in rows]),
                            "hand_samples_s": median([row["hand"] for row in rows]),
                            "parlay/hand": ratio, "q1": rs[len(rs) // 4],
                            "q3": rs[(3 * len(rs)) // 4], "cpu_hand/parlay": cpu})
            ratios[f"throughput_S{s}_{sched}_m{m}_parlay_over_hand"] = ratio
            ratios[f"cpu_S{s}_{sched}_m{m}_hand_over_parlay"] = cpu
            results += [{"kind": "throughput_round", "S": s, "schedule": sched, "m": m, **row}
                        for row in rows]
    print("\nThroughput, parlay Pipeline vs hand-written torch.distributed.pipelining "
          "(MLP 512 wide, 2 Linear+ReLU per stage, batch 256; median of interleaved rounds):")
    print(table(tp_rows, ["S", "schedule", "m", "parlay_samples_s", "hand_samples_s",
                          "parlay/hand", "q1", "q3", "cpu_hand/parlay"]))
    write_json(args.json, "pipeline", ratios, results, quick=args.quick,
               cores=os.cpu_count(), sleep_ms_per_sample=sleep_ms,
               load_average=os.getloadavg())


if __name__ == "__main__":
    main()
