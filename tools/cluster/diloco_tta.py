"""Time to accuracy on simulated hosts: MNIST's MLP trained by each contestant in turn.

Every host of a :class:`~tools.cluster.Cluster` runs :func:`main` under ``parlay run``. On each
rank, in one process group, the contestants train one after the other (the machine's cores are
few: never two at once), each from the same seed with the demo's recipe
(:data:`parlay.demos.mnist.DEFAULTS`: Adam 1e-3 per replica scaled by the replicas after a
one-epoch warm-up, cosine decay, batch 128 per replica, 4 epochs):

* ``{"name": "ddp", "kind": "ddp"}``: plain torch ``DistributedDataParallel`` with the same
  recipe (``benchmarks/time_to_accuracy.py``'s anchor script).
* ``{"name": ..., "mode": ..., "compression": ..., "options": {...}}``: :class:`parlay.Trainer`
  in that mode; ``mode="diloco"`` starts from the demo's recipe
  (:data:`parlay.demos.mnist.DILOCO`) and ``options`` override it.

The clock runs from building the contestant (set-up and start-up broadcast included) through
its training steps, each stretch between barriers on the default group (so an exchange in
flight is finished inside the clock, never during evaluation); every ``eval_every`` steps and
at the end the full test set is evaluated outside the clock. A contestant stops after its
``epochs``, or at its first evaluation past ``cap_s`` seconds of clock (rank 0's decision).
Each row holds the curve ``[steps, samples, seconds, accuracy]`` and the host's ``eth0`` bytes.

    python -m tools.cluster.diloco_tta --spec JSON --out PREFIX   # under parlay run, each host
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from tools.cluster import spec_run

__all__ = ["launch", "main", "run"]

_NIC = "/sys/class/net/eth0/statistics"
_ROOT = Path(__file__).resolve().parents[2]


def _tx() -> int:
    return int(Path(f"{_NIC}/tx_bytes").read_text())


class _Trainer:
    """A parlay contestant: the demo's Trainer configuration in ``mode``."""

    def __init__(self, c: dict[str, Any], train: Any, test: Any) -> None:
        import torch

        from parlay.demos.mnist import DEFAULTS, DILOCO, build_mlp
        from parlay.trainer import Trainer

        opts = {**(DILOCO if c["mode"] == "diloco" else {}), **c.get("options", {})}
        self.trainer = Trainer(
            build_mlp, train, optimizer=torch.optim.Adam, optimizer_args={"lr": DEFAULTS["lr"]},
            batch_size=DEFAULTS["batch_size"], num_epochs=DEFAULTS["epochs"], mode=c["mode"],
            compression=c.get("compression"), warmup_epochs=DEFAULTS["warmup_epochs"],
            lr_schedule=DEFAULTS["lr_schedule"], seed=DEFAULTS["seed"],
            validation_dataset=test, validation_batch_size=1000, progress=False,
            strategy_options=opts)
        self.total = self.trainer.total_steps

    def step(self) -> None:
        self.trainer.train_on_batch()

    def accuracy(self) -> float:
        return float(self.trainer.validate()["accuracy"])

    def close(self) -> None:
        self.trainer.close()


def _ddp(train: Any, test: Any) -> Any:
    sys.path.insert(0, str(_ROOT / "benchmarks"))
    from time_to_accuracy import _DDP  # type: ignore[import-not-found]  # its anchor

    d = _DDP(train, test)
    d.close = lambda: None
    return d


def _contest(c: dict[str, Any], spec: dict[str, Any], train: Any, test: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    every, cap, target = int(spec["eval_every"]), float(spec["cap_s"]), float(spec["target"])
    world = dist.get_world_size()
    dist.barrier()
    tx0, t0 = _tx(), time.perf_counter()
    side = _ddp(train, test) if c.get("kind") == "ddp" else _Trainer(c, train, test)
    dist.barrier()
    clock = setup = time.perf_counter() - t0
    row: dict[str, Any] = dict(c, setup_s=setup, curve=[], seconds_to_target=None,
                               steps_to_target=None, steps=0, stopped="epochs")
    while row["steps"] < side.total:
        n = min(every - row["steps"] % every, side.total - row["steps"])
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            side.step()
        dist.barrier()
        clock += time.perf_counter() - t0
        row["steps"] += n
        acc = side.accuracy()  # outside the clock
        samples = row["steps"] * 128 * world
        row["curve"].append([row["steps"], samples, clock, acc])
        if acc >= target and row["seconds_to_target"] is None:
            row.update(seconds_to_target=clock, steps_to_target=row["steps"],
                       samples_to_target=samples)
        over = torch.tensor([float(clock > cap)])
        dist.broadcast(over, 0)  # one decision for all ranks
        if over.item() and row["steps"] < side.total:
            row["stopped"] = f"cap {cap:.0f} s"
            break
    side.close()
    row.update(train_s=clock, final_accuracy=row["curve"][-1][3], total_steps=side.total,
               nic_tx_bytes=_tx() - tx0, host=int(os.environ.get("GROUP_RANK", "0")))
    return row


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's rows, one per contestant (inside a process group)."""
    import torch

    import parlay

    torch.set_num_threads(1)
    train = parlay.data.mnist(spec.get("data"), train=True)
    test = parlay.data.mnist(spec.get("data"), train=False)
    # One-time imports before any clock starts (the first torch.optim optimizer imports
    # torch._dynamo: seconds on a loaded machine).
    import parlay.strategies.allreduce  # noqa: F401
    import parlay.strategies.diloco  # noqa: F401

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    return [_contest(c, spec, train, test) for c in spec["contestants"]]


def launch(spec: dict[str, Any], hosts: int = 4, rate: str | None = "100mbit",
           timeout: float = 3600.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``spec`` on ``hosts`` simulated hosts of one rank each, links at ``rate``;
    ``(rows of every rank, cluster report with the measured link goodput)``."""
    return spec_run.launch("tools.cluster.diloco_tta", spec, hosts, rate, timeout,
                           measure_link=True)


def main(argv: list[str] | None = None) -> None:
    """One rank under ``parlay run`` on a simulated host: rows go to PREFIX.rankN.json."""
    spec_run.rank_main(run, "time-to-accuracy", 900, argv)


if __name__ == "__main__":
    main()
