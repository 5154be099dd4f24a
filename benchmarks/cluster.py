"""Modes on a simulated cluster: hosts in network namespaces joined by tbf-shaped links.

Each configuration starts a fresh :class:`tools.cluster.Cluster` and launches
:mod:`tools.bench.worker` with ``parlay run --nnodes H`` on every host, exactly as on real nodes
(``parlay bench`` uses the same worker and launcher). The
workers time their contestants side by side in one process group and read their host's byte
counters (``/sys/class/net/eth0/statistics``) around the timed steps, next to what parlay's
``comm_stats()`` says it sent. Rows:

* ``dp``: 2 hosts x 1 rank, the 784-4096x3-10 MLP (batch 64), at 100 Mbit/s, 1 Gbit/s and
  unshaped: compute only (no communication: the limit), parlay dense, DDP, fp16, PowerSGD-4,
  top-k 1%; each as samples/s and as a fraction of the limit.
* ``hier``: 2 hosts x 2 ranks at 100 Mbit/s: flat vs hierarchical allreduce.
* ``ps``: 4 workers and 4 parameter-server shards, each process on its own 100 Mbit/s host,
  a wide model with a small batch, vs ring allreduce among 4 workers on 4 hosts.
* ``shard``: 4 hosts x 1 rank, the 784-4096x3-10 MLP, unshaped links: NIC bytes per step of
  DDP, parlay dense and ``shard="optimizer"``/``"gradients"``/``"parameters"``, against DDP's
  and the theory (1, 1, 1.5), and of one gloo allreduce and one ring reduce-scatter/all-gather
  of the model's size against 2(N-1)/N, (N-1)/N, (N-1)/N of it (:mod:`tools.cluster.shard_bytes`).
* ``diloco``: 4 hosts x 1 rank, the 784-4096x3-10 MLP, at 100 Mbit/s and 10 Mbit/s: DiLoCo
  (streamed fragments, overlapped, compressed pseudo-gradients; settings in ``DILOCO``) in
  steady state against the compute-only limit timed interleaved with it in the same run, and
  NIC bytes per sample against DDP's (measured at 100 Mbit/s; at 10 Mbit/s DDP's step is
  its compute plus those bytes at the measured goodput) (:mod:`tools.cluster.diloco_bench`).

    python benchmarks/cluster.py [--quick] [--json PATH] [--rows dp,hier,ps,shard,diloco]  # root
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MODELS, table, write_json  # noqa: E402

from parlay.compress import available  # noqa: E402

# The worker side (contestants, interleaved timing, NIC counters) and the launcher live in
# tools/bench, shared with `parlay bench`; this script keeps its own rows and targets.
from tools.bench.launch import launch_cluster, model_bytes, per_host  # noqa: E402

# Data-driven: a newly registered "auto" joins the rows by itself.
DP_CONTESTANTS = ["compute", "parlay", "ddp", "fp16", "powersgd:4", "topk:0.01",
                  *(["auto"] if "auto" in available() else [])]


def _dp_rows(rate: str | None, model: str, steps: dict, clusters: list[dict],
             ratios: dict[str, float]) -> list[dict]:
    """2 hosts x 1 rank at ``rate``: every dense and compressed contestant and the limit."""
    rows, info = launch_cluster({"kind": "dp", "model": model, "contestants": DP_CONTESTANTS,
                                 **steps}, 2, rate, 1, calibrate=True)
    clusters.append(info)
    tag = rate or "unshaped"
    by = {n: dict(per_host(rows, n, model_bytes(model)), row="dp 2x1", rate=tag)
          for n in DP_CONTESTANTS}
    for n, r in by.items():
        r["of_limit"] = r["samples_s"] / by["compute"]["samples_s"]
        # Against the compute-only step timed between this contestant's own steps (same
        # moment, same load): steadier on a shared machine whose load drifts between rows.
        paired = [x["compute_step_s"] for x in rows
                  if x["contestant"] == n and x.get("compute_step_s")]
        if paired:
            r["of_paired"] = r["samples_s"] * statistics.median(paired) / steps_batch(model)
    ratios[f"parlay_over_ddp@{tag}"] = by["parlay"]["samples_s"] / by["ddp"]["samples_s"]
    for name in DP_CONTESTANTS[1:]:
        ratios[f"{name}_of_limit@{tag}"] = by[name]["of_limit"]
        if "of_paired" in by[name]:
            ratios[f"{name}_of_paired_limit@{tag}"] = by[name]["of_paired"]
    ratios[f"fp16_over_dense@{tag}"] = by["fp16"]["samples_s"] / by["parlay"]["samples_s"]
    if "auto" in by:  # auto must match dense on a fast link and the best fixed choice on any
        fixed = ("parlay", "fp16", "powersgd:4", "topk:0.01")
        best = max(fixed, key=lambda n: by[n]["samples_s"])
        ratios[f"auto_over_dense@{tag}"] = by["auto"]["samples_s"] / by["parlay"]["samples_s"]
        ratios[f"auto_over_best_fixed@{tag}"] = by["auto"]["samples_s"] / by[best]["samples_s"]
        by["auto"]["best_fixed"] = best
        by["auto"]["chose"] = next((r["chose"] for r in rows
                                    if r["contestant"] == "auto" and "chose" in r), "")
    return list(by.values())


def steps_batch(model: str) -> int:
    """Samples per step of one rank of the 2 x 1 dp rows (2 ranks)."""
    return 2 * MODELS[model][1]


def _hier_rows(model: str, steps: dict, clusters: list[dict],
               ratios: dict[str, float]) -> list[dict]:
    """2 hosts x 2 ranks at 100 Mbit/s: flat vs hierarchical allreduce."""
    rows, info = launch_cluster({"kind": "dp", "model": model,
                                 "contestants": ["compute", "flat", "hier"], **steps},
                                2, "100mbit", 2)
    clusters.append(info)
    by = {n: dict(per_host(rows, n), row="hier 2x2", rate="100mbit")
          for n in ("compute", "flat", "hier")}
    for r in by.values():
        r["of_limit"] = r["samples_s"] / by["compute"]["samples_s"]
    ratios["hier_over_flat@100mbit"] = by["hier"]["samples_s"] / by["flat"]["samples_s"]
    return list(by.values())


def _ps_rows(model: str, steps: dict, clusters: list[dict],
             ratios: dict[str, float], quick: bool) -> list[dict]:
    """4 workers: ring allreduce on 4 hosts vs 4 PS shards + 4 workers on 8 hosts, 100 Mbit/s."""
    rows, info = launch_cluster({"kind": "dp", "model": model, "contestants": ["parlay"],
                                 **steps}, 4, "100mbit", 1)
    clusters.append(info)
    ring = dict(per_host(rows, "parlay"), row="ps-vs-ring 4 workers", rate="100mbit",
                contestant="ring allreduce")
    # Sync PS steps are fixed in advance (max_steps): two timed steps in --quick.
    rows, info = launch_cluster({"kind": "ps", "model": model, "consistencies": ["sync"],
                                 **dict(steps, **({"steps": 2} if quick else {}))},
                                8, "100mbit", 1, flags=("--ps", "4"))
    clusters.append(info)
    from parlay.ps.chunks import chunk_bytes

    # Sync pushes go as pipelined chunks of this many bytes (PARLAY_PS_CHUNK_BYTES; 0: whole).
    ps = dict(per_host(rows, "ps:sync", model_bytes(model)), row="ps-vs-ring 4 workers",
              rate="100mbit", contestant="ps (4 shards)", chunk_bytes=chunk_bytes())
    ratios["ps_over_ring@100mbit"] = ps["samples_s"] / ring["samples_s"]
    return [ring, ps]


SHARD_THEORY = {"ddp": 1.0, "parlay": 1.0, "shard_optimizer": 1.0, "shard_gradients": 1.0,
                "shard_parameters": 1.5, "allreduce": 1.0, "reduce_scatter": 0.5,
                "all_gather": 0.5}  # of a ring allreduce's 2(N-1)/N of the model's bytes


def _shard_rows(model: str, quick: bool, clusters: list[dict],
                ratios: dict[str, float]) -> list[dict]:
    """4 hosts x 1 rank, unshaped: NIC bytes per step (tx and rx per host) of DDP and the
    shard levels, and of single collectives; ratios to DDP's and to the theory."""
    from tools.cluster.shard_bytes import launch

    rows, info = launch({"model": model, "contestants": list(SHARD_THEORY),
                         "warmup": 2, "steps": 2 if quick else 5}, hosts=4)
    clusters.append(info)
    n, params = rows[0]["world"], rows[0]["params"]
    ring = 2 * (n - 1) / n * 4 * params  # a ring allreduce of the fp32 model, per rank
    by = {}
    for name, theory in SHARD_THEORY.items():
        mine = [r for r in rows if r["contestant"] == name]
        tx, rx = (statistics.mean(r[k] for r in mine) for k in ("tx", "rx"))
        by[name] = dict(row="shard 4x1", rate="unshaped", contestant=name, steps=mine[0]["steps"],
                        nic_tx_MB=tx / 1e6, nic_rx_MB=rx / 1e6, expected_MB=theory * ring / 1e6,
                        **{"nic/expected": tx / (theory * ring)})
    for name, r in by.items():
        r["vs_ddp"] = r["nic_tx_MB"] / by["ddp"]["nic_tx_MB"]
        r["theory_vs_ddp"] = SHARD_THEORY[name]
        if name.startswith(("shard_", "parlay")):
            ratios[f"{name}_bytes_vs_ddp"] = r["vs_ddp"]
        else:  # DDP and the single collectives: measured over the theory
            ratios[f"{name}_bytes_of_theory"] = r["nic/expected"]
    return list(by.values())


