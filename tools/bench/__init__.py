"""``parlay bench``: the benchmark suite that ships with parlay.

* :mod:`tools.bench.worker`: the rank side (contestants timed side by side in one group);
* :mod:`tools.bench.launch`: one launch on loopback or on a simulated cluster;
* :mod:`tools.bench.runner`: the suite, per link, and ``results.json``;
* :mod:`tools.bench.predict`: the cost model's prediction next to every point;
* :mod:`tools.bench.accuracy`: MNIST accuracy vs bytes per step per compressor;
* :mod:`tools.bench.report`, :mod:`tools.bench.plots`: ``report.md`` and PNG plots.

``benchmarks/cluster.py`` and ``benchmarks/compression.py`` use the same pieces.
"""
from tools.bench.runner import main, run_suite

__all__ = ["main", "run_suite"]
