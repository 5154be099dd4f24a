"""``parlay plan``: predicted step time of every mode x compressor, and a recommendation.

::

    parlay plan --model-params 25e6 --batch 64 --nodes 16 --gpus-per-node 8 \\
                --bandwidth 10gbit --latency 50us --compute-ms 120
    parlay plan --script train.py --nodes 4 --gpus-per-node 2 --bandwidth 1gbit -- --lr 0.1

Without ``--compute-ms`` or ``--script`` the compute term is estimated as ``6 x params x batch``
FLOPs at this machine's measured matrix-multiply rate (a CPU estimate; pass your own numbers
for GPUs). Constants are calibrated on first use (a few seconds) and cached; ``--calibrate``
measures again, ``--no-calibrate`` uses built-in defaults.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from parlay.errors import ConfigError
from parlay.plan.advise import COMPRESSORS, MODES, Prediction, explain, rank_configs
from parlay.plan.model import ClusterSpec, Costs, Link, Workload
from parlay.plan.units import (format_bandwidth, format_seconds, parse_bandwidth, parse_count,
                               parse_duration, parse_latency)

__all__ = ["PlanInputError", "add_plan_parser", "run_plan", "build_inputs"]

_EPILOG = """\
examples:
  parlay plan --model-params 25e6 --batch 64 --nodes 16 --gpus-per-node 8 \\
              --bandwidth 10gbit --latency 50us --compute-ms 120
  parlay plan --script train.py --nodes 4 --bandwidth 1gbit -- --lr 0.1

--script runs your unchanged training script in one process until it has made a few
optimizer steps, then stops it: the time between steps is the compute term, the optimizer's
parameters are the model and the first dimension of the model's input is the batch.
The first run calibrates this machine (a few seconds, cached in ~/.cache/parlay or
$PARLAY_CACHE_DIR)."""


class PlanInputError(ConfigError, SystemExit):
    """An impossible ``parlay plan`` input: a :class:`ConfigError` that also ends the command
    line with its message (exit status 1) instead of a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = f"parlay plan: {message}"


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to ``parlay``'s sub-parsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "plan", help="predict step time of every mode x compressor and recommend one",
        description="Predict the step time and samples/s of every mode x compressor on your "
                    "cluster, fastest first,\nand say which term dominates the recommended one.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (give --model-params, or --script to profile your own)")
    g.add_argument("--model-params", help="trainable parameters, e.g. 25e6 or 25M")
    g.add_argument("--batch", help="samples per rank (GPU) per step, e.g. 64")
    g.add_argument("--global-batch", help="samples per step over all ranks (instead of --batch)")
    g.add_argument("--compute-ms", help="forward+backward time of one rank's batch, ms")
    g.add_argument("--layers", help="layers a pipeline can split between (limits --stages)")
    g.add_argument("--activation-numel", help="elements per sample between pipeline stages")
    g.add_argument("--script", help="profile this training script for a few steps (single "
                                    "process); its arguments go after --")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", default="1", help="hosts (default 1)")
    c.add_argument("--gpus-per-node", "--ranks-per-node", dest="ranks_per_node", default="1",
                   help="training ranks per host (default 1)")
    c.add_argument("--bandwidth", help="each host's network link, e.g. 10gbit, 100mbit, 25Gbps "
                                       "(default: this machine's loopback)")
    c.add_argument("--latency", default="0", help="link latency, e.g. 50us (default 0)")
    c.add_argument("--burst", help="bytes a token-bucket shaped link (tc tbf, cloud burst "
                   "credit) sends at once after resting, e.g. 125k (default: none)")
    c.add_argument("--intra-bandwidth", help="between ranks of one host (default: free)")
    c.add_argument("--overlap", default="1", help="fraction of backward that communication "
                   "can hide behind: 1 for GPUs, 0 for CPU ranks using every core")
    o = p.add_argument_group("what to compare")
    o.add_argument("--modes", default=",".join(MODES), help=f"default {','.join(MODES)}")
    o.add_argument("--compressors", default=",".join(COMPRESSORS), help="default %(default)s")
    o.add_argument("--stages", help="hybrid: pipeline stages (default: 2, 4, 8 that fit)")
    o.add_argument("--chunks", help="hybrid: micro-batches per step (default 4 x stages)")
    o.add_argument("--servers", help="ps: server shards on their own hosts (default --nodes)")
    o.add_argument("--async", dest="include_async", action="store_true",
                   help="also recommend asynchronous parameter servers (stale gradients)")
    o.add_argument("--top", type=int, default=0, help="print only the N fastest (default all)")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k = p.add_argument_group("calibration")
    k.add_argument("--calibrate", action="store_true", help="measure this machine again")
    k.add_argument("--no-calibrate", action="store_true", help="built-in constants only")
    return p


