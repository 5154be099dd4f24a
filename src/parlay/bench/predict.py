"""The cost model's prediction next to every measured point, and how good it was.

:func:`predict_point` is the one place that speaks :mod:`parlay.plan`'s interface: a change of
its signature is a change here only. Without the cost model every point still gets measured;
its prediction is ``None`` and the report says so.
"""
from __future__ import annotations

import math
from typing import Any

from parlay.bench.common import median

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
        p: A point as :mod:`parlay.bench.runner` records it (params, shapes, batch, workers,
            hosts, ranks_per_host, link_bps, compute_s_per_sample, mode, compressor, opts).

    Returns:
        ``{"step_s", "samples_per_s", "dominant", "terms"}``.
    """
    plan = _model()
    if plan is None or p["mode"] == "compute":
        return None
    from parlay.plan.calibrate import local_overlap

    cal = _costs()
    wl = plan.Workload(params=p["params"], batch=p["batch"],
                       compute_s_per_sample=p["compute_s_per_sample"], layers=p["layers"],
                       activation_numel=p["activation_numel"],
                       shapes=tuple(tuple(s) for s in p["shapes"]))
    local = cal.loopback
    inter = (plan.Link(float(p["link_bps"]), _LINK_LATENCY_S) if p["link_bps"] else local)
    per_host = min(p["ranks_per_host"], p["workers"])  # parameter servers are not ranks here
    cl = plan.ClusterSpec(nodes=max(1, p["workers"] // per_host), ranks_per_node=per_host,
                          inter=inter, intra=local, overlap=local_overlap(p["world"]))
    opts = dict(p["opts"])
    if p["mode"] == "ps":
        opts["server_link"] = inter
    if p["compressor"] == "auto":  # auto should do as well as the best fixed choice
        preds = []
        for comp in plan.COMPRESSORS:
            try:
                preds.append(plan.predict(wl, cl, p["mode"], comp, cal.costs, **opts))
            except ValueError:  # ConfigError: a combination the mode cannot run
                continue
        pred = min(preds, key=lambda q: q.step_s)
    else:
        pred = plan.predict(wl, cl, p["mode"], p["compressor"], cal.costs, **opts)
    return {"step_s": float(pred.step_s), "samples_per_s": float(pred.samples_per_s),
            "dominant": str(pred.dominant) + (f" ({pred.compressor})" if p["compressor"] ==
                                              "auto" else ""),
            "terms": {str(k): float(v) for k, v in dict(pred.terms).items()}}


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


def _order_stats(points: list[dict[str, Any]]) -> tuple[float, float, int]:
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
        for i, a in enumerate(grp):
            for b in grp[i + 1:]:
                pairs += 1
                tie = abs(a["samples_s"] - b["samples_s"]) <= TIE * max(a["samples_s"],
                                                                         b["samples_s"])
                same = (a["predicted_step_s"] < b["predicted_step_s"]) == (
                    a["step_s"] < b["step_s"])
                right += tie or same
        best = max(p["samples_s"] for p in grp)
        pick = min(grp, key=lambda p: p["predicted_step_s"])
        first_ok += pick["samples_s"] >= (1 - TIE) * best
    return (right / pairs if pairs else math.nan, first_ok / configs if configs else math.nan,
            configs)


def recommendations(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link: the model's pick among parlay's ways to run the data-parallel launch (every
    mode and compressor on the same hosts) against the best one measured."""
    out = []
    for net in dict.fromkeys(p["net"] for p in points):
        cands = [p for p in _scored(points) if p["net"] == net and p["launch"] == "dp"
                 and p["contestant"] != "ddp"]
        if not cands:
            continue
        pick = min(cands, key=lambda p: p["predicted_step_s"])
        best = max(cands, key=lambda p: p["samples_s"])
        out.append({"net": net, "recommended": pick["contestant"],
                    "recommended_samples_s": pick["samples_s"], "best": best["contestant"],
                    "best_samples_s": best["samples_s"],
                    "ratio": pick["samples_s"] / best["samples_s"]})
    return out


def summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and largest relative error, order agreement and recommendation quality."""
    errs = [abs(p["rel_err"]) for p in _scored(points)]
    pairs, first, configs = _order_stats(points)
    recs = recommendations(points)
    return {"points": len(points), "predicted_points": len(errs),
            "median_rel_err": median(errs) if errs else None,
            "max_rel_err": max(errs) if errs else None,
            "order_pairs_right": pairs, "fastest_first_right": first, "configurations": configs,
            "recommendations": recs,
            "recommended_within_5pct": (all(r["ratio"] >= 0.95 for r in recs) if recs
                                        else None)}
