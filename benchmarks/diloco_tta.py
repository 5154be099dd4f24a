"""Time to 98% MNIST test accuracy on a simulated cluster: DDP, ``compression="auto"`` and
``mode="diloco"``, 4 hosts x 1 rank on 100 Mbit/s links (issue 27's "time to accuracy").

One launch of :mod:`tools.cluster.diloco_tta` on a fresh :class:`tools.cluster.Cluster`
(needs root); the contestants train one after the other in the same process group, each with
the demo's recipe (the 784-800-800-10 MLP, Adam 1e-3 x 4 replicas after a one-epoch warm-up,
cosine decay, batch 128 per replica, 4 epochs, seed 0):

* ``ddp``: plain torch DistributedDataParallel (the anchor).
* ``auto``: ``parlay.Trainer`` in mode ``"allreduce"`` with ``compression="auto"``.
* ``compute-only``: the limit, mode ``"diloco"`` whose round outlasts the run (no exchange).
* ``diloco-*``: mode ``"diloco"`` with the demo's recipe (``sync_every=8``, outer SGD lr 1
  without momentum) with fp16 or int8 pseudo-gradients, and variants (``--diloco``).

Test accuracy every ``--eval-every`` steps (32: about a quarter epoch, a multiple of every
round length tried, so each evaluation sees freshly synced weights) outside the clock. Time to
target is the clock (set-up included) at the first evaluation at or above ``--target``;
final accuracy is at 4 epochs (equal samples), unless a contestant hit ``--cap`` seconds first.
The diloco row compared is the fastest variant that reaches the target.

    PARLAY_DATA_DIR=../shared/data/mnist python benchmarks/diloco_tta.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table, write_json  # noqa: E402

from tools.cluster.diloco_tta import launch  # noqa: E402

# name: (strategy_options, compression of the pseudo-gradients)
DILOCO = {"diloco-h8": ({"sync_every": 8}, "fp16"),
          "diloco-h16": ({"sync_every": 16}, "fp16"),
          "diloco-h32": ({"sync_every": 32}, "fp16"),
          "diloco-h8-p2-o1": ({"sync_every": 8, "fragments": 2, "overlap": 1}, "fp16"),
          "diloco-h8-int8": ({"sync_every": 8}, "int8"),
          "diloco-h8-int8-o4": ({"sync_every": 8, "overlap": 4}, "int8"),
          "diloco-h8-int8-o7": ({"sync_every": 8, "overlap": 7}, "int8"),
          "diloco-h8-p2-int8-o3": ({"sync_every": 8, "fragments": 2, "overlap": 3}, "int8"),
          "diloco-h16-int8-o8": ({"sync_every": 16, "overlap": 8}, "int8")}

# The compute-only limit: the same inner steps that never sync within the run (its accuracy is
# the start's): the seconds per step no contestant can beat at equal steps.
COMPUTE = {"name": "compute-only", "mode": "diloco", "options": {"sync_every": 100_000}}


def _merge(rows: list[dict]) -> list[dict]:
    """One row per contestant: the ranks agree on accuracy; seconds are the ranks' maximum."""
    out = []
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        r = dict(mine[0])
        for k in ("seconds_to_target", "train_s", "setup_s"):
            vals = [m[k] for m in mine]
            r[k] = None if None in vals else max(vals)
        r["nic_tx_MB_per_host"] = statistics.mean(m["nic_tx_bytes"] for m in mine) / 1e6
        r["ms_per_step"] = 1000 * (r["train_s"] - r["setup_s"]) / r["steps"]
        r["accuracy_%"] = 100 * r["final_accuracy"]
        out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.environ.get("PARLAY_DATA_DIR"))
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--target", type=float, default=0.98)
    p.add_argument("--eval-every", type=int, default=32)
    p.add_argument("--cap", type=float, default=1200.0,
                   help="seconds of clock after which a contestant stops at its next evaluation")
    p.add_argument("--diloco", default="diloco-h8,diloco-h8-int8",
                   help=f"variants: {','.join(DILOCO)}")
    p.add_argument("--no-compute", action="store_true")
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--no-auto", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    contestants = ([] if a.no_compute else [COMPUTE]) + \
        ([] if a.no_ddp else [{"name": "ddp", "kind": "ddp"}]) + \
        ([] if a.no_auto else [{"name": "auto", "mode": "allreduce", "compression": "auto"}]) + \
        [{"name": n, "mode": "diloco", "compression": DILOCO[n][1], "options": DILOCO[n][0]}
         for n in a.diloco.split(",") if n]
    spec = {"data": a.data, "target": a.target, "eval_every": a.eval_every, "cap_s": a.cap,
            "contestants": contestants}
    raw, info = launch(spec, hosts=a.hosts, rate=a.rate)
    rows = _merge(raw)
    print(f"{a.hosts} hosts x 1 rank at {a.rate} (measured {info['link_mbit_s']:.1f} Mbit/s)")
    for r in rows:
        print(f"{r['name']}: " + " ".join(f"{s}:{100 * acc:.2f}@{t:.0f}s"
                                          for s, _, t, acc in r["curve"]))
    print(table(rows, ["name", "seconds_to_target", "steps_to_target", "accuracy_%", "steps",
                       "stopped", "train_s", "setup_s", "ms_per_step", "nic_tx_MB_per_host"]))
    by = {r["name"]: r for r in rows}
    hit = [r for r in rows if r["name"].startswith("diloco") and r["seconds_to_target"]]
    ratios: dict[str, float] = {}
    if hit:
        best = min(hit, key=lambda r: r["seconds_to_target"])
        print(f"fastest diloco variant to {a.target:.0%}: {best['name']}")
        for ref in ("ddp", "auto"):
            r = by.get(ref)
            if r and r["seconds_to_target"]:
                ratios[f"tta_{ref}_over_diloco"] = \
                    r["seconds_to_target"] / best["seconds_to_target"]
            if r and r["steps"] == best["steps"]:
                ratios[f"accuracy_gap_{ref}_minus_diloco_points"] = \
                    r["accuracy_%"] - best["accuracy_%"]
    lim = by.get("compute-only")
    if lim:
        for r in rows:
            r["limit_over_step"] = lim["ms_per_step"] / r["ms_per_step"]
        ratios["ddp_step_over_limit"] = by["ddp"]["ms_per_step"] / lim["ms_per_step"] \
            if "ddp" in by else float("nan")
        print(table(rows, ["name", "ms_per_step", "limit_over_step"]))
    print(json.dumps(ratios, indent=1))
    write_json(a.json, "diloco_tta", ratios, rows, cluster=info, spec=spec)


if __name__ == "__main__":
    main()
