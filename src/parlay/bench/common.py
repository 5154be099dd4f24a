"""Pieces every part of the benchmark suite shares: models, tables, numbers."""
from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["MODELS", "mlp", "model_params", "table", "median", "fmt"]

# name -> (layer widths, per-rank batch). "suite" is sized so a dense step on a 100 Mbit/s
# link takes about one second (2.9M parameters, 11.7 MB of gradients): every point fits the
# quick budget and the link still dominates. The others are benchmarks/cluster.py's.
MODELS: dict[str, tuple[list[int], int]] = {
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
