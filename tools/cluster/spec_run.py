"""Run one per-rank script on simulated hosts and collect its rows (the shape every row set of
``benchmarks/cluster.py`` and ``benchmarks/diloco_tta.py`` shares).

A script module defines ``run(spec) -> rows``; :func:`launch` starts it under ``parlay run`` on
``hosts`` network-namespace hosts of one rank each, and :func:`rank_main` is its entry point
on every rank (rows go to ``PREFIX.rankN.json``, gathered and removed by :func:`launch`).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["launch", "rank_main"]

ROOT = Path(__file__).resolve().parents[2]


def launch(module: str, spec: dict[str, Any], hosts: int, rate: str | None, timeout: float,
           measure_link: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows of every rank, the cluster's report)``; with ``measure_link`` the report also
    holds the goodput of one link (``link_mbit_s``).

    Raises:
        RuntimeError: A rank wrote no rows (its output and error tail are in the message).
    """
    import parlay
    from tools.cluster import Cluster

    src = str(Path(parlay.__file__).resolve().parents[1])
    out = tempfile.mktemp(prefix=f"parlay-{module.rsplit('.', 1)[-1]}-")
    with Cluster(hosts=hosts, rate=rate) as c:
        link = c.measure(1, 0, seconds=1.0) / 1e6 if measure_link else None
        procs = c.parlay_run(["-m", module, "--spec", json.dumps(spec), "--out", out],
                             env={"PYTHONPATH": os.pathsep.join([src, str(ROOT)])},
                             stdout=-1, stderr=-1, text=True)
        errs = [(p.communicate(timeout=timeout), p.returncode) for p in procs]
        info = dict(c.report(), **({"link_mbit_s": link} if measure_link else {}))
    files = sorted(Path(out).parent.glob(Path(out).name + ".rank*.json"))
    rows = [r for f in files for r in json.loads(f.read_text())]
    for f in files:
        f.unlink()
    if len(files) < hosts:
        bad = next(((o, e) for (o, e), rc in errs if rc), ("", "no output"))
        raise RuntimeError(f"{module} launch failed:\n{bad[0][-2000:]}\n{bad[1][-3000:]}")
    return rows, info


def rank_main(run: Callable[[dict[str, Any]], list[dict[str, Any]]], what: str,
              timeout: float, argv: list[str] | None = None) -> None:
    """One rank under ``parlay run`` on a simulated host: ``run(--spec)``'s rows to
    ``--out``.rankN.json."""
    import parlay

    ap = argparse.ArgumentParser(description=f"one rank of the {what} cluster launch")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args(argv)
    parlay.init(timeout=timeout)
    try:
        rows = run(json.loads(ns.spec))
        Path(f"{ns.out}.rank{parlay.rank()}.json").write_text(json.dumps(rows))
    finally:
        parlay.shutdown()
