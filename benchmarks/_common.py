"""Helpers shared by the benchmarks: timing, medians, tables and the JSON document."""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from typing import Any, Sequence

import torch


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """A plain-text table of ``rows`` restricted to ``cols``."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def write_json(path: str | None, name: str, ratios: dict[str, float],
               results: list[dict[str, Any]], **extra: Any) -> None:
    """Write the benchmark's JSON document (``ratios`` and raw ``results``)."""
    if not path:
        return
    doc = {"benchmark": name, "ratios": ratios, "results": results,
           "env": {"python": sys.version.split()[0], "torch": torch.__version__,
                   "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
           **extra}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