def _int(text: Any, what: str, low: int = 1) -> int:
    """An integer option (``64``, ``1e3``, ``2k``), at least ``low``."""
    raw = str(text).strip()
    try:
        v = float(int(raw))
    except ValueError:
        try:
            v = parse_count(raw, what)
        except ConfigError:
            v = -1.0  # unreadable: the message below names the option and an example
    if v != int(v) or v < low:
        raise ConfigError(f"{what} must be an integer >= {low}, got {text!r}. "
                          f"Hint: {what} {max(low, 1)}.")
    return int(v)


def _calibration(ns: argparse.Namespace) -> Any:
    if ns.no_calibrate:
        return None
    from parlay.plan import calibrate as cal

    if ns.calibrate:
        return cal.calibrate()
    return cal.load_costs()


def build_inputs(ns: argparse.Namespace, calib: Any) -> tuple[Workload, ClusterSpec, list[str]]:
    """Workload, cluster and notes (assumptions made) from parsed options.

    Raises:
        ConfigError: An impossible input, naming it and the fix.
    """
    notes: list[str] = []
    nodes = _int(ns.nodes, "--nodes")
    local = _int(ns.ranks_per_node, "--gpus-per-node")
    world = nodes * local
    burst = parse_count(ns.burst, "--burst") if ns.burst else 0.0
    if burst and ns.bandwidth is None:
        raise ConfigError("--burst shapes a network link: give its rate too. Hint: "
                          "--bandwidth 100mbit --burst 125k")
    if ns.bandwidth is not None:
        inter = Link(parse_bandwidth(ns.bandwidth), parse_latency(ns.latency),
                     burst_bytes=burst)
    elif calib is not None:
        inter = Link(calib.loopback.bandwidth_bps, parse_latency(ns.latency), 1.0)
        notes.append(f"link: this machine's loopback, {format_bandwidth(inter.bandwidth_bps)} "
                     "(pass --bandwidth for your network)")
    else:
        raise ConfigError("--bandwidth is needed without calibration. Hint: --bandwidth 10gbit")
    intra = Link(parse_bandwidth(ns.intra_bandwidth)) if ns.intra_bandwidth else None
    try:
        overlap = float(ns.overlap)
    except ValueError:
        raise ConfigError(f"--overlap must be a number in [0, 1], got {ns.overlap!r}.") from None
    cluster = ClusterSpec(nodes, local, inter, intra, overlap)
    if calib is not None:
        notes.append("compression's CPU costs are this machine's (calibrated); on GPUs they "
                     "are far smaller, so compressors may do better there than shown")
    workload = _workload(ns, world, calib, notes)
    return workload, cluster, notes


def _workload(ns: argparse.Namespace, world: int, calib: Any, notes: list[str]) -> Workload:
    if ns.batch is not None and ns.global_batch is not None:
        raise ConfigError("give --batch (per rank) or --global-batch, not both.")
    batch = None
    if ns.global_batch is not None:
        g = _int(ns.global_batch, "--global-batch")
        if g < world:
            raise ConfigError(f"--global-batch {g} is smaller than the {world} replicas: some "
                              f"ranks would get no sample. Hint: --global-batch {world} or more, "
                              "or fewer --nodes / --gpus-per-node.")
        if g % world:
            notes.append(f"global batch {g} does not split evenly over {world} ranks; using "
                         f"{g // world} per rank")
        batch = g // world
    elif ns.batch is not None:
        batch = _int(ns.batch, "--batch")
    layers = _int(ns.layers, "--layers") if ns.layers is not None else None
    act = parse_count(ns.activation_numel, "--activation-numel") if ns.activation_numel else None
    if ns.script:
        from parlay.plan.profile import profile_script

        prof = profile_script(ns.script, ns.script_args)
        notes.append(f"profiled {ns.script}: {prof.params:,} parameters, batch {prof.batch}, "
                     f"{format_seconds(prof.compute_s_per_sample * prof.batch)} per step "
                     f"(median of {prof.steps})")
        w = prof.workload(batch)
        return Workload(w.params, w.batch, w.compute_s_per_sample, layers or w.layers,
                        act or w.activation_numel, w.shapes)
    if ns.model_params is None:
        raise ConfigError("give --model-params (e.g. 25e6) or --script train.py.")
    params = parse_count(ns.model_params, "--model-params")
    if batch is None:
        raise ConfigError("give --batch (samples per rank per step), e.g. --batch 64.")
    if ns.compute_ms is not None:
        per_step = parse_duration(f"{ns.compute_ms}ms" if str(ns.compute_ms).replace(
            ".", "", 1).isdigit() else ns.compute_ms, "--compute-ms")
    else:
        flops = calib.flops if calib is not None else 20e9
        per_step = 6 * params * batch / flops
        notes.append(f"compute: estimated as 6 x params x batch FLOPs at "
                     f"{flops / 1e9:.3g} GFLOP/s = {format_seconds(per_step)} per step "
                     "(pass --compute-ms or --script)")
    return Workload(params, batch, per_step / batch, layers, act)


