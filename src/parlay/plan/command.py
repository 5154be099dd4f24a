"""``parlay plan``: predicted step time of every mode x compressor, and a recommendation.

::

    parlay plan --model-params 25e6 --batch 64 --nodes 16 --gpus-per-node 8 \\
                --bandwidth 10gbit --latency 50us --compute-ms 120
    parlay plan --script train.py --nodes 4 --gpus-per-node 2 --bandwidth 1gbit -- --lr 0.1

Without ``--compute-ms`` or ``--script`` the compute term is estimated as ``6 x params x batch``
FLOPs at this machine's measured matrix-multiply rate (a CPU estimate; pass your own numbers
for GPUs). Constants are calibrated on first use (a few seconds) and cached; ``--calibrate``
measures again, ``--no-calibrate`` uses built-in defaults. Configurations are ranked by time to
accuracy: step time x the compressor's measured convergence factor (:func:`advise.excluded`
says why one is never recommended). Inputs outside :data:`LIMITS` are refused with one line
(exit status 2): no model, link or cluster is that size. Exit status 1: ``--memory-per-rank``
was given and no shard level fits it (the table and the hint still print).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from parlay.errors import ConfigError
from parlay.plan.advise import (ALL_MODES, COMPRESSORS, Prediction, by_accuracy, diloco_advice,
                                excluded, explain, mode_takes, mode_variants, rank_configs)
from parlay.plan.model import ClusterSpec, Costs, Link, Workload, compressor_of
from parlay.plan.shard import ShardLevel, recommend_shard, shard_doc, shard_levels, state_per_param
from parlay.plan.units import (format_bandwidth, format_bytes, format_count, format_seconds,
                               parse_bandwidth, parse_count, parse_duration, parse_latency,
                               parse_size)

__all__ = ["LIMITS", "add_plan_parser", "run_plan", "build_inputs"]

#: The largest value each input may take (also documented in docs/modes.md): parameters beyond
#: any model (the largest have ~2e12), more ranks than any cluster, a link faster than 1 Pbit/s.
LIMITS: dict[str, float] = {
    "params": 1e13, "ranks": 1e6, "batch": 1e8, "compute_s": 3600.0, "min_bandwidth_bps": 1e3,
    "bandwidth_bps": 1e15, "latency_s": 10.0, "burst_bytes": 1e12, "layers": 1e6,
    "activation_numel": 1e12, "stages": 1024, "chunks": 4096}

_EPILOG = """\
examples:
  parlay plan --model-params 25e6 --batch 64 --nodes 16 --gpus-per-node 8 \\
              --bandwidth 10gbit --latency 50us --compute-ms 120
  parlay plan --script train.py --nodes 4 --bandwidth 1gbit -- --lr 0.1

