"""Helpers shared by the benchmarks: medians, tables (from parlay.bench) and the JSON document."""
from __future__ import annotations

import json
import platform
import sys
import time
from typing import Any

import torch

# One table, median and MLP for the scripts here and for `parlay bench` (which ships in the
# package).
from parlay.bench.common import median, mlp, table

__all__ = ["median", "mlp", "table", "write_json"]


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
