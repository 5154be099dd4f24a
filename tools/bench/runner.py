"""``parlay bench``: every mode side by side on loopback and simulated links, with the cost
model's prediction next to each measured point.

Per link, three launches (the same MLP, sized so a dense step on 100 Mbit/s takes about a
second):

* ``dp`` (2 ranks: on loopback 2 local ranks, on a link 2 hosts x 1): the compute-only limit,
  DDP, parlay dense, every registered compressor (and ``auto`` when registered), and the
  pipeline (2 stages x 1 replica, the same global batch) with GPipe and 1F1B;
* ``ps`` (2 workers + 2 server shards, each process its own host on a link): sync, stale:2
  and async;
* ``hier`` (links only: 2 hosts x 2 ranks): flat vs hierarchical allreduce.

Then MNIST accuracy vs bytes per step for every compressor (the compression benchmark's
settings). Writes ``results.json``, ``report.md`` and PNG plots into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from tools.bench.harness import MODELS, env_info, model_params
from tools.bench.inputs import OneLineParser, check_inputs

__all__ = ["build_parser", "main", "run_suite", "repredict", "compressor_specs", "NETS"]

NETS = ("loopback", "1gbit", "100mbit")

# Options a compressor runs with in the suite (others: their bare registry name).
_DEFAULT_OPTS = {"topk": "topk:0.01", "randomk": "randomk:0.01", "powersgd": "powersgd:4"}
_EPILOG = """\
parlay bench NAME [ARGS]  runs benchmarks/NAME.py from a checkout (e.g. parlay bench cluster
--quick), as before. Without NAME (or with NAME 'suite') it runs this suite. Simulated links
need root and iproute2 (ip, tc); without them those nets are skipped and loopback still runs.
Plots need matplotlib: pip install "parlay[bench]" (or pip install matplotlib)."""


def compressor_specs() -> list[str]:
    """Every registered compressor except ``none``, with the suite's options; ``auto`` last."""
    from parlay.compress import available

    names = [n for n in available() if n not in ("none", "auto")]
    specs = [_DEFAULT_OPTS.get(n, n) for n in names]
    if "topk" in names:  # top-k's compact wire too (auto's candidate): 4 bytes a coordinate
        specs.insert(specs.index("topk:0.01") + 1, "topk:0.01,compact=1")
    return specs + (["auto"] if "auto" in available() else [])


def _mode(name: str, world: int, spec: dict[str, Any],
          hosts: int) -> tuple[str, str, dict[str, Any]]:
    """(cost-model mode, compressor, options) of a contestant, in :mod:`parlay.plan`'s terms."""
    if name == "compute":
        return "compute", "none", {}
    if name.startswith("pipe:"):
        return "hybrid", "none", {"stages": world, "schedule": name[5:],
                                  "chunks": int(spec.get("chunks", 4))}
    if name.startswith("ps:"):
        return "ps", "none", {"consistency": name[3:], "servers": int(spec["servers"]),
                              "chunk_bytes": _ps_chunk_bytes(hosts == 1)}
    if name == "hier":
        return "hierarchical", "none", {}
    if name in ("ddp", "none", "parlay", "flat"):
        return "allreduce", "none", {}
    return "allreduce", name, {}


def _ps_chunk_bytes(one_host: bool) -> int:
    """Chunk size of the parameter servers' pipelined sync pushes in this parlay (0: none)."""
    from parlay.ps.chunks import chunk_bytes

    return int(chunk_bytes(one_host=one_host))


