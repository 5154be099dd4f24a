"""A bit flipped in one replica's parameters during training: found at the next replica check.

Each try trains the small model of :mod:`tools.fault_cases._train` under ``parlay run`` on 2 or
3 ranks (alternately) with ``replica_check`` N (1, 2, 3, 5 or ``"auto"``, drawn at random);
after a random step one random rank flips one random bit (of 32) of one random element of one
random parameter. As promised:

* the divergence is reported within N steps of the flip (N: the interval in force when the
  flip happened), naming the flipped rank;
* 2 ranks: every rank stops with ``ReplicaDivergence`` (naming both: two cannot tell which is
  right); 3 ranks: a warning names the flipped rank, the majority heals it, the run ends with
  exit 0 and every rank's final parameters equal.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

from tools.fault_cases._train import finals, launch, same, tries

CHECKS = (1, 2, 3, 5, "auto")
#: Steps trained after the flip: more than the interval, which "auto" chooses from timings.
AFTER = {"auto": 200, "fixed": 20}


def one(i: int, workdir: Path) -> dict[str, Any]:
    """Try ``i`` (its random choices are drawn from ``random.Random(i)``: reproducible)."""
    rng = random.Random(i)
    world = 2 if i % 2 == 0 else 3
    check, step, rank = rng.choice(CHECKS), rng.randint(9, 24), rng.randrange(world)
    case = f"{world}_ranks"
    d = workdir / f"try{i:03d}"
    steps = step + AFTER["auto" if check == "auto" else "fixed"]
    p = launch(d, world, ["--steps", str(steps), "--snapshot-every", "0",
                          "--replica-check", str(check), "--flip", f"{step}:{rank}:{i}"],
               {"PARLAY_RUN_ID": f"faults-flip-{i}-{id(workdir)}"})
    recs = {}
    for f in d.glob("r*.json"):
        rec = json.loads(f.read_text())
        recs[rec["rank"]] = rec
    flip = recs.get(rank, {}).get("flip")
    if flip is None:
        return {"case": case, "ok": False, "detail": f"setup: rank {rank} did not flip at step "
                f"{step} (rc {p.returncode}):\n{p.stderr[-2000:]}"}
    every = flip["every"]
    what = (f"bit {flip['bit']} of element {flip['element']} of parameter {flip['param']} on "
            f"rank {rank} of {world} after step {step}, replica_check={check} (interval "
            f"{every}, next check at step {flip['next_check']})")
    problems, seen = [], ""
    if flip["next_check"] > steps:
        problems.append(f"the run ends at step {steps}, before the next check: raise AFTER")
    nonfinite = [r for r in recs.values() if "nonfinite" in r]
    if nonfinite:
        r = nonfinite[0]
        problems.append(f"the run stopped with NonFiniteError at step {r['nonfinite']} (rank "
                        f"{r['nonfinite_rank']}'s loss) before a replica check saw the flip")
    elif world == 2:
        got = {(r.get("diverged"), tuple(r.get("ranks", ()))) for r in recs.values()}
        at, ranks = next(iter(got)) if len(got) == 1 else (None, ())
        if p.returncode == 0 or len(recs) != world or at is None:
            problems.append(f"no ReplicaDivergence on every rank (rc {p.returncode}, "
                            f"records {sorted(got, key=str)})")
        elif not (step < at <= step + every and rank in ranks):
            problems.append(f"ReplicaDivergence at step {at} naming ranks {list(ranks)}")
        else:
            seen = f"ReplicaDivergence on every rank at step {at} naming ranks {list(ranks)}"
    else:
        m = re.search(rf"disagree at step (\d+): rank\(s\) \[{rank}\] differ from the majority",
                      p.stderr)
        got_finals = finals(d, world)
        if p.returncode or got_finals is None:
            problems.append(f"the run failed (rc {p.returncode}):\n{p.stderr[-2000:]}")
        elif m is None or not step < int(m.group(1)) <= step + every:
            problems.append("no warning naming rank {rank} within the interval" + (
                f" (it came at step {m.group(1)})" if m else ""))
        elif not all(same(got_finals[0], g) for g in got_finals[1:]):
            problems.append(f"healed at step {m.group(1)}, but the final parameters differ")
        else:
            seen = (f"rank {rank} named at step {m.group(1)} and healed by the majority; "
                    "the final parameters of every rank are equal")
    detail = f"{what}: " + (seen if not problems else "FAILED: " + "; ".join(problems))
    if not problems:
        shutil.rmtree(d, ignore_errors=True)
    return {"case": case, "ok": not problems, "detail": detail}


def run(repeats: int, workdir: Path) -> list[dict[str, Any]]:
    """``repeats`` tries, one row each."""
    workdir.mkdir(parents=True, exist_ok=True)
    return tries(workdir, repeats, lambda i: one(i, workdir))
