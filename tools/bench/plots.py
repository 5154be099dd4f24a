"""PNG plots of a ``parlay bench`` results document (matplotlib, an optional extra).

* ``samples_per_s.png``: samples/s of every contestant on every link, as a fraction of the
  compute-only limit;
* ``accuracy_vs_bytes.png``: MNIST test accuracy vs gradient bytes per step, per compressor;
* ``pipeline_timeline.png``: one step of each pipeline schedule, per stage: compute (forward,
  backward, loss) and idle (the bubble);
* ``predicted_vs_measured.png``: the cost model's step time against the measured one.
"""
from __future__ import annotations

import os
from typing import Any

from tools.bench.report import label

__all__ = ["write_all", "INSTALL_HINT"]

INSTALL_HINT = ('matplotlib is not installed: plots skipped (results.json and report.md are '
                'written). Install it with: pip install "parlay[bench]" (or pip install '
                'matplotlib)')
_NET_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
_PHASES = {"F": ("forward", "#4c72b0"), "B": ("backward", "#dd8452"), "L": ("loss", "#55a868")}


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def write_all(doc: dict[str, Any], out: str) -> tuple[list[str], str | None]:
    """Write every plot the document has data for into ``out``.

    Returns:
        (file names written, a note for the user or ``None``).
    """
    plt = _plt()
    if plt is None:
        return [], INSTALL_HINT
    written = []
    for name, fn in (("samples_per_s.png", _throughput), ("accuracy_vs_bytes.png", _accuracy),
                     ("pipeline_timeline.png", _timeline),
                     ("predicted_vs_measured.png", _predicted)):
        fig = fn(plt, doc)
        if fig is None:
            continue
        fig.savefig(os.path.join(out, name), dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)
    return written, None


def _throughput(plt: Any, doc: dict[str, Any]) -> Any:
    pts = [p for p in doc["points"] if p["contestant"] != "compute"]
    if not pts:
        return None
    nets = doc["nets"]
    keys = list(dict.fromkeys((p["launch"], p["contestant"]) for p in pts))
    by = {(p["net"], p["launch"], p["contestant"]): p for p in pts}
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(keys) * max(1, len(nets)) ** 0.5 + 3),
                                    5.2))
    width = 0.8 / len(nets)
    for k, net in enumerate(nets):
        xs, ys = [], []
        for i, key in enumerate(keys):
            p = by.get((net, *key))
            if p is not None:
                xs.append(i + (k - (len(nets) - 1) / 2) * width)
                ys.append(p["of_limit"])
        ax.bar(xs, ys, width, label=net, color=_NET_COLORS[k % len(_NET_COLORS)])
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="compute-only limit")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{label(n)}\n[{launch}]" for launch, n in keys], rotation=60,
                       ha="right", fontsize=8)
    ax.set_ylabel("samples/s ÷ compute-only samples/s (fraction)")
    ax.set_xlabel("contestant [launch: dp = 2 ranks, ps = 2 workers + 2 servers, "
                  "hier = 2 hosts x 2 ranks]", fontsize=8)
    ax.set_title("Training throughput as a fraction of the compute-only limit, per link")
    ax.set_ylim(0, max(1.1, max(p["of_limit"] for p in pts) * 1.1))
    ax.legend(title="link", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _accuracy(plt: Any, doc: dict[str, Any]) -> Any:
    rows = doc["accuracy"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = "osD^v<>phX*"
    for i, r in enumerate(rows):
        ax.scatter(r["wire_bytes_per_step"] / 1e6, r["test_acc"], s=60,
                   marker=markers[i % len(markers)],
                   label=f"{r['compressor']} ({r['reduction']:.0f}x fewer bytes)"
                   if r["reduction"] >= 1.5 else f"{r['compressor']} (dense bytes)")
    ax.set_xscale("log")
    ax.set_xlabel("gradient bytes sent per step per rank (MB, log scale)")
    ax.set_ylabel("MNIST test accuracy (%)")
    n = rows[0].get("steps", "?")
    ax.set_title(f"Accuracy vs bytes per step per compressor (784-800-800-10 MLP, 2 ranks, "
                 f"{n} steps)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3, which="both")
    return fig


def _timeline(plt: Any, doc: dict[str, Any]) -> Any:
    panels = [(net, sched, stages) for net, scheds in doc["timelines"].items()
              for sched, stages in scheds.items() if stages]
    if not panels:
        return None
    cols = len({s for _, s, _ in panels})
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 1.1 + 1.3 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (net, sched, stages) in zip(axes.flat, panels):
        span = max(max((e[2] for e in st["events"]), default=0.0) for st in stages)
        for st in stages:
            y = st["stage"]
            ax.broken_barh([(0, 1e3 * span)], (y - 0.4, 0.8), color="#dddddd")
            for kind in _PHASES:
                bars = [(1e3 * e[1], 1e3 * (e[2] - e[1])) for e in st["events"] if e[0] == kind]
                ax.broken_barh(bars, (y - 0.4, 0.8), color=_PHASES[kind][1])
        bubble = sum(st["bubble"] for st in stages) / len(stages)
        ax.set_title(f"{net}, {sched} ({stages[0]['chunks']} micro-batches): idle "
                     f"{100 * bubble:.0f}%", fontsize=9)
        ax.set_yticks([st["stage"] for st in stages])
        ax.set_yticklabels([f"stage {st['stage']}" for st in stages])
        ax.set_xlabel("time since the step started (ms)", fontsize=8)
        ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in _PHASES.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#dddddd"))
    fig.legend(handles, [n for n, _ in _PHASES.values()] + ["idle (bubble, transfers)"],
               loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=8)
    fig.suptitle("Pipeline timeline per stage: one training step (2 stages x 1 replica)")
    fig.tight_layout()
    return fig


def _predicted(plt: Any, doc: dict[str, Any]) -> Any:
    pts = [p for p in doc["points"] if p.get("predicted_step_s")]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 6))
    modes = sorted({p["mode"] for p in pts})
    markers = dict(zip(modes, "osD^v"))
    for k, net in enumerate(doc["nets"]):
        for mode in modes:
            sel = [p for p in pts if p["net"] == net and p["mode"] == mode]
            if sel:
                ax.scatter([1e3 * p["step_s"] for p in sel],
                           [1e3 * p["predicted_step_s"] for p in sel], s=40,
                           marker=markers[mode], color=_NET_COLORS[k % len(_NET_COLORS)],
                           label=f"{net}, {mode}", alpha=0.85)
    lo = 1e3 * min(min(p["step_s"], p["predicted_step_s"]) for p in pts) / 1.5
    hi = 1e3 * max(max(p["step_s"], p["predicted_step_s"]) for p in pts) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray",
                    alpha=0.2, label="±10%")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="gray",
                    alpha=0.08, label="±25%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms, log scale)")
    ax.set_ylabel("predicted step time (ms, log scale)")
    s = doc["summary"]
    ax.set_title(f"Cost model vs measurement: median error {100 * s['median_rel_err']:.1f}%, "
                 f"largest {100 * s['max_rel_err']:.1f}%", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    return fig