def _points(rows: list[dict[str, Any]], spec: dict[str, Any], net: str, launch: str,
            topo: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per contestant: measured, with everything the cost model needs."""
    from tools.bench.launch import per_host

    widths, batch = MODELS[spec["model"]]
    compute = sorted(r["step_s"] for r in rows if r["contestant"] == "compute")
    launch_compute = compute[len(compute) // 2]
    workers = topo["world"] - int(spec.get("servers", 0))
    names = list(dict.fromkeys(r["contestant"] for r in rows))
    out = []
    for name in names:
        agg = per_host(rows, name, 4 * model_params(widths))
        # This point's own compute-only step, timed next to it (the load drifts).
        own = sorted(r.get("compute_step_s", launch_compute) for r in rows
                     if r["contestant"] == name)
        compute_s = own[len(own) // 2]
        limit = workers * batch / compute_s
        mode, comp, opts = _mode(name, topo["world"], spec, topo["hosts"])
        p = dict(net=net, launch=launch, contestant=name, mode=mode, compressor=comp, opts=opts,
                 params=model_params(widths), batch=batch, layers=len(widths) - 1,
                 activation_numel=max(widths[1:-1], default=widths[-1]),
                 shapes=[s for a, b in zip(widths[:-1], widths[1:]) for s in ([b, a], [b])],
                 world=topo["world"], workers=workers, hosts=topo["hosts"],
                 ranks_per_host=topo["ranks_per_host"], link_bps=topo["link_bps"],
                 link_measured_bps=topo.get("link_measured_bps"), compute_step_s=compute_s,
                 compute_s_per_sample=compute_s / batch, step_s=agg["step_s"],
                 samples_s=agg["samples_s"] if name != "compute" else limit,
                 limit_samples_s=limit, steps=agg["steps"], nic_tx_MB=agg["nic_tx_MB"],
                 wire_MB=agg.get("wire_MB"), expected_MB=agg.get("expected_MB"))
        p["of_limit"] = p["samples_s"] / limit
        p.update(_probed(rows, name))
        chose = [r for r in rows if r["contestant"] == name and "chose" in r]
        if chose:  # auto: what it chose, and its trial's switches (rank 0's, as every rank's)
            p["chose"], p["trial"] = chose[0]["chose"], chose[0].get("trial", [])
        out.append(p)
    return out


def _probed(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The CPU-side probes timed next to this contestant's steps (codec, loopback link)."""
    mine = [r for r in rows if r["contestant"] == name]
    out: dict[str, Any] = {}
    for k in ("codec_s", "probe_tiny_s", "probe_dense_s", "probe_half_s", "probe_act_s",
              "probe_ps_s", "probe_copy_s"):
        vals = sorted(r[k] for r in mine if r.get(k) is not None)
        if vals:
            out[k] = vals[len(vals) // 2]
    codec = [r["codec"] for r in mine if r.get("codec")]
    if codec:
        out["codec"] = codec[0]
    return out


def _timelines(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "events" in r:
            out.setdefault(r["contestant"][5:], []).append(
                {k: r[k] for k in ("stage", "rank", "events", "step_s", "bubble", "chunks")})
    for v in out.values():
        v.sort(key=lambda s: s["stage"])
    return out


def _launches(cfg: dict[str, Any], net: str) -> list[tuple[str, dict, int, int, int]]:
    """(name, spec, hosts, ranks per host, parameter servers) of each launch on ``net``; on
    loopback every rank is on the one host."""
    base = {"model": cfg["model"], "warmup": 1, "steps": cfg["steps"], "budget": cfg["budget"]}
    dp = dict(base, kind="dp", chunks=4, contestants=["compute", "ddp", "none",
              *cfg["compressors"], "pipe:gpipe", "pipe:1f1b"])
    # A parameter-server session runs a fixed number of steps (the budget cannot cut it short).
    ps = dict(base, kind="ps", servers=2, consistencies=["sync", "stale:2", "async"],
              steps=min(cfg["steps"], cfg["ps_steps"]))
    hier = dict(base, kind="dp", contestants=["compute", "flat", "hier"])
    if net == "loopback":  # hierarchical needs several hosts
        # One machine: the "link" is CPU work, timed next to every step as the codec is.
        return [("dp", dict(dp, probe_link=True), 1, 2, 0),
                ("ps", dict(ps, probe_link=True), 1, 4, 2)]
    return [("dp", dp, 2, 1, 0), ("ps", ps, 4, 1, 2), ("hier", hier, 2, 2, 0)]


def _run_net(net: str, cfg: dict[str, Any], log: Any) -> tuple[list, dict, list, list]:
    """The launches of one link: (points, timelines, cluster reports, notes). A launch that
    fails is a note; the others still run."""
    from tools.bench.launch import launch_cluster, launch_loopback
    from tools.cluster import parse_rate

    rate = None if net in ("loopback", "unshaped") else net
    points: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    notes: list[str] = []
    timelines: dict[str, Any] = {}
    measured = None
    for name, spec, hosts, per_host, num_ps in _launches(cfg, net):
        t0 = time.perf_counter()
        try:
            if net == "loopback":
                rows = launch_loopback(spec, per_host, num_ps=num_ps)
            else:
                flags = ("--ps", str(num_ps)) if num_ps else ()
                rows, info = launch_cluster(spec, hosts, rate, per_host, flags=flags,
                                            calibrate=measured is None)
                infos.append(info)
                measured = measured or (info["link_mbit_s"] or 0) * 1e6
                notes += [f"{net} {name}: measured, then a process failed at exit: {e}"
                          for e in info.get("exit_errors", [])]
        except Exception as e:  # noqa: BLE001 - one failed launch must not lose the run
            notes.append(f"{net} {name} launch failed: {str(e).strip().splitlines()[0]}")
            log(f"  {notes[-1]}")
            continue
        topo = dict(world=hosts * per_host, hosts=hosts, ranks_per_host=per_host,
                    link_bps=parse_rate(rate) if rate else None, link_measured_bps=measured)
        new = _points(rows, spec, net, name, topo)
        points += new
        timelines.update(_timelines(rows))
        log(f"  {net} {name}: {len(new)} points in {time.perf_counter() - t0:.0f} s"
            + (f" (link measured {measured / 1e6:.0f} Mbit/s)" if measured else ""))
    return points, timelines, infos, notes


def run_suite(out: str, nets: list[str], quick: bool = False, model: str = "suite",
              steps: int | None = None, budget: float | None = None, accuracy: bool = True,
              accuracy_samples: int | None = None, data: str | None = None,
              compressors: list[str] | None = None, log: Any = print) -> dict[str, Any]:
    """Run the suite and write ``results.json``, ``report.md`` and the plots into ``out``.

    Args:
        out: Output folder (created).
        nets: ``loopback`` and/or tc rates (``1gbit``, ``100mbit``) or ``unshaped``.
        quick: 5 s of timed steps per point (30 full) and the compression benchmark's quick
            settings.
        model: A :data:`tools.bench.harness.MODELS` name.
        steps: Timed steps per point at most (default 30; the budget stops
            slow points sooner; a parameter-server session runs 10: the budget cannot cut it).
        budget: Seconds of timed steps per point (a slower first step is the measurement).
        accuracy: Also train MNIST with every compressor (accuracy vs bytes per step).
        accuracy_samples: Training images for it (default 12k quick, all 60k full).
        data: MNIST folder (default ``PARLAY_DATA_DIR``, else the copy shipped in parlay).
        compressors: Compressor specs (default :func:`compressor_specs`).
        log: Where progress lines go.

    Returns:
        The results document (also written as ``results.json``).
    """
    from tools.bench import predict

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    cfg = {"model": model, "steps": steps or 30,
           "ps_steps": 10, "budget": budget or (5.0 if quick else 30.0),
           "compressors": compressor_specs() if compressors is None else list(compressors)}
    notes: list[str] = []
    nets = _usable(nets, notes, log)
    points: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    clusters: list[dict[str, Any]] = []
    for net in nets:
        log(f"parlay bench: {net} ...")
        p, tl, infos, failed = _run_net(net, cfg, log)
        points += p
        timelines[net] = tl
        clusters += infos
        notes += failed
    acc = _accuracy(cfg, quick, accuracy_samples, data, notes, log) if accuracy else []
    why_pred = predict.attach_predictions(points)
    if why_pred:
        notes.append(why_pred)
    doc = {"benchmark": "parlay bench", "quick": quick, "nets": nets, "config": cfg,
           "model_widths": MODELS[model][0], "points": points,
           "summary": predict.summary(points), "timelines": timelines, "accuracy": acc,
           "clusters": clusters, "notes": notes, "wall_s": 0.0, "env": env_info()}
    _write(doc, out, t0, log)
    return doc


def repredict(results: str, out: str, log: Any = print) -> dict[str, Any]:
    """Predict again every point of an earlier run's ``results.json`` (the cost model or its
    calibration changed; nothing is measured again) and write results, report and plots to
    ``out``."""
    from tools.bench import predict

    with open(results) as f:
        doc = json.load(f)
    os.makedirs(out, exist_ok=True)
    doc["notes"] = [n for n in doc["notes"] if "prediction" not in n and "matplotlib" not in n]
    why = predict.attach_predictions(doc["points"])
    if why:
        doc["notes"].append(why)
    doc["summary"] = predict.summary(doc["points"])
    doc["repredicted"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    wall = doc["wall_s"]
    _write(doc, out, time.perf_counter() - wall, log)
    return doc


def _usable(nets: list[str], notes: list[str], log: Any) -> list[str]:
    """``nets`` less the simulated links, with one line saying why, where none can be built."""
    from tools.cluster import unavailable_reason

    links = [n for n in nets if n != "loopback"]
    why = unavailable_reason() if links else None
    if not why:
        return nets
    notes.append(f"skipped {', '.join(links)}: simulated cluster unavailable: {why}")
    log(f"parlay bench: {notes[-1]}")
    return [n for n in nets if n == "loopback"]


def _accuracy(cfg: dict[str, Any], quick: bool, samples: int | None, data: str | None,
              notes: list[str], log: Any) -> list[dict[str, Any]]:
    from tools.bench.accuracy import run_accuracy

    log("parlay bench: MNIST accuracy vs bytes per step ...")
    try:
        return run_accuracy(cfg["compressors"], data or os.environ.get("PARLAY_DATA_DIR"),
                            epochs=1 if quick else 3,
                            train_samples=samples or (12000 if quick else 0))
    except Exception as e:  # noqa: BLE001 - the throughput points still get written
        notes.append(f"MNIST accuracy run failed: {str(e).strip().splitlines()[0]}")
        log(f"parlay bench: {notes[-1]}")
        return []


def _write(doc: dict[str, Any], out: str, t0: float, log: Any) -> None:
    """Plots (when matplotlib is there), then results.json and report.md."""
    from tools.bench import plots, report

    doc["plots"], plot_note = plots.write_all(doc, out)
    if plot_note:
        doc["notes"].append(plot_note)
        log(f"parlay bench: {plot_note}")
    doc["wall_s"] = time.perf_counter() - t0
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report.render(doc))


def build_parser() -> argparse.ArgumentParser:
    """Options of ``parlay bench`` (the suite)."""
    ap = OneLineParser(
        prog="parlay bench", usage="parlay bench [NAME [ARGS] | [suite] [options]]",
        description="Run every mode and compressor side by side on loopback and simulated "
                    "links; write results.json, report.md and plots.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="5 s of timed steps per point (under 15 minutes on 2 cores)")
    ap.add_argument("--net", default=",".join(NETS),
                    help="comma-separated: loopback and tc rates such as 1gbit, 100mbit, or "
                         "unshaped (default: %(default)s)")
    ap.add_argument("--out", required=True, help="folder for results.json, report.md, *.png")
    ap.add_argument("--from", dest="source", default=None, metavar="RESULTS_JSON",
                    help="measure nothing: predict the points of an earlier run's results.json "
                         "again (after the cost model or its calibration changed)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per point")
    ap.add_argument("--compressors", default=None,
                    help="comma-separated compressor specs (default: every registered one)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the MNIST accuracy run")
    ap.add_argument("--accuracy-samples", type=int, default=None,
                    help="MNIST training images for the accuracy run (default 12000 quick)")
    ap.add_argument("--data", default=None, help="MNIST folder (default: PARLAY_DATA_DIR, "
                                                 "else the copy shipped with parlay)")
    ap.add_argument("--model", default="suite", choices=sorted(MODELS), help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``parlay bench`` without a NAME."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    check_inputs(ap, ns)
    if ns.source:
        doc = repredict(ns.source, ns.out)
        from tools.bench.report import console

        print(console(doc))
        return 0
    from tools.bench.accuracy import split_specs

    nets = [n.strip() for n in ns.net.split(",") if n.strip()]
    comps = split_specs(ns.compressors) if ns.compressors is not None else None
    doc = run_suite(ns.out, nets, quick=ns.quick, model=ns.model, steps=ns.steps,
                    budget=ns.budget, accuracy=not ns.no_accuracy,
                    accuracy_samples=ns.accuracy_samples, data=ns.data, compressors=comps)
    from tools.bench.report import console

    print(console(doc))
    print(f"\nwrote {ns.out}/results.json, report.md"
          + (", " + ", ".join(doc["plots"]) if doc["plots"] else "")
          + f" in {doc['wall_s']:.0f} s")
    return 0
