"""The benchmarks' harness: the one in ``tools/bench/harness.py``, shared with ``parlay bench``.

Each script here does ``sys.path.insert(0, <this folder>)`` and imports from this module, which
puts the repository root on ``sys.path`` (``tools/`` is not shipped in the wheel) and re-exports
the harness: the benchmark MLP, interleaved step-by-step timing, tables and the JSON document.
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tools.bench.harness import (MODELS, env_info, median, mlp, round_order,  # noqa: E402
                                 rounds, table, time_interleaved, write_json)

__all__ = ["MODELS", "env_info", "median", "mlp", "round_order", "rounds", "table",
           "time_interleaved", "write_json"]
