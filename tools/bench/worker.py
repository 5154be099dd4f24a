"""The rank side of the benchmarks: time contestants side by side in one process group.

Every rank of a launch runs :func:`run_spec` with the same spec and returns its own rows; the
orchestrator (:mod:`tools.bench.launch`) gathers them. A spec is a plain dict::

    {"kind": "dp", "model": "suite", "contestants": ["compute", "none", "ddp", "fp16",
     "pipe:1f1b", ...], "warmup": 1, "steps": 3, "budget": 8.0}
    {"kind": "ps", "model": "suite", "consistencies": ["sync", "stale:2", "async"], ...}

Contestants: ``compute`` (the same step with communication skipped: the limit), ``ddp``
(PyTorch's DistributedDataParallel), ``none``/``parlay`` (parlay dense), any compressor spec
(``fp16``, ``topk:0.01``, ``auto``...), ``flat``/``hier`` (flat vs hierarchical allreduce) and
``pipe:SCHEDULE`` (every rank one pipeline stage, the global batch in ``chunks`` micro-batches;
its row carries one step's compute intervals per rank: the timeline).

On a simulated cluster each host's interface is ``eth0``; its byte counters are read around the
timed steps (on loopback there is no per-host counter and those fields are 0).

    python -m tools.bench.worker --spec JSON --out PREFIX   # under parlay run, on each host
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any
from collections.abc import Callable

from tools.bench.contestants import contestant as _contestant
from tools.bench.harness import model_params, rounds, slowest
from tools.bench.probes import codec_spec, ps_exchange, spec_widths, timed_next_to

__all__ = ["run_spec", "main"]

_NIC = "/sys/class/net/eth0/statistics"


def _nic() -> dict[str, int]:
    # Only inside a simulated host is eth0 this rank's own link (on loopback it is the
    # machine's, carrying everyone's traffic).
    if "PARLAY_CLUSTER_HOST" not in os.environ or not os.path.isdir(_NIC):
        return {"tx": 0, "rx": 0}
    return {k: int(open(f"{_NIC}/{k}_bytes").read()) for k in ("tx", "rx")}


class _Timing:
    """One contestant's timed steps so far: step seconds, each probe's seconds, NIC bytes."""

    def __init__(self, probes: dict[str, Callable] | None) -> None:
        self.probes = probes or {}
        self.steps: list[float] = []
        self.probed: dict[str, list[float]] = {k: [] for k in self.probes}
        self.nic = {"tx": 0, "rx": 0}

    def once(self, step: Callable, x: Any, y: Any) -> None:
        """Every probe once, then one step, each between barriers (every rank together)."""
        from parlay import comm

        before = _nic()
        for k, fn in self.probes.items():
            t0 = time.perf_counter()
            fn()
            self.probed[k].append(time.perf_counter() - t0)
            comm.barrier()
        t0 = time.perf_counter()
        step(x, y)
        self.steps.append(time.perf_counter() - t0)
        comm.barrier()
        after = _nic()
        for k in self.nic:
            self.nic[k] += after[k] - before[k]

    def result(self) -> tuple[float, dict[str, float], dict[str, int]]:
        """(median s per step, {probe: median s}, NIC bytes): medians of the per-step maximum
        over the ranks."""
        med = {k: statistics.median(slowest(v)) for k, v in self.probed.items()}
        return statistics.median(slowest(self.steps)), med, dict(self.nic)


def _timed(step: Callable, x: Any, y: Any, n: int, opt: Any,
           probes: dict[str, Callable] | None = None) -> tuple:
    """Time ``n`` steps, each between barriers; before each, every probe once (the
    compute-only step, the codec, link probes): same moment, same load, since the machine's
    cores are shared with other processes whose load drifts. Returns (median s per step,
    {probe: median s}, NIC bytes, comm_stats before and after); each median is of the per-step
    maximum over the ranks."""
    from parlay import comm

    before = opt.comm_stats() if opt is not None else None
    timing = _Timing(probes)
    comm.barrier()
    for _ in range(n):
        timing.once(step, x, y)
    return (*timing.result(), (before, opt.comm_stats() if opt is not None else None))


def _steps_in_budget(first_s: float, steps: int, budget: float) -> int:
    """Timed steps for a contestant whose first step took ``first_s`` on the slowest rank
    (0: the first step is the measurement; its start-up cost is small next to it)."""
    if first_s > budget:
        return 0
    return max(1, min(steps, int(budget / max(first_s, 1e-6))))


def _prepare(name: str, spec: dict[str, Any], x: Any, y: Any,
             cstep: Callable) -> dict[str, Any]:
    """Build contestant ``name``, take its first and warm-up steps (and ``auto``'s trial), and
    size its timed steps from the budget: everything before its timed steps."""
    import parlay

    widths, _ = spec_widths(spec)
    step, opt = _contestant(name, widths, int(spec.get("chunks", 4)))
    pipe = name.startswith("pipe:")
    xs, ys = (x.repeat(parlay.size(), 1), y.repeat(parlay.size())) if pipe else (x, y)
    if pipe:  # the timeline of the first step, replaced by the first timed one if any
        step.recorder.on = True  # type: ignore[attr-defined]
    compute = {"compute": lambda: cstep(x, y)}  # this point's own compute-only limit
    first = _timed(step, xs, ys, 1, opt, compute)
    # "auto" measures before it decides, then runs its close contenders a few steps each
    # (its trial): its steady state is timed, after both (every rank runs the same schedule).
    settle = int(spec.get("warmup", 1)) - 1 + (2 if name == "auto" else 0)
    for _ in range(settle - 1):
        step(xs, ys)
    for _ in range(64):
        if not getattr(getattr(opt, "compression", None), "trialing", None):
            break
        step(xs, ys)
    # The step that sizes the budget: the first one, or the last warm-up step (auto's first
    # step also measures the link and every candidate's codec, and is no guide).
    if settle:
        first = _timed(step, xs, ys, 1, opt, compute)
    # Every rank runs the same number of steps: first[0] is already the slowest rank's.
    n = _steps_in_budget(first[0], int(spec.get("steps", 3)), float(spec.get("budget", 8)))
    return dict(name=name, step=step, opt=opt, xs=xs, ys=ys, n=n, first=first, pipe=pipe,
                timing=_Timing(timed_next_to(name, spec, opt, cstep, x, y)),
                stats0=opt.comm_stats() if opt is not None else None)


def _row(c: dict[str, Any], batch: int) -> dict[str, Any]:
    """A prepared contestant's row, from its timed steps (or its sizing step, if none)."""
    import parlay

    name, opt, step = c["name"], c["opt"], c["step"]
    if c["n"]:
        dt, probed, nic = c["timing"].result()
        stats: Any = (c["stats0"], opt.comm_stats() if opt is not None else None)
    else:
        dt, probed, nic, stats = c["first"]
    n = max(c["n"], 1)
    samples = batch * parlay.size()  # pipeline: the same global batch through one replica
    row: dict[str, Any] = dict(contestant=name, step_s=dt, samples_s=samples / dt, steps=n,
                               nic_tx=nic["tx"] / n, nic_rx=nic["rx"] / n,
                               compute_step_s=probed["compute"])
    if "codec" in probed:  # the probes' own medians, measured in this run
        row["codec_s"], row["codec"] = probed["codec"], codec_spec(name, opt)
    if "copy" in probed:
        row["probe_copy_s"] = probed["copy"]
    if "act" in probed:  # a round trip: two transfers
        row["probe_act_s"] = probed["act"] / 2
    if "dense" in probed:
        row["probe_tiny_s"], row["probe_dense_s"] = probed["tiny"], probed["dense"]
        row["probe_half_s"] = probed.get("half")
    if opt is not None:
        row["wire_bytes"] = (stats[1]["wire_bytes"] - stats[0]["wire_bytes"]) / n
        row["cross_host_bytes"] = stats[1].get("cross_host_bytes_per_step", 0.0)
        choice = getattr(opt.compression, "describe", None)
        if callable(choice):  # "auto": what it chose, and its trial's measurements
            row["chose"] = str(choice())
            row["trial"] = [[h[0], h[3], h[4]] for h in opt.compression.history
                            if h[4].startswith("trial")]
    if c["pipe"]:
        p = step.pipe
        row.update(events=step.recorder.events, stage=p.mesh.pp_rank,
                   bubble=step.last["bubble"], compute_s=step.last["compute"],
                   act_bytes=step.last["act_bytes"], chunks=p.chunks)
    return row


def _time_dp(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every contestant prepared, then their timed steps interleaved step by step
    (:func:`tools.bench.harness.rounds`): round ``i`` takes step ``i`` of each contestant that
    has one left, in an order drawn afresh each round (the same on every rank)."""
    import torch

    from parlay import comm

    widths, batch = spec_widths(spec)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (batch,), generator=g)
    cstep, _ = _contestant("compute", widths)
    cstep(x, y)
    prepared = [_prepare(name, spec, x, y, cstep) for name in spec["contestants"]]
    for c in prepared:  # the first timed step's timeline replaces the first step's
        if c["pipe"] and c["n"]:
            c["step"].recorder.on = True
    comm.barrier()
    by_name = {c["name"]: c for c in prepared}
    for _, name in rounds({k: c["n"] for k, c in by_name.items()}):
        c = by_name[name]
        c["timing"].once(c["step"], c["xs"], c["ys"])
    return [_row(c, batch) for c in prepared]


def _time_ps(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each consistency in turn, one session each, in the same process group."""
    import torch
    import torch.nn as nn

    import parlay
    from parlay.ps import DistributedSession
    from tools.bench.harness import mlp

    widths, batch = spec_widths(spec)
    task = parlay.TaskSpec.from_env()
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    warmup, steps = int(spec.get("warmup", 1)), int(spec.get("steps", 3))
    rows: list[dict[str, Any]] = []
    cstep, _ = _contestant("compute", widths)
    # On one machine: the servers' dense traffic, timed before each session (every rank).
    exchange = (ps_exchange(bool(task.is_ps), model_params(widths)) if spec.get("probe_link")
                else None)
    for consistency in spec["consistencies"]:
        # The compute-only limit of one worker in this same crowded world, timed right before.
        paired = _compute_only(cstep, x, y, warmup, steps) if task.is_worker else 0.0
        probe_ps = _median_time(exchange, steps) if exchange is not None else None
        if task.is_worker and not rows:
            rows.append(dict(contestant="compute", step_s=paired, samples_s=0.0, steps=steps,
                             nic_tx=0, nic_rx=0, compute_step_s=paired))
        times: list[float] = []
        comps: list[float] = []  # a compute-only step before each: same moment, same load
        nic: list[dict[str, int]] = []
        # sync: one update per round of all workers; otherwise one per push.
        total = (warmup + steps) * (1 if consistency == "sync" else task.num_workers)
        with DistributedSession(task_spec=task, model=mlp(widths),
                                       optimizer=torch.optim.SGD, optimizer_args={"lr": 0.01},
                                       consistency=consistency, max_steps=total,
                                       checkpoint_every=None) as sess:
            while not sess.should_stop():
                if len(times) == warmup:
                    nic.append(_nic())
                if task.is_worker and len(times) >= warmup:
                    t0 = time.perf_counter()
                    cstep(x, y)
                    comps.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sess.train_step((x, y), nn.functional.cross_entropy)
                times.append(time.perf_counter() - t0)
        if task.is_ps or len(times) <= warmup:
            continue
        end, n = _nic(), len(times) - warmup
        dt = statistics.median(times[warmup:])
        rows.append(dict(contestant=f"ps:{consistency}", step_s=dt,
                         samples_s=task.num_workers * batch / dt, steps=n,
                         nic_tx=(end["tx"] - nic[0]["tx"]) / n,
                         nic_rx=(end["rx"] - nic[0]["rx"]) / n,
                         compute_step_s=statistics.median(comps) if comps else paired))
        if probe_ps is not None:
            rows[-1]["probe_ps_s"] = probe_ps
    return rows


def _median_time(fn: Callable, n: int) -> float:
    """Median seconds of ``n`` calls of a collective probe, each between barriers."""
    from parlay import comm

    times = []
    for _ in range(max(1, n)):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    comm.barrier()
    return statistics.median(times)


def _compute_only(step: Callable, x: Any, y: Any, warmup: int, steps: int) -> float:
    """Median seconds per compute-only step on this rank alone (the servers wait meanwhile)."""
    for _ in range(warmup):
        step(x, y)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_spec(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one launch's contestants on this rank (inside an initialised process group).

    Returns:
        This rank's rows, each tagged with its rank, host and local rank.
    """
    import torch

    import parlay

    torch.set_num_threads(1)
    rows = _time_ps(spec) if spec["kind"] == "ps" else _time_dp(spec)
    c = parlay.runtime.cluster()
    for r in rows:
        r.update(rank=c.rank, host=c.node_rank, local_rank=c.local_rank)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Entry point under ``parlay run`` on each simulated host: rows go to PREFIX.rankN.json."""
    import parlay

    ap = argparse.ArgumentParser(description="one rank of a parlay bench launch")
    ap.add_argument("--spec", required=True, help="the launch's spec, as JSON")
    ap.add_argument("--out", required=True, help="prefix of the per-rank JSON files")
    ns = ap.parse_args(argv)
    parlay.init(timeout=600)
    try:
        rows = run_spec(json.loads(ns.spec))
        with open(f"{ns.out}.rank{parlay.rank()}.json", "w") as f:
            json.dump(rows, f)
    finally:
        parlay.shutdown()


if __name__ == "__main__":
    main()
