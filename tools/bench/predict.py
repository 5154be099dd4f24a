"""The cost model's prediction next to every measured point, and how good it was.

:func:`predict_point` is the one place that speaks :mod:`parlay.plan`'s interface: a change of
its signature is a change here only. Without the cost model every point still gets measured;
its prediction is ``None`` and the report says so.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from tools.bench.harness import median

__all__ = ["predict_point", "attach_predictions", "summary", "recommendations", "TIE"]

# Two measured points closer than this are a tie: either order counts as right.
TIE = 0.05
# One-way latency assumed for a link the harness shaped (tbf adds none; the kernel's path
# through two veth pairs and a bridge is tens of microseconds).
_LINK_LATENCY_S = 50e-6
_calibration: list[Any] = []


def _model() -> Any:
    try:
        import parlay.plan as plan
    except ImportError:
        return None
    return plan


def _costs() -> Any:
    """This machine's calibration (cached by parlay.plan; measured once when missing)."""
    if not _calibration:
        from parlay.plan.calibrate import load_costs

        _calibration.append(load_costs())
    return _calibration[0]


def predict_point(p: dict[str, Any]) -> dict[str, Any] | None:
    """The cost model's step time for one measured point, or ``None`` without the model.

    Args:
        p: A point as :mod:`tools.bench.runner` records it (params, shapes, batch, workers,
            hosts, ranks_per_host, link_bps, compute_s_per_sample, mode, compressor, opts).

    Returns:
        ``{"step_s", "samples_per_s", "dominant", "terms"}``.
    """
    plan = _model()
    if plan is None or p["mode"] == "compute":
        return None
    from parlay.plan.calibrate import local_overlap
    from tools.cluster import tbf_burst

    cal = _costs()
    wl = plan.Workload(params=p["params"], batch=p["batch"],
                       compute_s_per_sample=p["compute_s_per_sample"], layers=p["layers"],
                       activation_numel=p["activation_numel"],
                       shapes=tuple(tuple(s) for s in p["shapes"]))
    local, costs = _in_run(p, cal.loopback, cal.costs)
    inter = (plan.Link(float(p["link_bps"]), _LINK_LATENCY_S,
                       burst_bytes=tbf_burst(p["link_bps"])) if p["link_bps"] else local)
    per_host = min(p["ranks_per_host"], p["workers"])  # parameter servers are not ranks here
    cl = plan.ClusterSpec(nodes=max(1, p["workers"] // per_host), ranks_per_node=per_host,
                          inter=inter, intra=local, overlap=local_overlap(p["world"]))
    opts = dict(p["opts"])
    if p["mode"] == "hybrid" and "layer_costs" not in opts:
        opts["layer_costs"] = _layer_costs(p["shapes"])
    if p["mode"] == "hybrid" and p.get("probe_act_s") is not None:
        # One message timed next to the step holds the software costs of now; a shaped
        # link's token bucket lets one message through at burst speed, and the model's
        # shaper paces the step's back-to-back transfers to the link's rate.
        opts["transfer_s"] = costs.pipe_op_s + p["probe_act_s"]
    if p["mode"] == "ps":
        opts["server_link"] = inter
    comp = p["compressor"]
    if comp == "auto" and p.get("chose"):  # what auto ran, when one choice for every bucket
        chosen = {c.partition("=")[2] for c in str(p["chose"]).split()}
        comp = chosen.pop() if len(chosen) == 1 and "" not in chosen else "auto"
    if comp == "auto":  # undecided or mixed: auto should do as well as the best fixed choice
        preds = []
        for c in plan.COMPRESSORS:
            try:
                preds.append(plan.predict(wl, cl, p["mode"], c, costs, **opts))
            except ValueError:  # ConfigError: a combination the mode cannot run
                continue
        pred = min(preds, key=lambda q: q.step_s)
    else:
        pred = plan.predict(wl, cl, p["mode"], comp, costs, **opts)
    return {"step_s": float(pred.step_s), "samples_per_s": float(pred.samples_per_s),
            "dominant": str(pred.dominant) + (f" ({pred.compressor})" if p["compressor"] ==
                                              "auto" else ""),
            "terms": {str(k): float(v) for k, v in dict(pred.terms).items()}}


def _layer_costs(shapes: list[list[int]]) -> list[float]:
    """Parameters per layer of the benchmark MLP (a weight matrix and the vectors after it):
    what parlay balances pipeline stages on by default."""
    out: list[float] = []
    for s in shapes:
        n = float(math.prod(s))
        if len(s) >= 2 or not out:
            out.append(n)
        else:
            out[-1] += n
    return out


def _in_run(p: dict[str, Any], loopback: Any, costs: Any) -> tuple[Any, Any]:
    """The loopback link and constants, with what was timed next to this point's steps in
    place of the cached calibration (measured at another moment, under another load): its
    compressor's encode and decode, a copy of the gradient, and (ranks on one machine) a tiny
    and a gradient-sized allreduce or the servers' exchange. Never the point's own step
    time."""
    from parlay.plan.insitu import exchange_link, probe_link, with_codec_time

    if p.get("probe_dense_s") and p.get("probe_tiny_s") is not None:
        loopback, costs = probe_link(p["probe_tiny_s"], p["probe_dense_s"], 4 * p["params"],
                                     p["world"], costs, p.get("probe_half_s"))
    if p.get("probe_copy_s"):  # the gradient's copy, timed now
        costs = dataclasses.replace(costs,
                                    copy_s_per_byte=p["probe_copy_s"] / (4 * p["params"]))
    if p.get("probe_ps_s"):  # parameter servers on one machine: their exchange, timed now
        loopback = exchange_link(p["probe_ps_s"], 4 * p["params"])
    if p.get("codec_s") is not None and p.get("codec"):
        costs = with_codec_time(costs, p["codec"], p["params"], p["world"], p["codec_s"])
    return loopback, costs


def attach_predictions(points: list[dict[str, Any]]) -> str | None:
    """Add ``predicted_step_s``, ``rel_err`` (signed, of step time) and ``dominant`` to each
    point. Returns why there are no predictions (one line), or ``None``."""
    if _model() is None:
        return "cost model (parlay.plan) not available: points carry no prediction"
    errors = []
    for p in points:
        try:
            pred = predict_point(p)
        except Exception as e:  # noqa: BLE001 - one bad point must not lose the run
            errors.append(f"{p['net']}/{p['contestant']}: {type(e).__name__}: {e}")
            pred = None
        p["predicted_step_s"] = pred["step_s"] if pred else None
        p["dominant"] = pred["dominant"] if pred else None
        p["terms"] = pred["terms"] if pred else None
        if pred and p["step_s"] > 0:
            p["predicted_samples_s"] = p["samples_s"] * p["step_s"] / pred["step_s"]
            p["rel_err"] = (pred["step_s"] - p["step_s"]) / p["step_s"]
        else:
            p["predicted_samples_s"] = p["rel_err"] = None
    return f"no prediction for {len(errors)} point(s): {errors[0]}" if errors else None


def _scored(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if p.get("rel_err") is not None]


def _speed(p: dict[str, Any], key: str, normalised: bool) -> float:
    """A point's step time (``key``: measured or predicted), as a multiple of its own
    compute-only step timed next to it when ``normalised``: points of one configuration were
    measured minutes apart, and on shared cores a busier minute would otherwise decide."""
    return p[key] / p["compute_step_s"] if normalised else p[key]


def _order_stats(points: list[dict[str, Any]], normalised: bool = False
                 ) -> tuple[float, float, int]:
    """(fraction of pairs ordered right, fraction of configurations whose predicted fastest is
    the measured fastest or within TIE of it, configurations). A configuration is one launch
    on one link: the same workload on the same hardware, run several ways."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in _scored(points):
        groups.setdefault((p["net"], p["launch"]), []).append(p)
    right = pairs = first_ok = configs = 0
    for grp in groups.values():
        if len(grp) < 2:
            continue
        configs += 1
        meas = [_speed(p, "step_s", normalised) for p in grp]
        pred = [_speed(p, "predicted_step_s", normalised) for p in grp]
        for i in range(len(grp)):
            for j in range(i + 1, len(grp)):
                pairs += 1
                tie = abs(meas[i] - meas[j]) <= TIE * min(meas[i], meas[j])
                right += tie or (pred[i] < pred[j]) == (meas[i] < meas[j])
        pick = min(range(len(grp)), key=lambda k: pred[k])
        first_ok += meas[pick] <= min(meas) / (1 - TIE)
    return (right / pairs if pairs else math.nan, first_ok / configs if configs else math.nan,
            configs)


def recommendations(points: list[dict[str, Any]],
                    normalised: bool = False) -> list[dict[str, Any]]:
    """Per link: the model's pick among parlay's ways to run the data-parallel launch (every
    mode and compressor on the same hosts) against the best one measured; ``normalised``:
    both as fractions of each point's own compute-only limit (see :func:`_speed`)."""
    out = []
    for net in dict.fromkeys(p["net"] for p in points):
        cands = [p for p in _scored(points) if p["net"] == net and p["launch"] == "dp"
                 and p["contestant"] != "ddp"]
        if not cands:
            continue
        pick = min(cands, key=lambda p: _speed(p, "predicted_step_s", normalised))
        best = min(cands, key=lambda p: _speed(p, "step_s", normalised))
        key = "of_limit" if normalised else "samples_s"
        out.append({"net": net, "recommended": pick["contestant"],
                    "recommended_samples_s": pick["samples_s"], "best": best["contestant"],
                    "best_samples_s": best["samples_s"], "ratio": pick[key] / best[key]})
    return out


def summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and largest relative error, order agreement and recommendation quality."""
    errs = [abs(p["rel_err"]) for p in _scored(points)]
    pairs, first, configs = _order_stats(points)
    npairs, nfirst, _ = _order_stats(points, normalised=True)
    recs = recommendations(points)
    nrecs = recommendations(points, normalised=True)
    return {"points": len(points), "predicted_points": len(errs),
            "median_rel_err": median(errs) if errs else None,
            "max_rel_err": max(errs) if errs else None,
            "order_pairs_right": pairs, "fastest_first_right": first, "configurations": configs,
            "order_pairs_right_normalised": npairs, "fastest_first_right_normalised": nfirst,
            "recommendations": recs, "recommendations_normalised": nrecs,
            "recommended_within_5pct": (all(r["ratio"] >= 0.95 for r in recs) if recs
                                        else None),
            "recommended_within_5pct_normalised": (all(r["ratio"] >= 0.95 for r in nrecs)
                                                   if nrecs else None)}