# DiLoCo's settings: H inner steps a round, P fragments (one sent every H/P steps), each merged
# tau steps after it was sent; pseudo-gradients top-k 1% with error feedback (SparseLoCo's
# range); compute_steps compute-only steps once every H/P steps (the limit, interleaved).
DILOCO = {"H": 256, "P": 4, "tau": 8, "compression": "topk:0.01", "rounds": 3,
          "compute_steps": 2}
DILOCO_QUICK = dict(DILOCO, H=128, rounds=2)


def _diloco_rows(model: str, quick: bool, clusters: list[dict],
                 ratios: dict[str, float]) -> list[dict]:
    """4 hosts x 1 rank at 100 and 10 Mbit/s: DiLoCo's samples/s over the compute-only limit
    of the same run, and NIC bytes per sample against DDP's."""
    from tools.cluster.diloco_bench import launch

    spec = dict(DILOCO_QUICK if quick else DILOCO, model=model)
    print("diloco settings:", {k: spec[k] for k in ("H", "P", "tau", "compression", "rounds")},
          flush=True)
    out: list[dict] = []
    ddp: dict = {}
    for rate in ("100mbit", "10mbit"):
        rows, info = launch(dict(spec, ddp_steps=1 if rate == "100mbit" else 0), 4, rate)
        clusters.append(info)

        def slowest(name: str, rows: list[dict] = rows) -> dict:
            mine = [r for r in rows if r["contestant"] == name]
            return dict(max(mine, key=lambda r: r["step_s"]),
                        nic_tx=statistics.mean(r["nic_tx"] for r in mine))
        limit = statistics.mean(r["step_s"] for r in rows if r["contestant"] == "compute")
        world, batch = rows[0]["world"], rows[0]["batch"]
        d = slowest("diloco")
        if "ddp" in {r["contestant"] for r in rows}:
            ddp = dict(slowest("ddp"), measured=True)
        elif not ddp:  # a ring allreduce of the fp32 model: 2(N-1)/N of its bytes
            from tools.bench.launch import model_bytes
            ddp = dict(nic_tx=2 * (world - 1) / world * model_bytes(model), steps=0,
                       measured=False)
        ddp_step = ddp["step_s"] if rate == "100mbit" and ddp.get("measured") else \
            limit + ddp["nic_tx"] * 8 / (info["link_mbit_s"] * 1e6)
        base = dict(row="diloco 4x1", rate=rate)
        comp = dict(base, contestant="compute", step_s=limit, samples_s=world * batch / limit,
                    of_limit=1.0, steps=sum(r["steps"] for r in rows
                                            if r["contestant"] == "compute") // world)
        dl = dict(base, contestant="diloco", step_s=d["step_s"], steps=d["steps"],
                  samples_s=world * batch / d["step_s"], of_limit=limit / d["step_s"],
                  nic_tx_MB=d["nic_tx"] / 1e6, bytes_per_sample=d["nic_tx"] / batch,
                  wire_MB=d["wire_bytes"] / 1e6,
                  # main-thread seconds a step in starting, merging and waiting for exchanges
                  **{k: d[k] for k in ("send_s", "merge_s", "wait_s") if k in d})
        dd = dict(base, contestant="ddp" if rate == "100mbit" else "ddp (theory)",
                  step_s=ddp_step, samples_s=world * batch / ddp_step, of_limit=limit / ddp_step,
                  nic_tx_MB=ddp["nic_tx"] / 1e6, bytes_per_sample=ddp["nic_tx"] / batch,
                  steps=ddp["steps"] if rate == "100mbit" else 0)
        dl["vs_ddp"] = dd["bytes_per_sample"] / dl["bytes_per_sample"]
        ratios[f"diloco_of_limit@{rate}"] = dl["of_limit"]
        ratios[f"ddp_of_limit@{rate}"] = dd["of_limit"]
        ratios[f"diloco_bytes_fewer_than_ddp@{rate}"] = dl["vs_ddp"]
        out += [comp, dl, dd]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="dp,hier,ps,shard,diloco",
                    help="comma-separated subset of dp, hier, ps, shard, diloco (default: all)")
    ap.add_argument("--rates", default="100mbit,1gbit,unshaped",
                    help="links of the dp rows (default: 100mbit,1gbit,unshaped)")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # plumbing check
    ns = ap.parse_args()
    from tools.cluster import unavailable_reason

    why = unavailable_reason()
    if why:
        raise SystemExit(f"benchmarks/cluster.py: simulated cluster unavailable: {why}")
    # --quick: up to 8 timed steps within 8 s a contestant (a dense step at 100 Mbit/s takes
    # 12 s: one); with 3, one slow step in a compressor's 0.5 s steps moved its median 2x.
    steps = {"warmup": 1, "steps": 8, "budget": 8.0 if ns.quick else 60.0}
    t_start = time.perf_counter()
    results: list[dict] = []
    ratios: dict[str, float] = {}
    clusters: list[dict] = []
    rows = set(ns.rows.split(","))
    for rate in ns.rates.split(",") if "dp" in rows else ():
        results += _dp_rows(None if rate == "unshaped" else rate,
                            "tiny" if ns.smoke else "big", steps, clusters, ratios)
    if "hier" in rows:
        results += _hier_rows("tiny" if ns.smoke else "big", steps, clusters, ratios)
    if "ps" in rows:
        results += _ps_rows("tiny" if ns.smoke else "wide-quick" if ns.quick else "wide",
                            steps, clusters, ratios, ns.quick)
    if "shard" in rows:
        results += _shard_rows("tiny" if ns.smoke else "big", ns.quick, clusters, ratios)
    if "diloco" in rows:
        results += _diloco_rows("tiny" if ns.smoke else "big", ns.quick, clusters, ratios)
    print(table(results, ["row", "rate", "contestant", "samples_s", "of_limit", "of_paired",
                          "step_s", "steps", "nic_tx_MB", "nic_rx_MB", "expected_MB",
                          "nic/expected", "vs_ddp", "theory_vs_ddp", "bytes_per_sample", "send_s",
                          "merge_s", "wait_s"]))
    for r in results:
        if r.get("chose"):
            print(f"auto at {r['rate']} chose: {r['chose']} (best fixed: {r['best_fixed']})")
    print("\nratios:")
    for k, v in ratios.items():
        print(f"  {k:38s} {v:.3f}")
    print(f"\nlinks: {[c.get('link_mbit_s') for c in clusters]} Mbit/s measured; "
          f"netem: {clusters[0]['netem']}; wall {time.perf_counter() - t_start:.0f} s")
    write_json(ns.json, "cluster", ratios, results, clusters=clusters, quick=ns.quick)


if __name__ == "__main__":
    main()
