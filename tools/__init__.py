"""Maintainer tooling, not shipped in the wheel: the ``parlay bench`` suite (:mod:`tools.bench`,
also the harness of ``benchmarks/``) and the simulated cluster (:mod:`tools.cluster`).

Importable from a checkout with the repository root on ``sys.path`` (``benchmarks/_common.py``
and ``tests/conftest.py`` put it there; ``parlay bench`` does so from a checkout).
"""
