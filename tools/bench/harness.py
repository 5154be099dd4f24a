"""The one benchmark harness: models, interleaved timing, tables and the JSON document.

``parlay bench`` (this package) and the scripts in ``benchmarks/`` (one per claim) share it.
Every side-by-side comparison is timed interleaved step by step (:func:`rounds`,
:func:`time_interleaved`): round ``i`` takes one step of every contestant, in an order drawn
afresh from seed ``i`` (the same on every rank), each step between barriers. The load of other
processes on a shared machine drifts by 10% and more within a minute, so contestants timed one
after the other compared each one's minute as much as its speed; interleaved, every contestant
sees the same minutes. A benchmark prints a table and, with ``--json PATH``, writes one
document whose ``ratios`` hold each parlay-vs-anchor ratio by name and ``results`` the raw rows
(:func:`write_json`).
"""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

__all__ = ["MODELS", "mlp", "model_params", "table", "median", "fmt", "round_order", "rounds",
           "slowest", "time_interleaved", "env_info", "write_json"]

# name -> (layer widths, per-rank batch). "suite" is sized so a dense step on a 100 Mbit/s
# link takes about one second: every point fits the quick budget and the link still dominates.
# "small" and "big" are benchmarks/dp_throughput.py's; "wide", "wide-quick" benchmarks/cluster.py's.
MODELS: dict[str, tuple[list[int], int]] = {
    "small": ([784, 800, 800, 10], 500),
    "big": ([784, 4096, 4096, 4096, 10], 64),
    "wide": ([784, 4096, 4096, 10], 8),
    "wide-quick": ([784, 2048, 2048, 10], 8),
    "suite": ([784, 1024, 1024, 1024, 10], 64),
    "tiny": ([784, 256, 10], 16),
}


def mlp(widths: Sequence[int]) -> Any:
    """The benchmark MLP (Linear+ReLU, no final ReLU), seeded so every rank builds the same."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def model_params(widths: Sequence[int]) -> int:
    """Parameter count of :func:`mlp` with these widths."""
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def median(xs: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return float(statistics.median(xs)) if xs else float("nan")


def fmt(v: Any) -> str:
    """A number as a table cell: 4 significant digits, no exponent for large values."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """A plain-text table of ``rows`` restricted to ``cols``."""
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def round_order(names: Sequence[str], i: int) -> list[str]:
    """The order of round ``i``: ``names`` shuffled from seed ``i`` (the same on every rank,
    and no contestant always follows the same one)."""
    out = list(names)
    random.Random(i).shuffle(out)
    return out


def rounds(counts: Mapping[str, int]) -> Iterator[tuple[int, str]]:
    """The interleaved schedule: ``(round, contestant)`` pairs, round ``i`` taking one step of
    every contestant with more than ``i`` steps, in :func:`round_order`."""
    for i in range(max(counts.values(), default=0)):
        for name in round_order([name for name, n in counts.items() if n > i], i):
            yield i, name


def slowest(times: Sequence[float]) -> list[float]:
    """Elementwise maximum over the ranks (every rank calls it with as many values): a step
    between barriers lasts until its slowest rank is done."""
    import torch

    from parlay import comm

    t = torch.tensor(list(times), dtype=torch.float64)
    comm.allreduce(t, "max")
    return [float(v) for v in t.tolist()]


def time_interleaved(steps: Mapping[str, Callable[[], Any]],
                     n: int) -> list[dict[str, float]]:
    """Time ``n`` rounds of one step of every contestant (see :func:`rounds`), each step
    between barriers. Call it on every rank of the group together.

    Args:
        steps: Contestant name -> one step (a no-op where a rank sits a contestant out).
        n: Rounds.

    Returns:
        One row per round: ``{name: wall seconds, name + "_cpu": this process's CPU
        seconds}``; wall seconds are the slowest rank's (the same rows on every rank).
    """
    from parlay import comm

    rows: list[dict[str, float]] = [{} for _ in range(n)]
    comm.barrier()
    for i, name in rounds({k: n for k in steps}):
        t0, c0 = time.perf_counter(), time.process_time()
        steps[name]()
        rows[i][name] = time.perf_counter() - t0
        rows[i][name + "_cpu"] = time.process_time() - c0
        comm.barrier()
    keys = [(i, k) for i in range(n) for k in steps]
    for (i, k), v in zip(keys, slowest([rows[i][k] for i, k in keys])):
        rows[i][k] = v
    return rows


def env_info() -> dict[str, Any]:
    """Where a benchmark ran: versions, machine, cores, load and time."""
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "machine": platform.machine(), "cores": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(path: str | None, name: str, ratios: dict[str, float],
               results: list[dict[str, Any]], **extra: Any) -> None:
    """Write a benchmark's JSON document (``ratios`` and raw ``results``) to ``path``, if any."""
    if not path:
        return
    doc = {"benchmark": name, "ratios": ratios, "results": results, "env": env_info(), **extra}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