--script runs your unchanged training script in one process until it has made a few
optimizer steps, then stops it: the time between steps is the compute term, the optimizer's
parameters are the model and the first dimension of the model's input is the batch.
The first run calibrates this machine (a few seconds, cached in ~/.cache/parlay or
$PARLAY_CACHE_DIR). Configurations are ranked by time to accuracy: step time x the
compressor's measured convergence factor; one that never reached the accuracy target (or
was never measured) is shown last and never recommended. Inputs no model or cluster has
(over 1e13 parameters or 1e6 ranks, links outside 1kbit..1000tbit) are refused."""


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
    g.add_argument("--layers", help="layers a pipeline can split between (limits --stages); "
                   "PowerSGD is priced on that many square layers (without it or --script: "
                   "on one)")
    g.add_argument("--activation-numel", help="elements per sample between pipeline stages")
    g.add_argument("--script", help="profile this training script for a few steps (single "
                                    "process); its arguments go after --")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", default="1", help="hosts (default 1)")
    c.add_argument("--gpus-per-node", "--ranks-per-node", dest="ranks_per_node", default="1",
                   help="training ranks per host (default 1)")
    c.add_argument("--bandwidth", help="each host's network link, e.g. 10gbit, 100mbit, 25Gbps "
                                       "(default: this machine's loopback)")
    c.add_argument("--latency", default="0", help="link latency, e.g. 50us or 0.2ms; a bare "
                   "number is seconds (default 0)")
    c.add_argument("--burst", help="bytes a token-bucket shaped link (tc tbf, cloud burst "
                   "credit) sends at once after resting, e.g. 125k (default: none)")
    c.add_argument("--intra-bandwidth", help="between ranks of one host (default: free; "
                   "without --bandwidth, this machine's loopback)")
    c.add_argument("--overlap", default="1", help="fraction of backward that communication "
                   "can hide behind: 1 for GPUs, 0 for CPU ranks using every core")
    o = p.add_argument_group("what to compare")
    o.add_argument("--modes", default=",".join(ALL_MODES),
                   help=f"default {','.join(ALL_MODES)}")
    o.add_argument("--compressors", default=",".join(COMPRESSORS), help="default %(default)s")
    o.add_argument("--stages", help="hybrid: pipeline stages (default: 2, 4, 8 that fit)")
    o.add_argument("--chunks", help="hybrid: micro-batches per step (default 4 x stages)")
    o.add_argument("--servers", help="ps: server shards on their own hosts (default --nodes)")
    o.add_argument("--diloco-h", help="diloco: inner steps per round, sync_every (default: "
                   "the smallest of 10, 25, 50, 100, 250, 500 using 90%% of the compute)")
    o.add_argument("--diloco-fragments", help="diloco: fragments synced at staggered steps "
                   "(default 1)")
    o.add_argument("--diloco-overlap", help="diloco: inner steps an exchange may run before it "
                   "is merged, tau (default 0)")
    o.add_argument("--async", dest="include_async", action="store_true",
                   help="also recommend asynchronous parameter servers (stale gradients)")
    o.add_argument("--top", default="0",
                   help="print (or put in --json) only the N fastest (default all)")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    z = p.add_argument_group("sharded data parallel (DistributedOptimizer(shard=...))")
    z.add_argument("--memory-per-rank", help="memory a rank has for parameters, gradients and "
                   "optimizer state, e.g. 8GiB, 512MB: prices the shard levels on the flat "
                   "ring of every rank and recommends the lowest that fits (exit status 1 "
                   "when none does)")
    z.add_argument("--optimizer", help="torch.optim name and options, e.g. adam, "
                   "sgd:momentum=0.9 (default adam): its state per parameter is measured")
    z.add_argument("--shard", action="store_true",
                   help="show the shard levels without a memory limit")
    k = p.add_argument_group("calibration")
    k.add_argument("--calibrate", action="store_true", help="measure this machine again")
    k.add_argument("--no-calibrate", action="store_true", help="built-in constants only")
    return p


def _int(text: Any, what: str, low: int = 1, high: float = LIMITS["ranks"]) -> int:
    """An integer option (``64``, ``1e3``, ``2k``) from ``low`` to ``high``."""
    raw = str(text).strip()
    try:
        v = float(int(raw))
    except (ValueError, OverflowError):  # (a huge integer: read as inf, refused below)
        try:
            v = parse_count(raw, what)
        except ConfigError:
            v = math.nan  # unreadable: the message below names the option and an example
    if not low <= v <= high or v != int(v):
        raise ConfigError(f"{what} must be an integer >= {low} and at most {high:,.0f}, got "
                          f"{text!r}. Hint: {what} {low if not v > high else int(high)}.")
    return int(v)


def _within(v: float, low: float, high: float, what: str, text: Any, expect: str) -> float:
    """``v`` (read from ``text``) when in ``[low, high]``, else the one-line refusal."""
    if not low <= v <= high:
        raise ConfigError(f"{what} must be {expect}; got {text!r}.")
    return v


def _rate(text: Any, what: str) -> float:
    return _within(parse_bandwidth(text, what), LIMITS["min_bandwidth_bps"],
                   LIMITS["bandwidth_bps"], what, text,
                   f"from 1kbit to 1000tbit per second, e.g. {what} 10gbit")


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
    if world > LIMITS["ranks"]:
        most = int(LIMITS["ranks"])
        raise ConfigError(f"--nodes {nodes} x --gpus-per-node {local} is {world:,} ranks, more "
                          f"than {most:,}. Hint: --nodes {most // local} or fewer.")
    burst = _within(parse_size(ns.burst, "--burst"), 1, LIMITS["burst_bytes"], "--burst",
                    ns.burst, "from 1 byte to 1 TB, e.g. --burst 125k") if ns.burst else 0.0
    if burst and ns.bandwidth is None:
        raise ConfigError("--burst shapes a network link: give its rate too. Hint: "
                          "--bandwidth 100mbit --burst 125k")
    latency = _within(parse_latency(ns.latency), 0, LIMITS["latency_s"], "--latency", ns.latency,
                      "from 0 to 10 s, e.g. --latency 50us")
    if ns.bandwidth is not None:
        inter = Link(_rate(ns.bandwidth, "--bandwidth"), latency, burst_bytes=burst)
    elif calib is not None:
        inter = Link(calib.loopback.bandwidth_bps, latency, 1.0)
        notes.append(f"link: this machine's loopback, {format_bandwidth(inter.bandwidth_bps)}, "
                     "between hosts and between a host's ranks (pass --bandwidth for your "
                     "network)")
    else:
        raise ConfigError("--bandwidth is needed without calibration. Hint: --bandwidth 10gbit")
    # on the loopback's measure, a host's ranks talk over it too (as tools/bench prices them)
    intra = (Link(_rate(ns.intra_bandwidth, "--intra-bandwidth")) if ns.intra_bandwidth
             else inter if ns.bandwidth is None else None)
    try:
        overlap = float(ns.overlap)
    except ValueError:
        overlap = math.nan
    _within(overlap, 0, 1, "--overlap", ns.overlap,
            "a number from 0 to 1, e.g. --overlap 1 for GPUs, 0 for CPU ranks using every core")
    cluster = ClusterSpec(nodes, local, inter, intra, overlap)
    notes.append("compression's CPU costs (codecs, gloo's 16-bit sums) are " + (
        "built-in CPU constants (--no-calibrate)" if calib is None else "this machine's "
        "(calibrated)") + "; on GPUs they are far smaller, so compressors may do better there "
        "than shown")
    workload = _workload(ns, world, calib, notes)
    return workload, cluster, notes


def _compute_s(text: Any) -> float:
    """``--compute-ms`` in seconds: a bare number (``120``, ``1.2e2``) is milliseconds."""
    try:
        float(str(text))
        spelled = f"{text}ms"
    except ValueError:
        spelled = str(text)  # with its own unit, e.g. 0.12s
    return _within(parse_duration(spelled, "--compute-ms"), 0, LIMITS["compute_s"],
                   "--compute-ms", text, "from 0 to one hour per step, e.g. --compute-ms 120")


def _workload(ns: argparse.Namespace, world: int, calib: Any, notes: list[str]) -> Workload:
    if ns.batch is not None and ns.global_batch is not None:
        raise ConfigError("give --batch (per rank) or --global-batch, not both.")
    batch = None
    if ns.global_batch is not None:
        g = _int(ns.global_batch, "--global-batch", high=LIMITS["batch"])
        if g < world:
            raise ConfigError(f"--global-batch {g} is smaller than the {world} replicas: some "
                              f"ranks would get no sample. Hint: --global-batch {world} or more, "
                              "or fewer --nodes / --gpus-per-node.")
        if g % world:
            notes.append(f"global batch {g} does not split evenly over {world} ranks; using "
                         f"{g // world} per rank")
        batch = g // world
    elif ns.batch is not None:
        batch = _int(ns.batch, "--batch", high=LIMITS["batch"])
    layers = _int(ns.layers, "--layers", high=LIMITS["layers"]) if ns.layers is not None else None
    act = _within(parse_count(ns.activation_numel, "--activation-numel"), 1,
                  LIMITS["activation_numel"], "--activation-numel", ns.activation_numel,
                  "from 1 to 1e12 elements, e.g. --activation-numel 4096"
                  ) if ns.activation_numel else None
    if ns.script:
        from parlay.plan.profile import profile_script

        if ns.model_params is not None:
            raise ConfigError("--script counts the model's parameters itself: drop "
                              "--model-params (or --script to price a model you describe).")
        prof = profile_script(ns.script, ns.script_args)
        notes.append(f"profiled {ns.script}: {prof.params:,} parameters, batch {prof.batch}, "
                     f"{format_seconds(prof.compute_s_per_sample * prof.batch)} per step "
                     f"(median of {prof.steps})")
        w = prof.workload(batch)
        per_sample = w.compute_s_per_sample if ns.compute_ms is None else \
            _compute_s(ns.compute_ms) / w.batch  # e.g. shapes profiled here, a GPU's step
        return Workload(w.params, w.batch, per_sample, layers or w.layers,
                        act or w.activation_numel, w.shapes)
    if ns.model_params is None:
        raise ConfigError("give --model-params (e.g. 25e6) or --script train.py.")
    params = _within(parse_count(ns.model_params, "--model-params"), 1, LIMITS["params"],
                     "--model-params", ns.model_params, "from 1 to 1e13 (no model has more; the "
                     "largest have about 2e12), e.g. --model-params 25e6 (or 25M, 1.3B)")
    if batch is None:
        raise ConfigError("give --batch (samples per rank per step), e.g. --batch 64.")
    if ns.compute_ms is not None:
        per_step = _compute_s(ns.compute_ms)
    else:
        flops = calib.flops if calib is not None else 20e9
        per_step = 6 * params * batch / flops
        notes.append(f"compute: estimated as 6 x params x batch FLOPs at "
                     f"{flops / 1e9:.3g} GFLOP/s = {format_seconds(per_step)} per step "
                     "(pass --compute-ms or --script)")
    return Workload(params, batch, per_step / batch, layers, act)


def _table(ranked: list[Prediction], top: int) -> str:
    best = ranked[0].to_accuracy_s
    rows = [("#", "mode", "compressor", "step", "factor", "samples/s", "to accuracy",
             "dominant")]
    for i, p in enumerate(ranked[: top or None], 1):
        mode = p.label.split(" + ")[0]
        share = p.terms[p.dominant] / p.step_s if p.step_s else 0.0
        vs = p.to_accuracy_s / best if best and math.isfinite(p.to_accuracy_s) else None
        rows.append((str(i), mode, p.compressor, format_seconds(p.step_s), p.factor_text,
                     format_count(p.samples_per_s),
                     "-" if vs is None else f"{vs:.2f}x" if vs < 100 else f"{vs:.3g}x",
                     f"{p.dominant} {share:.0%}"))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if j in (1, 2, 7) else c.rjust(w)
                       for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_plan(ns: argparse.Namespace) -> int:
    """Run ``parlay plan`` for parsed options; prints the table or JSON.

    Returns:
        0, or 2 after one line on stderr naming an input that cannot be planned and the fix.
    """
    try:
        return _plan(ns)
    except ConfigError as e:
        print(f"parlay plan: {e}", file=sys.stderr)
        return 2


def _specs(text: str) -> list[str]:
    """Compression specs separated by commas; a ``key=value`` part belongs to the spec before
    it (``"none,topk:0.01,compact=1"`` is two specs)."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if out and "=" in part and ":" not in part:
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def _plan(ns: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    top = _int(ns.top, "--top", low=0)
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    comps = _specs(ns.compressors)
    if not modes or not comps:
        raise ConfigError("--modes and --compressors each need at least one name. Hint: "
                          "--modes allreduce --compressors none,topk:0.01")
    for c in comps:  # an unknown or unpriceable one: refused here, never dropped from the table
        try:
            compressor_of(c).wire_rounds(1 << 20)
        except ConfigError as e:
            script = (" (a compressor that --script registers is registered in the script's "
                      "process only: price it from Python, e.g. parlay.plan.predict, after "
                      "registering it)" if ns.script else "")
            raise ConfigError(f"--compressors {c!r}: {e}{script}") from None
    memory = parse_size(ns.memory_per_rank) if ns.memory_per_rank is not None else None
    k = state_per_param(ns.optimizer or "adam")
    calib = _calibration(ns)
    workload, cluster, notes = build_inputs(ns, calib)
    opts = _mode_options(ns, workload, cluster)
    for mode in ALL_MODES:  # (they were ignored, but for diloco's)
        given = [_FLAGS[key] for key in opts if key in mode_takes(mode)]
        if given and mode not in modes:
            raise ConfigError(f"{', '.join(given)} price{'s' if len(given) == 1 else ''} mode "
                              f"{mode}, which --modes {ns.modes} leaves out. Hint: add {mode} "
                              "to --modes.")
    costs = calib.costs if calib is not None else Costs()
    if ns.script and calib is not None and workload.shapes:
        from parlay.plan.calibrate import retime_codecs

        # the model was just profiled: time the codecs now too, under the same load
        costs = retime_codecs(costs, workload.shapes, comps, cluster.world)
        notes.append("compression's CPU costs timed now on the script's own parameter "
                     "shapes")
    ranked = _rank(workload, cluster, modes, comps, costs, opts)
    sync = [p for p in ranked if p.exact or (ns.include_async and "consistency" in p.options)]
    why, left_out = explain(sync or ranked), excluded(ranked)
    dl = diloco_advice(ranked, workload, cluster)
    # the shard table prices the one compressor asked for if it is element-wise, else dense
    one = comps[0] if len(comps) == 1 else "none"
    try:
        levels = shard_levels(workload, cluster, k, one, costs)
    except ConfigError:  # not element-wise (top-k, PowerSGD): sharding reduces dense
        levels = shard_levels(workload, cluster, k, "none", costs)
    if ns.optimizer is None and (memory is not None or ns.shard or ns.json):
        notes.append("shard levels: Adam's state assumed (2 tensors per parameter); pass "
                     "--optimizer")
    # exit status 1: --memory-per-rank given and no shard level fits it
    status = int(memory is not None and all(lv.memory_bytes > memory for lv in levels))
    if ns.json:
        best = next(p for p in sync or ranked if math.isfinite(p.to_accuracy_s))
        print(json.dumps({"recommendation": _doc(best), "why": why, "excluded": left_out,
                          "notes": notes, "predictions": [_doc(p) for p in ranked[: top or None]],
                          "diloco": dl,
                          "shard": shard_doc(levels, k, memory, cluster.world)}))
        return status
    print(f"parlay plan: {workload.params:,.0f} parameters, batch {workload.batch} per rank, "
          f"compute {format_seconds(workload.compute_s)} per step; {cluster.nodes} host(s) x "
          f"{cluster.ranks_per_node} rank(s), {format_bandwidth(cluster.inter.bandwidth_bps)}, "
          f"latency {format_seconds(cluster.inter.latency_s)}")
    for n in notes:
        print(f"  note: {n}")
    print()
    print(_table(ranked, top))
    print(f"\nrecommended: {why}")
    if dl is not None:
        print(f"diloco: {dl['why']}")
    for line in left_out:
        print(f"not recommended: {line}")
    if memory is not None or ns.shard:
        print(f"\n{_shard_table(levels, memory, cluster.world, k)}")
    print(f"({len(ranked)} configurations in {time.perf_counter() - t0:.2f} s)")
    return status


def _shard_table(levels: list[ShardLevel], memory: float | None, world: int, k: float) -> str:
    ddp = levels[0]
    rows = [("shard", "memory/rank", "fits", "wire/rank/step", "vs DDP", "step")]
    for lv in levels:
        fits = "-" if memory is None else "yes" if lv.memory_bytes <= memory else "no"
        rows.append(("none (DDP)" if lv.level == "none" else lv.level,
                     format_bytes(lv.memory_bytes), fits, format_bytes(lv.wire_bytes),
                     f"{lv.wire_bytes / ddp.wire_bytes:.2f}x" if ddp.wire_bytes else "-",
                     format_seconds(lv.step_s)))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    lines = [f"shard levels on {world} data-parallel ranks (optimizer state {k:g} x "
             "parameters; parameters, gradients and state only):"]
    lines += ["  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(2, "  ".join("-" * w for w in widths))
    if memory is not None:
        lines.append(recommend_shard(levels, memory, world))
    return "\n".join(lines)


#: The option each mode flag sets (:func:`_mode_options`) -> the flag.
_FLAGS = {"stages": "--stages", "chunks": "--chunks", "servers": "--servers",
          "sync_every": "--diloco-h", "fragments": "--diloco-fragments",
          "overlap": "--diloco-overlap"}


def _mode_options(ns: argparse.Namespace, w: Workload, c: ClusterSpec) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if ns.stages is not None:
        stages = _int(ns.stages, "--stages", high=LIMITS["stages"])
        if w.layers is not None and stages > w.layers:
            raise ConfigError(f"--stages {stages} is more than the model's {w.layers} layers: "
                              f"a stage would hold no layer. Hint: --stages {w.layers} or "
                              "fewer.")
        if c.world % stages:
            raise ConfigError(f"--stages {stages} must divide the {c.world} ranks "
                              "(stages x replicas).")
        opts["stages"] = stages
    if ns.chunks is not None:
        opts["chunks"] = _int(ns.chunks, "--chunks", high=LIMITS["chunks"])
    if ns.servers is not None:
        opts["servers"] = _int(ns.servers, "--servers")
    for key, flag in (("sync_every", "h"), ("fragments", "fragments"), ("overlap", "overlap")):
        value = getattr(ns, f"diloco_{flag}", None)
        if value is not None:
            opts[key] = _int(value, f"--diloco-{flag}", low=0 if key == "overlap" else 1)
    return opts


def _rank(w: Workload, c: ClusterSpec, modes: list[str], comps: list[str], costs: Costs,
          opts: dict[str, Any]) -> list[Prediction]:
    from parlay.plan.advise import predict

    out = [] if opts else rank_configs(w, c, modes, comps, costs)
    for mode in modes if opts else ():
        mine = {k: v for k, v in opts.items() if k in mode_takes(mode)}
        variants = mode_variants(mode, w, c, mine)
        if mine and variants:  # the user's own options cannot run: say why
            predict(w, c, mode, "none", costs, **mine, **variants[0])
        for extra in variants:
            for comp in comps:
                try:
                    out.append(predict(w, c, mode, comp, costs, **mine, **extra))
                except ConfigError:
                    pass
    if not out:
        raise ConfigError(
            f"no combination of --modes {','.join(modes)} and --compressors {','.join(comps)} "
            f"can run on {c.nodes} host(s) x {c.ranks_per_node} rank(s): hierarchical needs "
            "several hosts with several ranks each and takes no top-k; parameter servers take "
            "neither PowerSGD nor int8; hybrid's stages must divide the ranks. Hint: add "
            "allreduce to --modes.")
    return by_accuracy(out)


def _doc(p: Prediction) -> dict[str, Any]:
    finite = math.isfinite(p.to_accuracy_s)
    return {"mode": p.mode, "compressor": p.compressor, "options": p.options,
            "step_s": p.step_s, "terms": p.terms,  # (a step of 0 s: samples/s null, not inf)
            "samples_per_s": p.samples_per_s if math.isfinite(p.samples_per_s) else None,
            "dominant": p.dominant, "label": p.label, "utilisation": p.utilisation,
            "factor": p.factor if finite else None,
            "to_accuracy_s": p.to_accuracy_s if finite else None}


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
