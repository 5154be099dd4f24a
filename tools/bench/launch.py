"""The orchestrator side: start one launch of :mod:`tools.bench.worker` and gather its rows.

On loopback the ranks come from :func:`parlay.testing.run_world` (real gloo ranks on
127.0.0.1, started in well under a second each). On a simulated link they come from
:class:`tools.cluster.Cluster`: ``parlay run --nnodes H`` on every host, exactly as a
user would start them on real nodes, each rank writing its rows to a JSON file.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tools.bench.harness import MODELS, model_params

__all__ = ["launch_loopback", "launch_cluster", "per_host", "model_bytes"]


def launch_loopback(spec: dict[str, Any], nproc: int, num_ps: int = 0,
                    timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Run ``spec`` on ``nproc`` local ranks (the first ``num_ps`` of them parameter servers).

    Returns:
        Every rank's rows.
    """
    from parlay.testing import run_world
    from tools.bench.worker import run_spec

    env = {"PARLAY_NUM_PS": str(num_ps)} if num_ps else {}
    out = run_world(run_spec, nproc, spec, timeout=timeout, comm_timeout=600, env=env)
    return [row for rows in out for row in rows]


def launch_cluster(spec: dict[str, Any], hosts: int, rate: str | None, nproc: int = 1,
                   flags: tuple[str, ...] = (), calibrate: bool = False,
                   timeout: float = 1800.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``spec`` on ``hosts`` simulated hosts of ``nproc`` ranks each, links at ``rate``.

    Args:
        spec: The worker spec (see :mod:`tools.bench.worker`).
        hosts: Hosts (network namespaces), each on its own shaped link to one switch.
        rate: tc rate of every link (``"100mbit"``), ``None`` for unshaped.
        nproc: Ranks per host.
        flags: Extra ``parlay run`` flags (``("--ps", "2")``).
        calibrate: Also measure one link's TCP goodput (Mbit/s in the returned info).
        timeout: Seconds each host's launch may take.

    Returns:
        ``(rows of every rank, the cluster's report plus link_mbit_s)``.

    Raises:
        RuntimeError: A host's launch failed before every rank wrote its rows (its output
            included). A failure after that (at exit) is kept in the info's ``exit_errors``.
    """
    import parlay
    from tools.cluster import Cluster

    # The hosts import this parlay and these tools (the checkout's root holds tools/).
    src = str(Path(parlay.__file__).resolve().parents[1])
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([src, root, *filter(None, [os.environ.get("PYTHONPATH")])])
    out = tempfile.mktemp(prefix="parlay-bench-")
    with Cluster(hosts=hosts, rate=rate) as c:
        link = c.measure(1, 0, seconds=1.0) / 1e6 if calibrate else None
        procs = c.parlay_run(["-m", "tools.bench.worker", "--spec", json.dumps(spec),
                              "--out", out], nproc_per_host=nproc, flags=flags,
                             env={"PYTHONPATH": path}, stdout=-1, stderr=-1, text=True)
        failed = []
        for k, p in enumerate(procs):
            o, e = p.communicate(timeout=timeout)
            if p.returncode:
                failed.append(f"host {k} failed ({p.returncode}):\n{o[-2000:]}\n{e[-3000:]}")
        info = dict(c.report(), link_mbit_s=link)
    rows: list[dict[str, Any]] = []
    files = sorted(Path(out).parent.glob(Path(out).name + ".rank*.json"))
    for f in files:
        rows += json.loads(f.read_text())
        f.unlink()
    if failed and len(files) < hosts * nproc:
        raise RuntimeError(failed[0])
    if failed:  # every rank wrote its rows: the measurement stands, the exit is reported
        info["exit_errors"] = [f.strip().splitlines()[-1] for f in failed]
    return rows, info


def model_bytes(model: str) -> int:
    """fp32 gradient bytes of a named benchmark model."""
    return 4 * model_params(MODELS[model][0])


def per_host(rows: list[dict[str, Any]], name: str, model_bytes: int = 0) -> dict[str, Any]:
    """One contestant over every rank: median step time and samples/s; per-host NIC bytes
    (local ranks share a host link) next to what the algorithm should send."""
    mine = [r for r in rows if r["contestant"] == name]
    hosts: dict[int, dict[str, Any]] = {}
    for r in mine:
        hosts.setdefault(r["host"], r)  # every rank of a host reads the same counters
    out = dict(contestant=name, step_s=statistics.median(r["step_s"] for r in mine),
               samples_s=statistics.median(r["samples_s"] for r in mine),
               nic_tx_MB=statistics.mean(h["nic_tx"] for h in hosts.values()) / 1e6,
               steps=mine[0].get("steps", "-"))
    if "wire_bytes" not in mine[0] and model_bytes:
        # No comm_stats (DDP, parameter server): what the algorithm must send, from theory.
        n = len(mine)
        ps = name.startswith("ps")
        out["expected_MB"] = (model_bytes if ps else 2 * (n - 1) / n * model_bytes) / 1e6
        out["nic/expected"] = out["nic_tx_MB"] / out["expected_MB"]
    if "wire_bytes" in mine[0]:
        per = len(mine) // len(hosts)
        wire = statistics.mean(r["wire_bytes"] for r in mine)
        n = len(mine)
        cross = statistics.mean(r["cross_host_bytes"] for r in mine)
        # What a rank sends: a ring allreduce (or ring allgather) of n ranks sends 2(n-1)/n
        # (or (n-1)/n x n) of the payload; with several ranks per host only the ring's
        # host-crossing edges use the link (1 per host); hierarchical counts its own.
        if cross:
            expect = cross * per
        elif name.startswith("topk"):
            expect = wire * (n - 1) / per
        else:
            expect = 2 * (n - 1) / n * wire
        out["wire_MB"] = wire / 1e6
        out["expected_MB"] = expect / 1e6
        out["nic/expected"] = out["nic_tx_MB"] / out["expected_MB"] if expect else float("nan")
    return out
