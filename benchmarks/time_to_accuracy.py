"""Time to 98% MNIST test accuracy: ``parlay demo mnist``'s configuration vs plain PyTorch DDP.

Both sides train the 784-800-800-10 MLP on 2 processes (gloo, 1 thread each) with the same
recipe: Adam, learning rate 1e-3 x 2 replicas reached by a one-epoch linear warm-up, cosine
decay over 4 epochs, batch 128 per process, seed 0. The data order is identical too
(``ShardedSampler`` draws the same permutation as ``DistributedSampler`` for a seed), so both
cross the target at (almost) the same step and the ratio measures speed.

* parlay: ``parlay.Trainer`` with the demo's defaults (``parlay.demos.mnist.DEFAULTS``).
* anchor: the DDP script a PyTorch user writes: ``DistributedDataParallel``, a
  ``DistributedSampler`` + ``DataLoader(batch_size=128)``, ``LambdaLR`` for the same schedule.

Both trainings live in the same two processes and take turns step by step (``--chunk`` 1: each
round one step of each side, in a fresh order the same on both ranks, the shared harness's
``round_order``), each with its own clock, so load from other processes on a shared machine
hits both alike (whole runs one after the other differed by up to 2x here).
Every ``--eval-every`` steps the test accuracy is measured on the full test set; evaluation is
excluded from the clock, set-up (model, optimizer, broadcast) included. The ratio is parlay /
DDP time to target (median over ``--repeats`` runs; < 1 means parlay is faster).

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import round_order, write_json  # noqa: E402

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


class _Parlay:
    """parlay's side: the demo's Trainer configuration."""

    def __init__(self, train, test) -> None:
        import torch

        import parlay
        from parlay.demos.mnist import DEFAULTS, build_mlp

        self.trainer = parlay.Trainer(
            build_mlp, train, optimizer=torch.optim.Adam, optimizer_args={"lr": DEFAULTS["lr"]},
            batch_size=DEFAULTS["batch_size"], num_epochs=DEFAULTS["epochs"],
            warmup_epochs=DEFAULTS["warmup_epochs"], lr_schedule=DEFAULTS["lr_schedule"],
            seed=DEFAULTS["seed"], validation_dataset=test, validation_batch_size=1000,
            progress=False)
        self.total = self.trainer.total_steps

    def step(self) -> None:
        self.trainer.train_on_batch()

    def accuracy(self) -> float:
        return self.trainer.validate()["accuracy"]


class _DDP:
    """The anchor: a plain PyTorch DDP script with the same recipe."""

    def __init__(self, train, test) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler

        from parlay.demos.mnist import build_mlp

        world = dist.get_world_size()
        torch.manual_seed(0)
        self.model, self.loss_fn = build_mlp()
        self.ddp = DDP(self.model)
        self.opt = torch.optim.Adam(self.ddp.parameters(), lr=LR * world)
        self.sampler = DistributedSampler(train, seed=0)
        self.loader = DataLoader(train, batch_size=BATCH, sampler=self.sampler)
        spe = len(self.loader)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _factor(s, world, spe))
        self.total = EPOCHS * spe
        self.test = test
        self._batches = self._stream()

    def _stream(self):
        for epoch in range(EPOCHS):
            self.sampler.set_epoch(epoch)
            yield from self.loader

    def step(self) -> None:
        x, y = next(self._batches)
        self.opt.zero_grad()
        self.loss_fn(self.ddp(x), y).backward()
        self.opt.step()
        self.sched.step()

    def accuracy(self) -> float:
        return _accuracy_ddp(self.model, self.test)


def worker(data: str | None, target: float, eval_every: int, chunk: int, out: str) -> None:
    """One rank (started by torchrun): both trainings in this process, alternating chunks of
    ``chunk`` steps, each timed by its own clock; test accuracy every ``eval_every`` steps
    (evaluation excluded from the clock)."""
    import torch
    import torch.distributed as dist

    import parlay

    torch.set_num_threads(1)
    parlay.init()
    train, test = parlay.data.mnist(data, train=True), parlay.data.mnist(data, train=False)
    # One-time imports are paid before either clock starts: the first torch.optim optimizer of a
    # process imports torch._dynamo (seconds on a loaded machine), which would otherwise be
    # charged to whichever side is built first.
    import parlay.strategies.allreduce  # noqa: F401
    import parlay.trainer  # noqa: F401

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    sides = {}
    for name, cls in (("parlay", _Parlay), ("ddp", _DDP)):
        dist.barrier()
        t0 = time.perf_counter()
        sides[name] = cls(train, test)
        sides[name + "_setup"] = time.perf_counter() - t0
    rows = {k: {"kind": k, "seconds_to_target": None, "steps_to_target": None, "train_seconds":
                sides[k + "_setup"], "setup_seconds": sides[k + "_setup"], "eval_seconds": 0.0,
                "steps": 0, "final_accuracy": 0.0}
            for k in ("parlay", "ddp")}
    rnd = 0
    while any(r["seconds_to_target"] is None and r["steps"] < sides[k].total
              for k, r in rows.items()):
        order = round_order(["parlay", "ddp"], rnd)
        rnd += 1
        for k in order:
            r, side = rows[k], sides[k]
            if r["seconds_to_target"] is not None or r["steps"] >= side.total:
                continue
            to_eval = eval_every - r["steps"] % eval_every
            n = min(chunk, to_eval, side.total - r["steps"])
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                side.step()
            dist.barrier()
            r["train_seconds"] += time.perf_counter() - t0
            r["steps"] += n
            if r["steps"] % eval_every and r["steps"] < side.total:
                continue
            t0 = time.perf_counter()
            r["final_accuracy"] = side.accuracy()
            r["eval_seconds"] += time.perf_counter() - t0
            if r["final_accuracy"] >= target:
                r["seconds_to_target"], r["steps_to_target"] = r["train_seconds"], r["steps"]
    sides["parlay"].trainer.close()
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump([rows["parlay"], rows["ddp"]], f)
    dist.barrier()
    parlay.shutdown()


def _launch(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", os.path.abspath(__file__), "--worker",
               "--target", str(args.target), "--eval-every", str(args.eval_every),
               "--chunk", str(args.chunk), "--out", out]
        if args.data:
            cmd += ["--data", args.data]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"benchmark run failed (exit {proc.returncode})")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.environ.get("PARLAY_DATA_DIR"),
                   help="folder with the MNIST .gz files (default: PARLAY_DATA_DIR)")
    p.add_argument("--target", type=float, default=0.98)
    p.add_argument("--eval-every", type=int, default=59, help="steps (a quarter epoch)")
    p.add_argument("--chunk", type=int, default=1,
                   help="steps per turn when interleaving the two trainings (1: step by step)")
    p.add_argument("--repeats", type=int, default=3, help="runs (each alternates both sides)")
    p.add_argument("--quick", action="store_true", help="one run")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.data, args.target, args.eval_every, args.chunk, args.out)
        return
    repeats = 1 if args.quick else args.repeats
    rows: list[dict] = []
    for i in range(repeats):
        for row in _launch(args):
            row["pair"] = i
            rows.append(row)
            kind = row["kind"]
            print(f"run {i} {kind:>6}: " + (f"{row['seconds_to_target']:.1f} s to "
                  f"{args.target:.0%} at step {row['steps_to_target']}" if row["seconds_to_target"]
                  else f"did not reach {args.target:.0%}") +
                  f" (accuracy {row['final_accuracy']:.4f}, {row['steps']} steps in "
                  f"{row['train_seconds']:.1f} s = {1000 * row['train_seconds'] / row['steps']:.1f}"
                  f" ms/step, set-up {row['setup_seconds']:.1f} s,"
                  f" eval {row['eval_seconds']:.1f} s)",
                  flush=True)
    pairs = repeats
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
    print(f"ratio parlay/DDP (median of runs): {ratio:.3f}  (< 1: parlay faster)")
    write_json(args.json, "time_to_accuracy", {"time_to_target": ratio}, rows,
               target=args.target, chunk=args.chunk)


if __name__ == "__main__":
    main()
