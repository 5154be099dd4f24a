"""``report.md`` and the console summary of a ``parlay bench`` results document."""
from __future__ import annotations

from typing import Any

from tools.bench.harness import fmt, table

__all__ = ["render", "console", "limit_table", "points_table", "LABELS"]

# How contestants read in tables and plots.
LABELS = {"compute": "compute only (limit)", "ddp": "DDP", "none": "parlay dense",
          "flat": "flat allreduce (2x2)", "hier": "hierarchical (2x2)",
          "pipe:gpipe": "pipeline GPipe", "pipe:1f1b": "pipeline 1F1B",
          "ps:sync": "PS sync", "ps:stale:2": "PS stale:2", "ps:async": "PS async"}


def label(name: str) -> str:
    return LABELS.get(name, name)


def _md(rows: list[dict[str, Any]], cols: list[tuple[str, str]]) -> str:
    """A markdown table: ``cols`` are (key, header)."""
    out = ["| " + " | ".join(h for _, h in cols) + " |",
           "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(k, "")) for k, _ in cols) + " |")
    return "\n".join(out)


def _pct(v: Any) -> str:
    return "-" if v is None or v != v else f"{100 * v:+.0f}%"


def limit_table(doc: dict[str, Any]) -> str:
    """Contestant x link: samples/s as a fraction of the compute-only limit (markdown)."""
    nets = doc["nets"]
    keys = list(dict.fromkeys((p["launch"], p["contestant"]) for p in doc["points"]
                              if p["contestant"] != "compute"))
    by = {(p["net"], p["launch"], p["contestant"]): p for p in doc["points"]}
    rows = []
    for launch, name in keys:
        row = {"what": f"{launch}: {label(name)}"}
        for net in nets:
            p = by.get((net, launch, name))
            row[net] = "" if p is None else f"{p['of_limit']:.2f} ({p['samples_s']:.0f}/s)"
        rows.append(row)
    return _md(rows, [("what", "launch: contestant"), *((n, n) for n in nets)])


def points_table(doc: dict[str, Any], net: str) -> str:
    """Every point of one link, measured next to predicted (markdown)."""
    rows = []
    for p in doc["points"]:
        if p["net"] != net:
            continue
        pred = p.get("predicted_step_s")
        rows.append({"launch": p["launch"], "what": label(p["contestant"]),
                     "samples_s": p["samples_s"], "of_limit": p["of_limit"],
                     "step_ms": 1e3 * p["step_s"],
                     "pred_ms": 1e3 * pred if pred else None,
                     "err": _pct(p.get("rel_err")), "dominant": p.get("dominant") or "",
                     "nic": p["nic_tx_MB"] or None, "chose": p.get("chose", "")})
    return _md(rows, [("launch", "launch"), ("what", "contestant"), ("samples_s", "samples/s"),
                      ("of_limit", "of limit"), ("step_ms", "step ms"),
                      ("pred_ms", "predicted ms"), ("err", "error"),
                      ("dominant", "dominant term"), ("nic", "NIC MB/step/host"),
                      ("chose", "auto chose")])


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["summary"]
    if not s["predicted_points"]:
        return ["No predictions (see notes)."]
    out = [f"- points with a prediction: {s['predicted_points']} of {s['points']}",
           f"- relative error of the predicted step time: median "
           f"{100 * s['median_rel_err']:.1f}%, largest {100 * s['max_rel_err']:.1f}%",
           f"- mode order: {100 * s['order_pairs_right']:.0f}% of pairs ordered right (ties "
           f"within 5% count as right); predicted fastest is the measured fastest (within 5%) "
           f"in {100 * s['fastest_first_right']:.0f}% of {s['configurations']} configurations"]
    if s["recommendations"]:
        out.append("- recommendation: the model's fastest among the 2-rank launch's modes and "
                   "compressors (DDP aside) against the fastest measured there:")
    for r in s["recommendations"]:
        out.append(f"  - {r['net']}: recommended `{r['recommended']}` "
                   f"({r['recommended_samples_s']:.0f} samples/s), best measured `{r['best']}` "
                   f"({r['best_samples_s']:.0f}): {r['ratio']:.2f}x of the best")
    if s.get("recommendations_normalised"):
        out.append(f"- the same with every point as a fraction of its own compute-only step "
                   f"(timed next to it: load drifts between points): pairs ordered right "
                   f"{100 * s['order_pairs_right_normalised']:.0f}%, fastest first in "
                   f"{100 * s['fastest_first_right_normalised']:.0f}%; recommended vs best: "
                   + ", ".join(f"{r['net']} `{r['recommended']}` {r['ratio']:.2f}x"
                               for r in s["recommendations_normalised"]))
    return out


def _accuracy_md(doc: dict[str, Any]) -> str:
    rows = [dict(r, wire=r["wire_bytes_per_step"]) for r in doc["accuracy"]]
    return _md(rows, [("compressor", "compressor"), ("test_acc", "test accuracy %"),
                      ("acc_delta_pts", "vs dense (points)"), ("wire", "bytes/step"),
                      ("reduction", "reduction x"), ("wall_s", "train s")])


def _bubble_md(doc: dict[str, Any]) -> str:
    rows = []
    for net, scheds in doc["timelines"].items():
        for sched, stages in scheds.items():
            for st in stages:
                rows.append({"net": net, "schedule": sched, "stage": st["stage"],
                             "chunks": st["chunks"], "step_ms": 1e3 * st["step_s"],
                             "bubble": st["bubble"]})
    return _md(rows, [("net", "link"), ("schedule", "schedule"), ("stage", "stage"),
                      ("chunks", "micro-batches"), ("step_ms", "step ms"),
                      ("bubble", "idle fraction")])


def render(doc: dict[str, Any]) -> str:
    """The whole ``report.md``."""
    cfg = doc["config"]
    w = doc["model_widths"]
    parts = [f"# parlay bench{' --quick' if doc['quick'] else ''}",
             f"MLP {'-'.join(map(str, w))}, batch {_batch(doc)} per rank, {cfg['steps']} timed "
             f"steps per point (budget {cfg['budget']:g} s); links: {', '.join(doc['nets'])}; "
             f"wall {doc['wall_s']:.0f} s; {doc['env']['cores']} cores, load {_load(doc)}.",
             *(f"> {n}" for n in doc["notes"]),
             "## Cost model vs measurement", "\n".join(_summary_lines(doc)),
             "## Samples/s as a fraction of the compute-only limit",
             "Limit: the same launch's ranks stepping with communication skipped.",
             limit_table(doc)]
    for net in doc["nets"]:
        parts += [f"## {net}: measured and predicted", points_table(doc, net)]
    if doc["timelines"]:
        parts += ["## Pipeline bubbles (2 stages x 1 replica)", _bubble_md(doc)]
    if doc["accuracy"]:
        parts += ["## MNIST accuracy vs bytes per step", "784-800-800-10 MLP on 2 ranks, the "
                  "compression benchmark's settings.", _accuracy_md(doc)]
    if doc["plots"]:
        parts += ["## Plots", *(f"![{p}]({p})" for p in doc["plots"])]
    return "\n\n".join(parts) + "\n"


def _batch(doc: dict[str, Any]) -> int:
    dp = [p for p in doc["points"] if p["mode"] == "compute"]
    return round(dp[0]["batch"]) if dp else 0


def _load(doc: dict[str, Any]) -> str:
    la = doc["env"].get("load_average")
    return "/".join(f"{v:.1f}" for v in la) if la else "?"


def console(doc: dict[str, Any]) -> str:
    """A plain-text summary for the terminal."""
    rows = [{"net": p["net"], "launch": p["launch"], "contestant": p["contestant"],
             "samples_s": p["samples_s"], "of_limit": p["of_limit"],
             "step_ms": 1e3 * p["step_s"],
             "pred_ms": 1e3 * p["predicted_step_s"] if p.get("predicted_step_s") else None,
             "err": _pct(p.get("rel_err"))} for p in doc["points"]]
    out = [table(rows, ["net", "launch", "contestant", "samples_s", "of_limit", "step_ms",
                        "pred_ms", "err"]), ""]
    out += [line.lstrip("- ") for line in _summary_lines(doc)]
    out += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(out)
