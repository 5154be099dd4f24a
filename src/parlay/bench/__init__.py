"""``parlay bench``: the benchmark suite that ships with parlay.

* :mod:`parlay.bench.worker`: the rank side (contestants timed side by side in one group);
* :mod:`parlay.bench.launch`: one launch on loopback or on a simulated cluster;
* :mod:`parlay.bench.runner`: the suite, per link, and ``results.json``;
* :mod:`parlay.bench.predict`: the cost model's prediction next to every point;
* :mod:`parlay.bench.accuracy`: MNIST accuracy vs bytes per step per compressor;
* :mod:`parlay.bench.report`, :mod:`parlay.bench.plots`: ``report.md`` and PNG plots.

``benchmarks/cluster.py`` and ``benchmarks/compression.py`` use the same pieces.
"""
from parlay.bench.runner import main, run_suite

__all__ = ["main", "run_suite"]
