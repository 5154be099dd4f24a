"""Time to 98% MNIST test accuracy: ``parlay demo mnist``'s configuration vs plain PyTorch DDP.

Both sides train the 784-800-800-10 MLP on 2 processes (gloo, 1 thread each) with the same
recipe: Adam, learning rate 1e-3 x 2 replicas reached by a one-epoch linear warm-up, cosine
decay over 4 epochs, batch 128 per process, seed 0. The data order is identical too
(``ShardedSampler`` draws the same permutation as ``DistributedSampler`` for a seed), so both
cross the target at (almost) the same step and the ratio measures speed.

* parlay: ``parlay.Trainer`` with the demo's defaults (``parlay.demos.mnist.DEFAULTS``).
* anchor: the DDP script a PyTorch user writes: ``DistributedDataParallel``, a
  ``DistributedSampler`` + ``DataLoader(batch_size=128)``, ``LambdaLR`` for the same schedule.

Test accuracy is measured every ``--eval-every`` steps on the full test set; evaluation time is
excluded from the clock on both sides. Runs alternate (parlay, DDP, DDP, parlay, ...) so load
from other processes on the machine hits both alike. The ratio is parlay / DDP time to target
(median over pairs; < 1 means parlay is faster).

    python benchmarks/time_to_accuracy.py --data ../shared/data/mnist [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

EPOCHS, BATCH, LR, WARMUP = 4, 128, 1e-3, 1.0


def _factor(step: int, world: int, steps_per_epoch: int) -> float:
    """The demo's schedule as a multiplier of the scaled rate (for the DDP side)."""
    warm = round(WARMUP * steps_per_epoch)
    total = EPOCHS * steps_per_epoch
    if step < warm:
        return (1.0 + (world - 1.0) * step / warm) / world
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def _accuracy_ddp(model, test) -> float:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = test.images[rank::world], test.labels[rank::world]
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                      for i in range(0, len(x), 1000))
    model.train()
    t = torch.tensor([correct, len(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def worker(kind: str, data: str | None, target: float, eval_every: int, out: str) -> None:
    """One rank of one run (started by torchrun)."""
    import torch
    import torch.distributed as dist

    import parlay
    from parlay.demos.mnist import DEFAULTS, build_mlp

    torch.set_num_threads(1)
    parlay.init()
    world, rank = parlay.size(), parlay.rank()
    train, test = parlay.data.mnist(data, train=True), parlay.data.mnist(data, train=False)
    train_s = eval_s = 0.0
    hit = None
    step = 0
    acc = 0.0
    tick = time.perf_counter()
    if kind == "parlay":
        trainer = parlay.Trainer(
            build_mlp, train, optimizer=torch.optim.Adam, optimizer_args={"lr": DEFAULTS["lr"]},
            batch_size=DEFAULTS["batch_size"], num_epochs=DEFAULTS["epochs"],
            warmup_epochs=DEFAULTS["warmup_epochs"], lr_schedule=DEFAULTS["lr_schedule"],
            seed=DEFAULTS["seed"], validation_dataset=test, validation_batch_size=1000,
            progress=False)
        while not trainer.should_stop():
            trainer.train_on_batch()
            step = trainer.state.step
            if step % eval_every == 0 or step == trainer.total_steps:
                train_s += time.perf_counter() - tick
                t0 = time.perf_counter()
                acc = trainer.validate()["accuracy"]
                eval_s += time.perf_counter() - t0
                tick = time.perf_counter()
                if acc >= target:
                    hit = (train_s, step)
                    break
        trainer.close()
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler

        torch.manual_seed(0)
        model, loss_fn = build_mlp()
        ddp = DDP(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=LR * world)
        sampler = DistributedSampler(train, seed=0)
        loader = DataLoader(train, batch_size=BATCH, sampler=sampler)
        spe = len(loader)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _factor(s, world, spe))
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
                sched.step()
                step += 1
                if step % eval_every == 0 or step == EPOCHS * spe:
                    train_s += time.perf_counter() - tick
                    t0 = time.perf_counter()
                    acc = _accuracy_ddp(model, test)
                    eval_s += time.perf_counter() - t0
                    tick = time.perf_counter()
                    if acc >= target:
                        hit = (train_s, step)
                        break
            if hit:
                break
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"kind": kind, "seconds_to_target": hit[0] if hit else None,
                       "steps_to_target": hit[1] if hit else None, "final_accuracy": acc,
                       "train_seconds": train_s, "eval_seconds": eval_s, "steps": step}, f)
    dist.barrier()
    parlay.shutdown()


def _launch(kind: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", os.path.abspath(__file__), "--worker", kind,
               "--target", str(args.target), "--eval-every", str(args.eval_every), "--out", out]
        if args.data:
            cmd += ["--data", args.data]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"{kind} run failed (exit {proc.returncode})")
        with open(out, encoding="utf-8") as f:
            row = json.load(f)
    row["wall_seconds"] = wall
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.environ.get("PARLAY_DATA_DIR"),
                   help="folder with the MNIST .gz files (default: PARLAY_DATA_DIR)")
    p.add_argument("--target", type=float, default=0.98)
    p.add_argument("--eval-every", type=int, default=59, help="steps (a quarter epoch)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one pair")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.data, args.target, args.eval_every, args.out)
        return
    pairs = 1 if args.quick else args.pairs
    rows: list[dict] = []
    for i in range(pairs):
        order = ["parlay", "ddp"] if i % 2 == 0 else ["ddp", "parlay"]
        for kind in order:
            row = _launch(kind, args)
            row["pair"] = i
            rows.append(row)
            print(f"pair {i} {kind:>6}: " + (f"{row['seconds_to_target']:.1f} s to "
                  f"{args.target:.0%} at step {row['steps_to_target']}" if row["seconds_to_target"]
                  else f"did not reach {args.target:.0%}") +
                  f" (final acc {row['final_accuracy']:.4f}, train {row['train_seconds']:.1f} s,"
                  f" eval {row['eval_seconds']:.1f} s, wall {row['wall_seconds']:.1f} s)", flush=True)
    ratios = []
    for i in range(pairs):
        a = next(r for r in rows if r["pair"] == i and r["kind"] == "parlay")
        b = next(r for r in rows if r["pair"] == i and r["kind"] == "ddp")
        if a["seconds_to_target"] and b["seconds_to_target"]:
            ratios.append(a["seconds_to_target"] / b["seconds_to_target"])
    med = {k: statistics.median([r["seconds_to_target"] for r in rows
                                 if r["kind"] == k and r["seconds_to_target"]] or [math.nan])
           for k in ("parlay", "ddp")}
    ratio = statistics.median(ratios) if ratios else math.nan
    print(f"\n{'':>8} | time to {args.target:.0%} (median s)")
    print(f"{'parlay':>8} | {med['parlay']:.1f}")
    print(f"{'DDP':>8} | {med['ddp']:.1f}")
    print(f"ratio parlay/DDP (median of pairs): {ratio:.3f}  (< 1: parlay faster)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "time_to_accuracy", "target": args.target,
                       "ratios": {"time_to_target": ratio}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