def _table(ranked: list[Prediction], top: int) -> str:
    best = ranked[0].step_s
    rows = [("#", "mode", "compressor", "step", "samples/s", "vs best", "dominant")]
    for i, p in enumerate(ranked[: top or None], 1):
        mode = p.label.split(" + ")[0]
        share = p.terms[p.dominant] / p.step_s if p.step_s else 0.0
        rows.append((str(i), mode, p.compressor, format_seconds(p.step_s),
                     f"{p.samples_per_s:,.1f}", f"{p.step_s / best:.2f}x",
                     f"{p.dominant} {share:.0%}"))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if j in (1, 2, 6) else c.rjust(w)
                       for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_plan(ns: argparse.Namespace) -> int:
    """Run ``parlay plan`` for parsed options; prints the table or JSON."""
    t0 = time.perf_counter()
    try:
        calib = _calibration(ns)
        workload, cluster, notes = build_inputs(ns, calib)
        modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
        comps = [c.strip() for c in ns.compressors.split(",") if c.strip()]
        opts = _mode_options(ns, workload, cluster)
        costs = calib.costs if calib is not None else Costs()
        if ns.script and calib is not None and workload.shapes:
            from parlay.plan.calibrate import retime_codecs

            # the model was just profiled: time the codecs now too, under the same load
            costs = retime_codecs(costs, workload.shapes, comps, cluster.world)
            notes.append("compression's CPU costs timed now on the script's own parameter "
                         "shapes")
        ranked = _rank(workload, cluster, modes, comps, costs, opts)
    except PlanInputError:
        raise
    except ConfigError as e:
        raise PlanInputError(str(e)) from None
    sync = [p for p in ranked if ns.include_async or p.options.get("consistency") != "async"]
    why = explain(sync or ranked)
    if ns.json:
        print(json.dumps({"recommendation": _doc(sync[0] if sync else ranked[0]), "why": why,
                          "notes": notes, "predictions": [_doc(p) for p in ranked]}))
        return 0
    print(f"parlay plan: {workload.params:,.0f} parameters, batch {workload.batch} per rank, "
          f"compute {format_seconds(workload.compute_s)} per step; {cluster.nodes} host(s) x "
          f"{cluster.ranks_per_node} rank(s), {format_bandwidth(cluster.inter.bandwidth_bps)}, "
          f"latency {format_seconds(cluster.inter.latency_s)}")
    for n in notes:
        print(f"  note: {n}")
    print()
    print(_table(ranked, ns.top))
    print(f"\nrecommended: {why}")
    print(f"({len(ranked)} configurations in {time.perf_counter() - t0:.2f} s)")
    return 0


def _mode_options(ns: argparse.Namespace, w: Workload, c: ClusterSpec) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if ns.stages is not None:
        stages = _int(ns.stages, "--stages")
        if w.layers is not None and stages > w.layers:
            raise ConfigError(f"--stages {stages} is more than the model's {w.layers} layers: "
                              f"a stage would hold no layer. Hint: --stages {w.layers} or "
                              "fewer.")
        if c.world % stages:
            raise ConfigError(f"--stages {stages} must divide the {c.world} ranks "
                              "(stages x replicas).")
        opts["stages"] = stages
    if ns.chunks is not None:
        opts["chunks"] = _int(ns.chunks, "--chunks")
    if ns.servers is not None:
        opts["servers"] = _int(ns.servers, "--servers")
    return opts


def _rank(w: Workload, c: ClusterSpec, modes: list[str], comps: list[str], costs: Costs,
          opts: dict[str, Any]) -> list[Prediction]:
    from parlay.plan.advise import predict

    if not opts:
        return rank_configs(w, c, modes, comps, costs)
    out = []
    for mode in modes:
        mine = {k: v for k, v in opts.items()
                if (k in ("stages", "chunks") and mode == "hybrid")
                or (k == "servers" and mode == "ps")}
        variants = [{"consistency": s} for s in ("sync", "async")] if mode == "ps" else [{}]
        for extra in variants:
            for comp in comps:
                try:
                    out.append(predict(w, c, mode, comp, costs, **mine, **extra))
                except ConfigError:
                    if mode == "hybrid" and mine and comp == comps[0]:
                        raise  # the user's own --stages / --chunks cannot run: say why
    if not out:
        raise ConfigError("no mode x compressor combination can run on this cluster.")
    return sorted(out, key=lambda p: p.step_s)


def _doc(p: Prediction) -> dict[str, Any]:
    return {"mode": p.mode, "compressor": p.compressor, "options": p.options,
            "step_s": p.step_s, "samples_per_s": p.samples_per_s, "terms": p.terms,
            "dominant": p.dominant, "label": p.label}


def main(argv: list[str] | None = None) -> int:
    """``python -m parlay.plan.command ...`` (same as ``parlay plan ...``)."""
    parser = argparse.ArgumentParser(prog="parlay")
    add_plan_parser(parser.add_subparsers(dest="cmd"))
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" in args:
        i = args.index("--")
        args, rest = args[:i], args[i + 1:]
    else:
        rest = []
    ns = parser.parse_args(["plan", *args])
    ns.script_args = rest
    return run_plan(ns)
