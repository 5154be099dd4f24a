"""A rank of ``mode="diloco"`` SIGKILLed at any point, outer syncs included: at most one inner
step is computed again after ``parlay run --max-restarts 1`` restarts the job (issue 27).

Each try trains the MNIST MLP (784-800-800-10, batch 64 per rank, Adam) on 2 ranks with
``sync_every=50`` and in-memory snapshots every step (``snapshot_every=1``) for 120 inner steps,
and on the first attempt one rank kills itself:

* ``in_sync``: inside an outer sync (step 50 or 100): its pseudo-gradient's allreduce is
  started, not finished, when it dies, the peer blocked in the same allreduce;
* ``after_sync``: right after the step of an outer sync (49, 50 or 51, 99, 100 or 101);
* ``mid_round``: right after a random inner step.

As promised: the job ends with exit 0; each rank resumes at most one inner step behind the
newest step it had computed (the step in progress, for ``in_sync``), whether killed or not
(the peer may be up to a round ahead: DiLoCo's ranks meet only at syncs); and the final
weights equal an uninterrupted run's bit for bit. torchft's DiLoCo, by contrast, discards the
round of a sync that fails (H inner steps), as its ``perform_sync`` restores the saved weights.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS, H = 120, 50


def _launch(out: Path, args: list[str], run_id: str) -> subprocess.CompletedProcess[str]:
    from tools.fault_cases._train import launch

    return launch(out, 2, args, {"PARLAY_RUN_ID": run_id}, timeout=300, script=__file__,
                  max_restarts=1)


def _records(out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(attempt, rank) -> what that process wrote: where it started, how far it got."""
    recs = {}
    for f in out.glob("a*-r*.json"):
        a, r = (int(v[1:]) for v in f.stem.split("-"))
        recs[a, r] = json.loads(f.read_text())
    for f in out.glob("a*-r*.progress"):  # the newest step each process finished
        a, r = (int(v[1:]) for v in f.stem.split("-"))
        recs.setdefault((a, r), {})["done"] = int(f.read_text() or -1)
    return recs


def one(i: int, workdir: Path, reference: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Try ``i`` (its choices drawn from ``random.Random(i)``)."""
    from tools.fault_cases._train import finals, same

    rng = random.Random(i)
    kind = ("in_sync", "after_sync", "mid_round")[i % 3]
    sync = rng.choice((H, 2 * H))
    step = {"in_sync": sync, "after_sync": sync + rng.choice((-1, 0, 1)),
            "mid_round": rng.choice([s for s in range(2, STEPS - 5) if s % H > 1])}[kind]
    rank = rng.randrange(2)
    d = workdir / f"try{i:03d}"
    t0 = time.perf_counter()
    p = _launch(d, ["--kill", f"{kind}:{step}:{rank}"], f"faults-diloco-{i}-{time.time_ns()}")
    secs = time.perf_counter() - t0
    recs = _records(d)
    case, what = kind, f"rank {rank} killed {kind.replace('_', ' ')} at step {step}"
    problems = []
    if p.returncode != 0:
        problems.append(f"exit {p.returncode}:\n{p.stderr[-2000:]}")
    lost = {}
    for r in range(2):
        first, second = recs.get((0, r), {}), recs.get((1, r))
        if second is None:
            problems.append(f"rank {r} did not restart")
            continue
        # the newest inner step rank r had computed (in_sync: the step whose sync it died in)
        newest = step if (r == rank and kind == "in_sync") else first.get("done", -1)
        lost[r] = newest - second["start"]
        if lost[r] > 1:
            problems.append(f"rank {r} computed step {newest}, resumed at {second['start']}")
    got = finals(d, 2)
    if got is None or reference is None:
        problems.append("no final weights" if got is None else "no reference run")
    elif not all(same(a, b) for a, b in zip(got, reference)):
        problems.append("final weights differ from the uninterrupted run")
    detail = (f"{what}: inner steps computed again per rank {lost} (resumed at "
              f"{[recs.get((1, r), {}).get('start') for r in range(2)]}), {secs:.0f} s")
    return {"case": case, "ok": not problems, "detail": "; ".join([detail, *problems]),
            "lost": max(lost.values(), default=None), "kill_step": step, "rank": rank}


def run(repeats: int, workdir: Path) -> list[dict[str, Any]]:
    """An uninterrupted reference run, then ``repeats`` tries, one row each."""
    from tools.fault_cases._train import finals, tries

    workdir.mkdir(parents=True, exist_ok=True)
    p = _launch(workdir / "reference", [], f"faults-diloco-ref-{time.time_ns()}")
    reference = finals(workdir / "reference", 2)
    if reference is None:
        print(f"reference run failed (exit {p.returncode}):\n{p.stderr[-2000:]}", file=sys.stderr)
    return tries(workdir, repeats, lambda i: one(i, workdir, reference))


def main() -> None:
    """The training job ``parlay run`` starts (one rank)."""
    import argparse

    import torch
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay
    from tools.bench.accuracy import build_mlp, load_mnist, prep

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill", default=None, help="KIND:STEP:RANK")
    a = p.parse_args()
    torch.set_num_threads(1)
    x, y = load_mnist(os.environ.get("PARLAY_DATA_DIR"), "train")
    t = parlay.Trainer(lambda: (build_mlp(), nn.CrossEntropyLoss()),
                       TensorDataset(prep(x[:STEPS * 128]), y[:STEPS * 128]),
                       optimizer_args={"lr": 1e-3}, batch_size=64, max_iteration=STEPS,
                       mode="diloco", strategy_options={"sync_every": H}, snapshot_every=1,
                       replica_check=0, progress=False, log_step_size=10**9)
    rank, out = parlay.rank(), Path(a.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    me = out / f"a{attempt}-r{rank}"
    me.with_suffix(".json").write_text(json.dumps({"start": t.state.step,
                                                   "snapshot": t.resumed_from_snapshot}))
    kind, step, victim = (a.kill or "none:-1:-1").split(":")
    killing = attempt == 0 and int(victim) == rank
    if killing and kind == "in_sync":  # die inside the exchange: allreduce started, not waited
        opt = t.strategy.optimizer
        merge = opt._merge

        def dying_merge(frag: Any) -> None:
            if opt.steps == int(step):
                os.kill(os.getpid(), signal.SIGKILL)
            merge(frag)
        opt._merge = dying_merge
    fd = os.open(me.with_suffix(".progress"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    while not t.should_stop():
        t.train_on_batch()
        os.pwrite(fd, f"{t.state.step:<8}".encode(), 0)
        if killing and kind != "in_sync" and t.state.step == int(step):
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({k: v.detach().clone() for k, v in t.model.state_dict().items()},
               out / f"final-r{rank}.pt")
    t.close()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
