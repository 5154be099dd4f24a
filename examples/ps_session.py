"""Parameter-server training with DistributedSession: the same script runs on every rank.

    parlay run -n 3 --ps 1 examples/ps_session.py                      # 1 PS + 2 workers, sync
    parlay run -n 4 --ps 2 examples/ps_session.py --consistency async  # 2 PS (sharded) + 2 workers
    parlay run -n 3 --ps 1 examples/ps_session.py --consistency stale:2 --compression fp16

Parameter-server ranks hold the parameters and the optimizer state and serve inside
``should_stop()``; workers compute gradients on their own shard of a synthetic classification
problem and keep no optimizer state.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import parlay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--consistency", default="sync", help="sync | async | stale:S")
    ap.add_argument("--compression", default=None, help="e.g. fp16, bf16, topk:0.1")
    ap.add_argument("--steps", type=int, default=200, help="parameter updates (global step)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    spec = parlay.TaskSpec.from_env()
    torch.manual_seed(0)  # servers take their initial values from this model
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    teacher = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(100 + spec.index)  # each worker its own samples

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(args.batch, 20, generator=data)
        return x, (x @ teacher).argmax(1)

    with parlay.DistributedSession(task_spec=spec, model=model, optimizer=torch.optim.SGD,
                                   optimizer_args={"lr": args.lr, "momentum": 0.9},
                                   consistency=args.consistency, compression=args.compression,
                                   max_steps=args.steps) as sess:
        while not sess.should_stop():  # on parameter servers: serves, then returns True
            loss = sess.train_step(batch(), nn.functional.cross_entropy)
            if spec.is_chief and sess.step % 50 == 0:
                print(f"worker 0: step {sess.step}, global step {sess.global_step}, "
                      f"loss {loss:.4f}", flush=True)
    if spec.is_ps:
        print(f"ps {spec.index}: {sess.global_step} updates applied; staleness histogram "
              f"{sess.staleness_histogram()}; lost workers {sess.lost_workers() or 'none'}",
              flush=True)
    else:
        x, y = batch()
        acc = (model(x).argmax(1) == y).float().mean().item()
        print(f"worker {spec.index}: {sess.step} steps, accuracy on a fresh batch {acc:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
