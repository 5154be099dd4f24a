"""Local updates (DiLoCo) on slow links: compute utilisation and NIC bytes on simulated hosts.

Every host of a :class:`~tools.cluster.Cluster` runs :func:`main` under ``parlay run``. On each
rank, in one process group and in this order:

* ``compute``: ``compute_steps`` plain inner steps (the same SGD step, no communication), all
  ranks at once, timed as a window between barriers (wall seconds over steps): the limit.
* ``diloco``: :class:`parlay.DiLoCoOptimizer` over the same step; one warm-up round of
  ``sync_every`` steps (every fragment sent and merged once), then ``rounds`` full rounds timed
  as one window between barriers, with the host's ``eth0`` byte counters read around it.
  The window's barriers go over a group of their own: the default group's would queue behind
  the exchange still in flight (gloo runs a barrier after the work before it), so the window
  holds as much in-flight exchange at its end as it inherited at its start (steady state).
* ``compute`` again (the limit is the mean of both windows: the machine's load drifts).
* ``ddp`` (optional, ``ddp_steps`` > 0): torch DDP, one warm-up step, then that many steps with
  the NIC counters around them.

    python -m tools.cluster.diloco_bench --spec JSON --out PREFIX   # under parlay run, each host
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["launch", "main", "run"]

_NIC = "/sys/class/net/eth0/statistics"


def _nic() -> dict[str, int]:
    return {k: int(Path(f"{_NIC}/{k}_bytes").read_text()) for k in ("tx", "rx")}


def _window(step: Callable[[], None], n: int, barrier: Callable[[], None]) -> dict[str, float]:
    """``n`` steps between barriers: wall seconds per step and NIC bytes per step."""
    barrier()
    before, t0 = _nic(), time.perf_counter()
    for _ in range(n):
        step()
    barrier()
    dt, after = time.perf_counter() - t0, _nic()
    return {"step_s": dt / n, "steps": n, **{f"nic_{k}": (after[k] - before[k]) / n
                                             for k in after}}


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's rows (inside a process group)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import parlay
    from parlay import comm
    from tools.bench.harness import MODELS, mlp

    torch.set_num_threads(1)
    widths, batch = MODELS[spec["model"]]
    g = torch.Generator().manual_seed(1 + parlay.rank())
    x = torch.randn(batch, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (batch,), generator=g)
    timing = dist.new_group(backend="gloo")  # the windows' barriers only
    barrier = lambda: comm.barrier(timing)  # noqa: E731
    loss_fn = nn.CrossEntropyLoss()

    def stepper(model: Any, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return step

    model = mlp(widths)
    compute = stepper(model, torch.optim.SGD(model.parameters(), lr=0.01))
    compute()
    n_c = int(spec["compute_steps"])
    rows = [dict(contestant="compute", when="before", **_window(compute, n_c, barrier))]
    opt = parlay.DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                 model.named_parameters(), sync_every=int(spec["H"]),
                                 fragments=int(spec["P"]), overlap=int(spec["tau"]),
                                 compression=spec["compression"])
    dstep = stepper(model, opt)
    for _ in range(int(spec["H"])):  # the warm-up round
        dstep()
    stats0 = opt.comm_stats()
    row = _window(dstep, int(spec["H"]) * int(spec["rounds"]), barrier)
    stats1 = opt.comm_stats()
    row.update(contestant="diloco", wire_bytes=(stats1["wire_bytes"] - stats0["wire_bytes"])
               / row["steps"], dense_bytes=(stats1["dense_bytes"] - stats0["dense_bytes"])
               / row["steps"])
    rows.append(row)
    opt.sync_now()  # nothing left in flight
    rows.append(dict(contestant="compute", when="after", **_window(compute, n_c, barrier)))
    del opt, dstep
    if int(spec.get("ddp_steps", 0)):
        ddp = nn.parallel.DistributedDataParallel(mlp(widths), init_sync=False)
        step = stepper(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
        step()
        rows.append(dict(contestant="ddp", **_window(step, int(spec["ddp_steps"]), barrier)))
    for r in rows:
        r.update(host=parlay.runtime.cluster().node_rank, world=parlay.size(), batch=batch)
    return rows


def launch(spec: dict[str, Any], hosts: int = 4, rate: str | None = None,
           timeout: float = 1800.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``spec`` on ``hosts`` simulated hosts of one rank each, links at ``rate``;
    ``(rows, cluster report with the measured link goodput)``."""
    import parlay
    from tools.cluster import Cluster

    src = str(Path(parlay.__file__).resolve().parents[1])
    root = str(Path(__file__).resolve().parents[2])
    out = tempfile.mktemp(prefix="parlay-diloco-")
    with Cluster(hosts=hosts, rate=rate) as c:
        link = c.measure(1, 0, seconds=1.0) / 1e6
        procs = c.parlay_run(["-m", "tools.cluster.diloco_bench", "--spec", json.dumps(spec),
                              "--out", out], env={"PYTHONPATH": os.pathsep.join([src, root])},
                             stdout=-1, stderr=-1, text=True)
        errs = [(p.communicate(timeout=timeout), p.returncode) for p in procs]
        info = dict(c.report(), link_mbit_s=link)
    files = sorted(Path(out).parent.glob(Path(out).name + ".rank*.json"))
    rows = [r for f in files for r in json.loads(f.read_text())]
    for f in files:
        f.unlink()
    if len(files) < hosts:
        bad = next(((o, e) for (o, e), rc in errs if rc), ("", "no output"))
        raise RuntimeError(f"diloco launch failed:\n{bad[0][-2000:]}\n{bad[1][-3000:]}")
    return rows, info


def main(argv: list[str] | None = None) -> None:
    """One rank under ``parlay run`` on a simulated host: rows go to PREFIX.rankN.json."""
    import parlay

    ap = argparse.ArgumentParser(description="one rank of the DiLoCo cluster launch")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args(argv)
    parlay.init(timeout=900)
    try:
        rows = run(json.loads(ns.spec))
        Path(f"{ns.out}.rank{parlay.rank()}.json").write_text(json.dumps(rows))
    finally:
        parlay.shutdown()


if __name__ == "__main__":
    main()
