"""Parameter server with a straggler: worker throughput and final loss of sync, stale:2, async.

One parameter server and two workers (gloo, one thread each) train softmax regression (a convex
problem) on MNIST with SGD. Each step of worker 0 is ``--compute-ms`` of simulated work (a
sleep, so the 2 shared cores stay free) plus the real step (forward, backward, push, pull).
Worker 1 is the straggler: it sleeps so that its whole step takes three times as long as it
would unslowed (the measured fast/slow speed ratio is printed). Every run stops at the
same total number of worker steps (``sync``: ``max_steps = total / 2`` rounds of two; the others
``max_steps = total`` single-push updates, which may overshoot by the one push already in
flight). The final loss is the server's model on the whole training subset.

Runs alternate between the three modes, rotating the order each round, so machine noise hits all
of them alike; ratios are medians over rounds of per-round ratios (anchor: ``sync``).

    python benchmarks/ps_straggler.py [--quick] [--json out.json] [--data DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, table, write_json  # noqa: E402

from parlay.ps import DistributedSession, max_lead  # noqa: E402
from parlay.testing import run_world  # noqa: E402

MODES = ("sync", "stale:2", "async")
SLOW = 1  # worker index of the straggler
FACTOR = 3.0  # the straggler's compute per step, relative to the fast worker's


def _load_data(root: str | None, n: int, path: str) -> str:
    """Save ``n`` training images (flattened, normalised) and labels to ``path``; MNIST when
    available, else Gaussian class blobs of the same shape (said so in the output)."""
    try:
        from parlay.data import mnist

        ds = mnist(root, train=True, download=False)
        x, y, source = ds.images[:n].reshape(n, -1).clone(), ds.labels[:n].clone(), "MNIST"
    except Exception as e:  # noqa: BLE001 - any failure falls back to synthetic data
        print(f"MNIST not available ({e}); using synthetic Gaussian blobs instead")
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (n,), generator=g)
        centers = torch.randn(10, 784, generator=g)
        x = centers[y] + 2.0 * torch.randn(n, 784, generator=g)
        source = "synthetic"
    torch.save({"x": x, "y": y, "source": source}, path)
    return source


def _rank(mode: str, total: int, path: str, compute_s: float, batch: int, lr: float) -> dict:
    data = torch.load(path, weights_only=True)
    x, y = data["x"], data["y"]
    torch.manual_seed(0)
    model = nn.Linear(784, 10)
    loss_fn = nn.functional.cross_entropy
    max_steps = total // 2 if mode == "sync" else total
    with DistributedSession(model=model, optimizer=torch.optim.SGD, optimizer_args={"lr": lr},
                            consistency=mode, max_steps=max_steps) as sess:
        if not sess.is_worker:
            sess.should_stop()
            with torch.no_grad():
                loss = float(loss_fn(model(x), y))
            log = sess.update_log()
            return {"role": "ps", "loss": loss, "hist": sess.staleness_histogram(),
                    "applied": len(log), "lead": max_lead(log), "version": sess.global_step}
        w = sess.worker_index
        g = torch.Generator().manual_seed(100 + w)
        shard = torch.arange(w, len(x), 2)
        # The fast worker's step: compute_s of simulated work, then train_step (forward,
        # backward, push, pull). The straggler sleeps FACTOR * compute_s plus (FACTOR - 1) times
        # its own recent train_step time, so its whole step takes FACTOR times as long. (It is
        # the slowest, so its train_step never includes waiting for the other worker.)
        recent: collections.deque[float] = collections.deque([0.0], maxlen=5)
        steps = 0
        start = time.monotonic()
        while not sess.should_stop():
            idx = shard[torch.randint(len(shard), (batch,), generator=g)]
            extra = compute_s if w != SLOW else FACTOR * compute_s + (FACTOR - 1) * median(recent)
            time.sleep(extra)
            t0 = time.monotonic()
            sess.train_step((x[idx], y[idx]), loss_fn)
            recent.append(min(time.monotonic() - t0, 0.1))
            steps += 1
        return {"role": "worker", "w": w, "steps": steps, "start": start,
                "end": time.monotonic()}


def _one(mode: str, args: argparse.Namespace, path: str) -> dict:
    out = run_world(_rank, 3, mode, args.steps, path, args.compute_ms / 1e3, args.batch,
                    args.lr, env={"PARLAY_NUM_PS": "1"}, timeout=600)
    ps, workers = out[0], out[1:]
    wall = max(r["end"] for r in workers) - min(r["start"] for r in workers)
    per = {r["w"]: r["steps"] for r in workers}
    return {"mode": mode, "worker_steps": sum(per.values()), "fast_steps": per[1 - SLOW],
            "slow_steps": per[SLOW], "wall_s": wall, "steps_per_s": sum(per.values()) / wall,
            "final_loss": ps["loss"], "updates": ps["version"],
            "max_staleness": max(ps["hist"]) if ps["hist"] else 0, "max_lead": ps["lead"],
            "hist": ps["hist"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 180 steps (< 2 min)")
    ap.add_argument("--json", default=None, help="write the JSON document here")
    ap.add_argument("--data", default=os.environ.get("PARLAY_DATA_DIR"),
                    help="MNIST folder (default: PARLAY_DATA_DIR)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="total worker steps per run")
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="simulated compute per fast-worker step (ms)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--samples", type=int, default=12_000)
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (180 if args.quick else 600)
    args.compute_ms = args.compute_ms if args.compute_ms is not None else 20.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.pt")
        source = _load_data(args.data, args.samples, path)
        print(f"ps_straggler: 1 PS + 2 workers, softmax regression on {source} "
              f"({args.samples} samples), batch {args.batch}/worker, SGD lr {args.lr}, "
              f"{args.steps} worker steps per run, fast worker {args.compute_ms:g} ms simulated "
              f"+ real step, straggler x{FACTOR:g}; {args.rounds} rounds")
        rows: list[dict] = []
        for rnd in range(args.rounds):
            order = MODES[rnd % 3:] + MODES[: rnd % 3]
            for mode in order:
                row = _one(mode, args, path)
                row["round"] = rnd
                rows.append(row)
                print(f"  round {rnd} {mode:>7}: {row['steps_per_s']:.1f} worker-steps/s, "
                      f"loss {row['final_loss']:.4f}", flush=True)
    cols = ["round", "mode", "steps_per_s", "worker_steps", "fast_steps", "slow_steps",
            "updates", "final_loss", "max_staleness", "max_lead", "wall_s"]
    print(table(rows, cols))
    by = collections.defaultdict(dict)
    for r in rows:
        by[r["round"]][r["mode"]] = r
    ratios = {}
    for mode, tag in (("async", "async"), ("stale:2", "stale2")):
        ratios[f"{tag}_vs_sync_steps_per_s"] = median(
            [by[k][mode]["steps_per_s"] / by[k]["sync"]["steps_per_s"] for k in by])
        ratios[f"{tag}_vs_sync_final_loss"] = median(
            [by[k][mode]["final_loss"] / by[k]["sync"]["final_loss"] for k in by])
    print("\nstaleness histograms (all rounds; staleness = updates applied between a worker's "
          "read and the apply of its gradient):")
    for mode in MODES:
        h: collections.Counter[int] = collections.Counter()
        for r in rows:
            if r["mode"] == mode:
                h.update(r["hist"])
        print(f"  {mode:>7}: " + ", ".join(f"{k}: {v}" for k, v in sorted(h.items())))
    speed = median([r["fast_steps"] / max(r["slow_steps"], 1) for r in rows
                    if r["mode"] == "async"])
    print(f"\nmeasured speed ratio fast/slow worker (async, free-running): {speed:.2f}")
    print(f"median ratios over {args.rounds} rounds (anchor: sync):")
    for k, v in ratios.items():
        print(f"  {k:>30}: {v:.3f}")
    spread = [by[k]["async"]["final_loss"] / by[k]["sync"]["final_loss"] for k in sorted(by)]
    print("async/sync final loss, per round: " + ", ".join(f"{v:.3f}" for v in spread))
    ok_speed = ratios["async_vs_sync_steps_per_s"] >= 1.5
    ok_loss = ratios["async_vs_sync_final_loss"] <= 1.10
    print(f"target async >= 1.5x sync steps/s: {'met' if ok_speed else 'NOT met'}; "
          f"async final loss within 10% of sync: {'met' if ok_loss else 'NOT met'}")
    write_json(args.json, "ps_straggler", ratios,
               [{k: v for k, v in r.items() if k != "hist"} | {"hist": {str(a): b for a, b in
                                                                          r["hist"].items()}}
                for r in rows], config=vars(args), data=source, speed_ratio=speed)


if __name__ == "__main__":
    main()
