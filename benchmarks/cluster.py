"""Modes on a simulated cluster: hosts in network namespaces joined by tbf-shaped links.

Each configuration starts a fresh :class:`parlay.testing.cluster.Cluster` and launches this
script's worker part with ``parlay run --nnodes H`` on every host, exactly as on real nodes. The
workers time their contestants side by side in one process group and read their host's byte
counters (``/sys/class/net/eth0/statistics``) around the timed steps, next to what parlay's
``comm_stats()`` says it sent. Rows:

* ``dp``: 2 hosts x 1 rank, the 784-4096x3-10 MLP (batch 64), at 100 Mbit/s, 1 Gbit/s and
  unshaped: compute only (no communication: the limit), parlay dense, DDP, fp16, PowerSGD-4,
  top-k 1%; each as samples/s and as a fraction of the limit.
* ``hier``: 2 hosts x 2 ranks at 100 Mbit/s: flat vs hierarchical allreduce.
* ``ps``: 4 workers and 4 parameter-server shards, each process on its own 100 Mbit/s host,
  a wide model with a small batch, vs ring allreduce among 4 workers on 4 hosts.

    python benchmarks/cluster.py [--quick] [--json PATH]        # needs root and iproute2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"big": ([784, 4096, 4096, 4096, 10], 64), "wide": ([784, 4096, 4096, 10], 8),
          "wide-quick": ([784, 2048, 2048, 10], 8), "tiny": ([784, 256, 10], 16)}
DP_CONTESTANTS = ["compute", "parlay", "ddp", "fp16", "powersgd:4", "topk:0.01"]


# ---------------------------------------------------------------- worker side (in the hosts)
def _mlp(widths: list[int]):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers: list = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _nic() -> dict[str, int]:
    base = "/sys/class/net/eth0/statistics"
    return {k: int(open(f"{base}/{k}_bytes").read()) for k in ("tx", "rx")}


def _contestant(name: str, widths: list[int]):
    """(model, step(x, y), optimizer or None) for one contestant."""
    import torch
    import torch.nn as nn

    import parlay

    model = _mlp(widths)
    loss_fn = nn.CrossEntropyLoss()
    opt: object = None
    if name == "ddp":
        # Same seed on every rank: skip DDP's start-up broadcast (12 s at 100 Mbit/s).
        model = nn.parallel.DistributedDataParallel(model, init_sync=False)
        base = torch.optim.SGD(model.parameters(), lr=0.01)
    elif name == "compute":
        base = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        comp = {"parlay": None, "flat": None, "hier": None}.get(name, name)
        opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                          named_parameters=model.named_parameters(),
                                          compression=comp, hierarchical=name == "hier")
        base = opt  # type: ignore[assignment]

    def step(x, y) -> None:
        base.zero_grad()
        loss_fn(model(x), y).backward()
        base.step()
    return step, opt


def _timed(step, x, y, n: int, opt) -> tuple:
    """Time ``n`` steps between barriers: (seconds per step, NIC before, after, comm_stats
    before and after)."""
    from parlay import comm

    before = opt.comm_stats() if opt is not None else None
    comm.barrier()
    nic0, t0 = _nic(), time.perf_counter()
    for _ in range(n):
        step(x, y)
    comm.barrier()
    dt = (time.perf_counter() - t0) / n
    return dt, nic0, _nic(), (before, opt.comm_stats() if opt is not None else None)


def _time_dp(names: list[str], model: str, warmup: int, steps: int,
             budget: float) -> list[dict]:
    import torch

    import parlay
    from parlay import comm

    widths, batch = MODELS[model]
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    rows = []
    for name in names:
        step, opt = _contestant(name, widths)
        first = _timed(step, x, y, 1, opt)
        for _ in range(warmup - 1):
            step(x, y)
        # Slow contestants (dense on 100 Mbit/s: ~15 s a step) get fewer timed steps, decided
        # from the slowest rank's first step so every rank runs the same number of collectives;
        # a first step longer than the budget is the measurement (its start-up cost is small).
        slowest = torch.tensor([first[0]])
        comm.allreduce(slowest, "max")
        slow = float(slowest) > budget
        n = 1 if slow else max(1, min(steps, int(budget / max(float(slowest), 1e-6))))
        dt, nic0, nic1, stats = first if slow else _timed(step, x, y, n, opt)
        row = dict(contestant=name, step_s=dt, samples_s=parlay.size() * batch / dt, steps=n,
                   nic_tx=(nic1["tx"] - nic0["tx"]) / n, nic_rx=(nic1["rx"] - nic0["rx"]) / n)
        if opt is not None:
            row["wire_bytes"] = (stats[1]["wire_bytes"] - stats[0]["wire_bytes"]) / n
            row["cross_host_bytes"] = stats[1].get("cross_host_bytes_per_step", 0.0)
        rows.append(row)
        del step, opt
    return rows


def _time_ps(model: str, warmup: int, steps: int) -> list[dict]:
    import torch
    import torch.nn as nn

    import parlay

    widths, batch = MODELS[model]
    spec = parlay.TaskSpec.from_env()
    x, y = torch.randn(batch, widths[0]), torch.randint(0, widths[-1], (batch,))
    times: list[float] = []
    nic: list[dict[str, int]] = []
    with parlay.DistributedSession(task_spec=spec, model=_mlp(widths), optimizer=torch.optim.SGD,
                                   optimizer_args={"lr": 0.01}, consistency="sync",
                                   max_steps=warmup + steps, checkpoint_every=None) as sess:
        while not sess.should_stop():
            if sess.step == warmup:
                nic.append(_nic())
            t0 = time.perf_counter()
            sess.train_step((x, y), nn.functional.cross_entropy)
            times.append(time.perf_counter() - t0)
    if spec.is_ps:
        return []
    end = _nic()
    dt = statistics.median(times[warmup:])
    return [dict(contestant="ps", step_s=dt, samples_s=spec.num_workers * batch / dt,
                 steps=steps, nic_tx=(end["tx"] - nic[0]["tx"]) / steps,
                 nic_rx=(end["rx"] - nic[0]["rx"]) / steps)]


def worker(ns: argparse.Namespace) -> None:
    import torch

    import parlay

    torch.set_num_threads(1)
    parlay.init(timeout=600)
    try:
        if ns.worker == "ps":
            rows = _time_ps(ns.model, ns.warmup, ns.steps)
        else:
            rows = _time_dp(ns.contestants.split(","), ns.model, ns.warmup, ns.steps, ns.budget)
        c = parlay.runtime.cluster()
        for r in rows:
            r.update(rank=c.rank, host=c.node_rank, local_rank=c.local_rank)
        with open(f"{ns.out}.rank{c.rank}.json", "w") as f:
            json.dump(rows, f)
    finally:
        parlay.shutdown()


# ---------------------------------------------------------------- orchestrator (this machine)
def _launch(hosts: int, rate: str | None, nproc: int, wargs: list[str], flags: tuple = (),
            calibrate: bool = False) -> tuple[list[dict], dict]:
    from parlay.testing.cluster import Cluster

    out = tempfile.mktemp(prefix="parlay-cluster-bench-")
    with Cluster(hosts=hosts, rate=rate) as c:
        link = c.measure(1, 0, seconds=1.0) / 1e6 if calibrate else None
        procs = c.parlay_run([__file__, *wargs, "--out", out], nproc_per_host=nproc, flags=flags,
                             env={"PYTHONPATH": os.pathsep.join(
                                 [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])},
                             cwd=ROOT, stdout=-1, stderr=-1, text=True)
        for k, p in enumerate(procs):
            o, e = p.communicate(timeout=1800)
            if p.returncode:
                raise RuntimeError(f"host {k} failed ({p.returncode}):\n{o}\n{e[-3000:]}")
        info = dict(c.report(), link_mbit_s=link)
    rows = []
    for f in sorted(Path(out).parent.glob(Path(out).name + ".rank*.json")):
        rows += json.loads(f.read_text())
        f.unlink()
    return rows, info


def _model_bytes(model: str) -> int:
    widths = MODELS[model][0]
    return 4 * sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def _per_host(rows: list[dict], name: str, model_bytes: int = 0) -> dict:
    """Median over ranks of step time; per-host NIC bytes (local ranks share a host link)."""
    mine = [r for r in rows if r["contestant"] == name]
    hosts: dict[int, dict] = {}
    for r in mine:
        hosts.setdefault(r["host"], r)  # every rank of a host reads the same counters
    out = dict(contestant=name, step_s=statistics.median(r["step_s"] for r in mine),
               samples_s=statistics.median(r["samples_s"] for r in mine),
               nic_tx_MB=statistics.mean(h["nic_tx"] for h in hosts.values()) / 1e6,
               steps=mine[0].get("steps", "-"))
    if "wire_bytes" not in mine[0] and model_bytes:
        # No comm_stats (DDP, parameter server): what the algorithm must send, from theory.
        n = len(mine)
        out["expected_MB"] = (model_bytes if name == "ps" else 2 * (n - 1) / n * model_bytes) / 1e6
        out["nic/expected"] = out["nic_tx_MB"] / out["expected_MB"]
    if "wire_bytes" in mine[0]:
        per_host = len(mine) // len(hosts)
        wire = statistics.mean(r["wire_bytes"] for r in mine)
        n = len(mine)
        cross = statistics.mean(r["cross_host_bytes"] for r in mine)
        # What a rank sends: a ring allreduce (or ring allgather) of n ranks sends 2(n-1)/n
        # (or (n-1)/n x n) of the payload; with several ranks per host only the ring's
        # host-crossing edges use the link (1 per host); hierarchical counts its own.
        if cross:
            expect = cross * per_host
        elif name.startswith("topk"):
            expect = wire * (n - 1) / per_host
        else:
            expect = 2 * (n - 1) / n * wire
        out["expected_MB"] = expect / 1e6
        out["nic/expected"] = out["nic_tx_MB"] / out["expected_MB"] if expect else float("nan")
    return out


def _dp_rows(rate: str | None, model: str, steps: list[str], clusters: list[dict],
             ratios: dict[str, float]) -> list[dict]:
    """2 hosts x 1 rank at ``rate``: every dense and compressed contestant and the limit."""
    rows, info = _launch(2, rate, 1, ["--worker", "dp", *steps, "--model", model],
                         calibrate=True)
    clusters.append(info)
    tag = rate or "unshaped"
    by = {n: dict(_per_host(rows, n, _model_bytes(model)), row="dp 2x1", rate=tag)
          for n in DP_CONTESTANTS}
    for r in by.values():
        r["of_limit"] = r["samples_s"] / by["compute"]["samples_s"]
    ratios[f"parlay_over_ddp@{tag}"] = by["parlay"]["samples_s"] / by["ddp"]["samples_s"]
    for name in DP_CONTESTANTS[1:]:
        ratios[f"{name}_of_limit@{tag}"] = by[name]["of_limit"]
    ratios[f"fp16_over_dense@{tag}"] = by["fp16"]["samples_s"] / by["parlay"]["samples_s"]
    return list(by.values())


def _hier_rows(steps: list[str], clusters: list[dict], ratios: dict[str, float]) -> list[dict]:
    """2 hosts x 2 ranks at 100 Mbit/s: flat vs hierarchical allreduce."""
    rows, info = _launch(2, "100mbit", 2, ["--worker", "hier", "--contestants",
                                           "compute,flat,hier", *steps])
    clusters.append(info)
    by = {n: dict(_per_host(rows, n), row="hier 2x2", rate="100mbit")
          for n in ("compute", "flat", "hier")}
    for r in by.values():
        r["of_limit"] = r["samples_s"] / by["compute"]["samples_s"]
    ratios["hier_over_flat@100mbit"] = by["hier"]["samples_s"] / by["flat"]["samples_s"]
    return list(by.values())


def _ps_rows(model: str, steps: list[str], clusters: list[dict],
             ratios: dict[str, float], quick: bool) -> list[dict]:
    """4 workers: ring allreduce on 4 hosts vs 4 PS shards + 4 workers on 8 hosts, 100 Mbit/s."""
    rows, info = _launch(4, "100mbit", 1, ["--worker", "dp", "--contestants", "parlay",
                                           *steps, "--model", model])
    clusters.append(info)
    ring = dict(_per_host(rows, "parlay"), row="ps-vs-ring 4 workers", rate="100mbit",
                contestant="ring allreduce")
    # Sync PS steps are fixed in advance (max_steps): two timed steps in --quick.
    rows, info = _launch(8, "100mbit", 1, ["--worker", "ps", *steps, "--model", model,
                                           *(["--steps", "2"] if quick else [])],
                         flags=("--ps", "4"))
    clusters.append(info)
    ps = dict(_per_host(rows, "ps", _model_bytes(model)), row="ps-vs-ring 4 workers",
              rate="100mbit", contestant="ps (4 shards)")
    ratios["ps_over_ring@100mbit"] = ps["samples_s"] / ring["samples_s"]
    return [ring, ps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--contestants", default=",".join(DP_CONTESTANTS), help=argparse.SUPPRESS)
    ap.add_argument("--model", default="big", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # plumbing check
    ns = ap.parse_args()
    if ns.worker:
        return worker(ns)
    from parlay.testing.cluster import unavailable_reason

    why = unavailable_reason()
    if why:
        raise SystemExit(f"benchmarks/cluster.py: simulated cluster unavailable: {why}")
    steps = ["--warmup", "1", "--steps", "3" if ns.quick else "8",
             "--budget", "8" if ns.quick else "60"]
    t_start = time.perf_counter()
    results: list[dict] = []
    ratios: dict[str, float] = {}
    clusters: list[dict] = []
    for rate in ("100mbit", "1gbit", None):
        results += _dp_rows(rate, "tiny" if ns.smoke else "big", steps, clusters, ratios)
    results += _hier_rows(steps, clusters, ratios)
    results += _ps_rows("tiny" if ns.smoke else "wide-quick" if ns.quick else "wide", steps,
                        clusters, ratios, ns.quick)
    print(table(results, ["row", "rate", "contestant", "samples_s", "of_limit", "step_s",
                          "steps", "nic_tx_MB", "expected_MB", "nic/expected"]))
    print("\nratios:")
    for k, v in ratios.items():
        print(f"  {k:32s} {v:.3f}")
    print(f"\nlinks: {[c.get('link_mbit_s') for c in clusters]} Mbit/s measured; "
          f"netem: {clusters[0]['netem']}; wall {time.perf_counter() - t_start:.0f} s")
    write_json(ns.json, "cluster", ratios, results, clusters=clusters, quick=ns.quick)


if __name__ == "__main__":
    main()
