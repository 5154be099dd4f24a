"""Each compressor's convergence factor on real MNIST: steps to the accuracy target vs dense.

Trains the 784-800-800-10 MLP on 2 gloo ranks with each compressor side by side (the training
core of ``benchmarks/compression.py``: same data order, initialisation and SGD, a constant
learning rate) and takes the test accuracy after every 25 steps; each curve is smoothed over
100 steps (one evaluation swings by a few tenths of a point). The target is dense's final
accuracy less ``--tolerance`` points (the compression benchmark's accuracy target). A
compressor's factor is the median, over accuracy levels every 0.25 points from the target down
2.5 points, of the steps it took to first reach the level over the steps dense took (one level
alone moves the factor by +-15%). A compressor that never reached the target has none
(``null``): ``parlay plan`` never recommends it.
``--write`` stores the factors where ``parlay plan`` reads them (``Compressor.convergence``).

    python benchmarks/convergence.py [--quick] [--json out.json] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table, write_json  # noqa: E402

from parlay.testing import run_world  # noqa: E402
from tools.bench.accuracy import split_specs, train_compressors  # noqa: E402

# parlay plan's default compressors and auto's candidates
ALL = "none,fp16,bf16,topk:0.01,topk:0.01,compact=1,randomk:0.01,powersgd:4"
TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "src", "parlay", "plan", "convergence.json")


def first_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    """Steps trained when ``curve`` (``[(steps, accuracy)]``) first reached ``target``."""
    return next((s for s, acc in curve if acc >= target), None)


def smoothed(curve: list[tuple[int, float]], k: int = 4) -> list[tuple[int, float]]:
    """Each point's accuracy averaged with the ``k - 1`` before it."""
    return [(s, statistics.fmean(a for _, a in curve[max(0, i - k + 1): i + 1]))
            for i, (s, _) in enumerate(curve)]


def factor(curve: list[tuple[int, float]], dense: list[tuple[int, float]],
           target: float) -> float | None:
    """Median over levels from ``target`` down 2.5 points of the steps to each level relative
    to dense's; ``None`` when ``curve`` never reached ``target``."""
    if first_reaching(curve, target) is None:
        return None
    levels = [target - 0.25 * i for i in range(10)]
    return statistics.median(first_reaching(curve, lv) / first_reaching(dense, lv)
                             for lv in levels)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.environ.get("PARLAY_DATA_DIR"),
                    help="MNIST folder (default: $PARLAY_DATA_DIR, else parlay's own copy)")
    ap.add_argument("--quick", action="store_true", help="1 epoch on 12k samples (smoke test)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--compressors", default=ALL, help="default %(default)s")
    ap.add_argument("--tolerance", type=float, default=0.3,
                    help="accuracy points below dense's final accuracy that count as reached")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--json", help="write the JSON document here")
    ap.add_argument("--write", action="store_true", help=f"store the factors in {TABLE}")
    args = ap.parse_args(argv)
    names = split_specs(args.compressors)
    names = names if "none" in names else ["none", *names]
    epochs = 1 if args.quick else args.epochs
    cfg = {"data": args.data, "compressors": names, "epochs": epochs, "batch": 64, "lr": args.lr,
           "momentum": 0.9, "weight_decay": 0.0, "train_samples": 12000 if args.quick else 0,
           "chunk": 25, "decay_epoch": epochs, "curve": True}  # decay_epoch=epochs: constant lr
    t0 = time.perf_counter()
    rows = run_world(train_compressors, 2, cfg, timeout=7200, comm_timeout=600)[0]
    dense = smoothed(next(r for r in rows if r["compressor"] == "none")["curve"])
    target = dense[-1][1] - args.tolerance
    for r in rows:
        curve = smoothed(r["curve"])
        r["steps_to_target"] = first_reaching(curve, target)
        r["best_acc"] = max(acc for _, acc in curve)
        r["factor"] = None if r["diverged"] else factor(curve, dense, target)
    print(f"MNIST 784-800-800-10 MLP, 2 ranks, {epochs} epoch(s), SGD lr {args.lr} momentum 0.9 "
          f"(constant), batch 64 per rank; target {target:.2f}% (dense's final - "
          f"{args.tolerance} points, over 100 steps); {time.perf_counter() - t0:.0f} s")
    print(table(rows, ["compressor", "test_acc", "best_acc", "steps_to_target", "factor"]))
    ratios = {f"{r['compressor']}/convergence": r["factor"] for r in rows}
    write_json(args.json, "convergence", ratios, rows,
               config={**cfg, "data": str(args.data), "target": target})
    if args.write:
        doc = {"about": "steps to the accuracy target as a multiple of dense's; null: never "
                        "reached it (benchmarks/convergence.py; docs/benchmarks.md)",
               "target": f"{target:.2f}% MNIST test accuracy, dense's final less "
                         f"{args.tolerance} points after {epochs} epochs",
               "date": time.strftime("%Y-%m-%d"),
               "factors": {r["compressor"]: r["factor"] and round(r["factor"], 3)
                           for r in rows},
               "best_accuracy": {r["compressor"]: round(r["best_acc"], 2) for r in rows}}
        with open(TABLE, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
