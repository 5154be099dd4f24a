"""Local updates (DiLoCo) on slow links: compute utilisation and NIC bytes on simulated hosts.

Every host of a :class:`~tools.cluster.Cluster` runs :func:`main` under ``parlay run``. On each
rank, in one process group:

* ``diloco``: :class:`parlay.DiLoCoOptimizer` over a plain SGD step; one warm-up round of
  ``H`` steps (every fragment sent and merged once), then ``rounds`` full rounds, the host's
  ``eth0`` byte counters read around them.
* ``compute``: the limit, the same SGD step without communication, ``compute_steps`` of them
  interleaved with the timed rounds once every ``H/P`` steps, at a step after which no
  exchange is in flight (so none progresses meanwhile): both see the same minutes of the
  machine's drifting load. Each stretch of either runs between barriers over a group of their
  own (a barrier on the default group would queue behind the exchange in flight: gloo runs
  it after the work before it), all ranks at once; seconds per step are wall seconds over
  steps, barriers included, alike for both.
* ``ddp`` (``ddp_steps`` > 0): torch DDP, one warm-up step, then that many steps between
  barriers with the NIC counters around them.

    python -m tools.cluster.diloco_bench --spec JSON --out PREFIX   # under parlay run, each host
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.cluster import spec_run

__all__ = ["launch", "main", "run"]

_NIC = "/sys/class/net/eth0/statistics"


def _nic() -> dict[str, int]:
    return {k: int(Path(f"{_NIC}/{k}_bytes").read_text()) for k in ("tx", "rx")}


def _window(step: Callable[[], None], n: int, barrier: Callable[[], None]) -> dict[str, Any]:
    """``n`` steps between barriers: wall seconds per step and NIC bytes per step."""
    barrier()
    before, t0 = _nic(), time.perf_counter()
    for _ in range(n):
        step()
    barrier()
    dt, after = time.perf_counter() - t0, _nic()
    return {"step_s": dt / n, "steps": n, **{f"nic_{k}": (after[k] - before[k]) / n
                                             for k in after}}


def _profile(opt: Any) -> dict[str, float]:
    """Seconds the main thread spends starting exchanges (``_send``: pseudo-gradient,
    compression), merging them (``_merge``) and, inside the merge, waiting for the wire
    (``Handle.wait``): instance wrappers, nothing in the optimizer changed."""
    from parlay import comm

    prof = {"send_s": 0.0, "merge_s": 0.0, "wait_s": 0.0}

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                prof[key] += time.perf_counter() - t0
        return wrapper
    opt._send, opt._merge = timed(opt._send, "send_s"), timed(opt._merge, "merge_s")
    comm.Handle.wait = timed(comm.Handle.wait, "wait_s")  # type: ignore[method-assign]
    return prof


def _interleaved(dstep: Callable[[], None], cstep: Callable[[], None], opt: Any, n: int,
                 c: int, barrier: Callable[[], None]) -> list[dict[str, Any]]:
    """``n`` DiLoCo steps and, once every ``H/P`` of them at a step after which no exchange is
    in flight (so none progresses meanwhile), ``c`` compute-only steps: each stretch between
    barriers, so both see the same minutes of the machine's drifting load. Rows of both."""
    t = {"diloco": 0.0, "compute": 0.0}
    every, seen, nc = opt.sync_every // len(opt.fragments), -1, 0
    barrier()
    before, mark = _nic(), time.perf_counter()
    for i in range(n):
        dstep()
        if i // every != seen and all(f.flight is None for f in opt.fragments):
            barrier()
            now = time.perf_counter()
            t["diloco"] += now - mark
            for _ in range(c):
                cstep()
            barrier()
            mark = time.perf_counter()
            t["compute"] += mark - now
            seen, nc = i // every, nc + c
    barrier()
    t["diloco"] += time.perf_counter() - mark
    after = _nic()
    return [dict(contestant="diloco", step_s=t["diloco"] / n, steps=n,
                 **{f"nic_{k}": (after[k] - before[k]) / n for k in after}),
            dict(contestant="compute", step_s=t["compute"] / max(nc, 1), steps=nc,
                 nic_tx=0, nic_rx=0)]


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's rows (inside a process group)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import parlay
    from parlay import comm
    from parlay.local import DiLoCoOptimizer
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
    # A fresh model: every rank builds the same one (same seed), so the start-up broadcast of
    # rank 0's weights is skipped, as the DDP rows skip theirs (init_sync=False): 147 MB from
    # rank 0 to 3 hosts takes 35 s at 100 Mbit/s and 6 min at 10 Mbit/s.
    model = mlp(widths)
    real, comm.broadcast = comm.broadcast, lambda *a, **k: None
    try:
        opt = DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              model.named_parameters(), sync_every=int(spec["H"]),
                              fragments=int(spec["P"]), overlap=int(spec["tau"]),
                              compression=spec["compression"])
    finally:
        comm.broadcast = real
    dstep = stepper(model, opt)
    prof = _profile(opt)
    for _ in range(int(spec["H"])):  # the warm-up round
        dstep()
    stats0 = opt.comm_stats()
    prof.update(dict.fromkeys(prof, 0.0))
    rows = _interleaved(dstep, compute, opt, int(spec["H"]) * int(spec["rounds"]),
                        int(spec["compute_steps"]), barrier)
    stats1 = opt.comm_stats()
    n = rows[0]["steps"]
    rows[0].update(wire_bytes=(stats1["wire_bytes"] - stats0["wire_bytes"]) / n,
                   dense_bytes=(stats1["dense_bytes"] - stats0["dense_bytes"]) / n,
                   **{k: v / n for k, v in prof.items()})
    opt.sync_now()  # nothing left in flight
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
    return spec_run.launch("tools.cluster.diloco_bench", spec, hosts, rate, timeout,
                           measure_link=True)


def main(argv: list[str] | None = None) -> None:
    """One rank under ``parlay run`` on a simulated host: rows go to PREFIX.rankN.json."""
    spec_run.rank_main(run, "DiLoCo", 900, argv)


if __name__ == "__main__":
    main()
