"""Recovery from a killed rank, and what in-memory snapshots cost while nothing fails.

The MNIST MLP (784-800-800-10, Adam, batch 128 per process; the bundled MNIST, or
``$PARLAY_DATA_DIR``) trains on 2 processes under ``parlay run -n 2 --max-restarts 1``.

* recovery: rank 1 SIGKILLs itself after ``--kill-step`` steps on the first attempt; torchrun's
  agent restarts every worker and the Trainer resumes. Measured: seconds from the kill to the
  first step completed after it (and the stages in between: new process started, Trainer built
  and resumed), and the steps lost (computed before the kill, computed again after it). Side by
  side: in-memory snapshots (``snapshot_every=1``) vs the anchor, disk checkpoints alone
  (``snapshot_every=0, checkpoint_every=--ckpt-every``), i.e. what torchrun gives by itself.
* overhead: one run of the same Trainer with snapshots off (twice: the second, "off again", is
  the A/A control, how far the same code reads from itself here); with a full copy of the state
  every step, copied before ``save`` returns (inline, ``PARLAY_SNAPSHOT_BACKGROUND=0``) or while the
  rank waits for the gradient reduction of the next step (deferred, the default,
  :mod:`parlay.snapshot.deferred`); and with the Trainer's default, ``snapshot_every="auto"``
  (deferred copies every K steps, K the interval the Trainer chose from its own measurement,
  meant to cost at most 2% of a step). Modes take turns in chunks of ``--chunk`` timed steps, each
  round in a fresh random order (so load from other processes, and what one mode leaves in the
  caches for the next, hits all alike; before each chunk, untimed, the previous mode's deferred
  copy is finished and one step taken). Ratios of the mean step times (medians are printed
  beside), wall clock and the training thread's CPU time; the mean of each round's chunk over
  the same round's off chunk with its 95% interval; and the CPU time the deferred snapshot's
  own code takes on the training thread (``save``, the deferred copy and commit, also where
  they fill waits for communication) as a share of its step time, timed in a launch of its own
  (the timing's wrappers would count in the other launches' ratios). Also the time
  ``SnapshotStore.save`` takes on the caller's thread for this model's state (and the deferred
  copy, which overlaps communication) vs a plain ``torch.save`` of it to /dev/shm.
  The snapshot launches turn the replica check off, so that it counts in none of their modes.
* replica check: the same Trainer, snapshots off, the check off (twice: the A/A control) vs the
  default ``replica_check="auto"`` (K re-chosen at each check so that checks cost at most 0.5%),
  in chunks taken in turns as above (only checked chunks move the check's schedule). Ratios as
  above; and, as the ratio cannot resolve it (a check every few dozen steps), what the steps
  with a check (and the next: the ranks' skew moves) took beyond their chunk's other steps.

    python benchmarks/recovery.py [--quick] [--repeats N] [--overhead-only]
                                  [--replica-check-only] [--json out.json]
"""
from __future__ import annotations

import time

T_PROCESS = time.time()  # noqa: E402 - before the imports: the restarted process's birth

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table, write_json  # noqa: E402


def _data() -> Any:
    from parlay.data.mnist import mnist

    try:
        return mnist(train=True)
    except Exception:  # noqa: BLE001 - no MNIST: a synthetic set of the same shape
        import torch
        from torch.utils.data import TensorDataset

        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(60000, 1, 28, 28, generator=g),
                             torch.randint(0, 10, (60000,), generator=g))


def _trainer(a: argparse.Namespace, steps: int, snapshot_every: int | str, ckpt: str | None,
             data: Any = None, replica_check: int | str = "auto") -> Any:
    import parlay
    from parlay.demos.mnist import build_mlp

    return parlay.Trainer(build_mlp, data or _data(), optimizer_args={"lr": 1e-3}, batch_size=128,
                          max_iteration=steps, checkpoint_dir=ckpt,
                          checkpoint_every=a.ckpt_every if ckpt else None,
                          snapshot_every=snapshot_every, replica_check=replica_check,
                          progress=False, log_step_size=10**9)


# ---------------------------------------------------------------------- workers (under parlay run)
def worker_recovery(a: argparse.Namespace) -> None:
    import parlay

    from parlay.demos.mnist import build_mlp  # noqa: F401 - counted with the imports

    t_imported = time.time()
    data = _data()
    t_data = time.time()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t = _trainer(a, a.kill_step + 5, a.snapshot_every, a.ckpt or None, data)
    rank = parlay.rank()
    rec: dict[str, Any] = {"attempt": attempt, "rank": rank, "start_step": t.state.step,
                           "snapshot": t.resumed_from_snapshot, "t_process": T_PROCESS,
                           "t_imported": t_imported, "t_data": t_data, "t_built": time.time()}
    while not t.should_stop():
        if attempt == 0 and rank == 1 and t.state.step == a.kill_step:
            Path(a.out, "kill").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t.train_on_batch()
        rec.setdefault("t_first_step", time.time())
    Path(a.out, f"rec-a{attempt}-r{rank}.json").write_text(json.dumps(rec))


# PARLAY_SNAPSHOT_BACKGROUND per mode. inline, deferred: a full copy of the state every step.
# "off again" is snapshots off a second time: its ratio to "off" is the A/A control, what the
# same code reads against itself on this machine.
MODES = {"off": None, "off again": None, "inline": "0", "deferred": None, "auto": None}


class _InCode:
    """CPU time this thread spends inside the snapshot's own code (``save``, the deferred copy
    and commit, also where they run while the thread waits for the gradient reduction)
    while :attr:`on`; nested calls count once. CPU time, not wall: on two shared cores the
    thread is often preempted inside such a call, time it would otherwise spend blocked."""

    def __init__(self) -> None:
        self.on, self.depth, self.seconds = False, 0, 0.0

    def wrap(self, cls: Any, name: str) -> None:
        fn = getattr(cls, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t0
                self.depth -= 1
        setattr(cls, name, timed)


def worker_overhead(a: argparse.Namespace) -> None:
    import parlay
    from parlay.snapshot import SnapshotStore
    from parlay.snapshot.deferred import DeferredCopy

    in_code = _InCode()
    if a.in_code:  # its wrappers and clock reads cost time too: not in the launches timed
        for cls, name in ((SnapshotStore, "save"), (DeferredCopy, "step"),
                          (DeferredCopy, "finish")):
            in_code.wrap(cls, name)
    warm = 16  # the Trainer's default, snapshot_every="auto", measures and picks its interval
    t = _trainer(a, warm + len(MODES) * (a.chunk + 1) * (a.pairs + 1), "auto", None,
                 replica_check=0)
    for _ in range(warm):
        t.train_on_batch()
    chosen = t.snapshot_every

    def enter(mode: str) -> None:
        t.snapshot_every = (10**9 if mode.startswith("off") else
                            chosen if mode == "auto" else 1)
        os.environ.pop("PARLAY_SNAPSHOT_BACKGROUND", None)
        if MODES[mode] is not None:
            os.environ["PARLAY_SNAPSHOT_BACKGROUND"] = MODES[mode]
        if t.persistence.store is not None:  # the last mode's deferred copy, untimed
            t.persistence.store.wait()

    def during(mode: str, timed: bool) -> None:
        in_code.on = timed and mode == "deferred"

    times, cpu = _interleave(a, t, list(MODES), enter, during)
    in_code.on = False
    t.should_stop()
    Path(a.out, f"overhead-r{parlay.rank()}.json").write_text(json.dumps({
        "wall": times, "cpu": cpu, "in_code_s": in_code.seconds if a.in_code else None,
        "auto_every": chosen}))


def _interleave(a: argparse.Namespace, t: Any, modes: list[str], enter: Any,
                during: Any) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and this thread's CPU seconds of ``t``'s timed steps by mode: chunks of
    ``a.chunk`` per mode, in turns for ``a.pairs`` rounds after an untimed one, each round in
    its own order. ``enter(mode)`` sets a mode up before its chunk (untimed, like the chunk's
    first step); ``during(mode, timed)`` is told before each step whether it is timed."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes)
    for pair in range(a.pairs + 1):  # round 0 warms up
        for mode in order:
            enter(mode)
            for i in range(a.chunk + 1):  # the first step of a chunk is not timed either
                timed = bool(pair and i)
                during(mode, timed)
                t0, c0 = time.perf_counter(), time.thread_time()
                t.train_on_batch()
                if timed:
                    times[mode].append(time.perf_counter() - t0)
                    cpu[mode].append(time.thread_time() - c0)
        # Each round in its own order (the same on every rank): in a fixed rotation every mode
        # always follows the same one, and whatever a mode leaves behind (caches, the
        # snapshot's slots) would always land on the same successor.
        random.Random(pair).shuffle(order)
    return times, cpu


def worker_replicas(a: argparse.Namespace) -> None:
    import parlay
    from parlay.trainer.replicas import ReplicaCheck

    checks: list[tuple[float, float, int, int]] = []  # wall, CPU seconds, interval, step
    check = ReplicaCheck.check

    def timed_check(self: Any, step: int) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        check(self, step)
        checks.append((time.perf_counter() - t0, time.thread_time() - c0, self.every, step))
    ReplicaCheck.check = timed_check  # type: ignore[method-assign]  # every K steps: ~free
    modes = ["check off", "check off again", "check auto"]  # "off again": the A/A control
    warm = 16  # the first automatic check, FIRST_CHECK steps in, chooses the interval
    t = _trainer(a, warm + len(modes) * (a.chunk + 1) * (a.pairs + 1), 0, None)
    for _ in range(warm):
        t.train_on_batch()
    del checks[:]
    rc = t.persistence.replicas
    plan = {"every": rc.every, "left": rc.next - t.state.step}

    def enter(mode: str) -> None:
        if rc.every:  # leaving the checked mode: keep its place in its own schedule
            plan.update(every=rc.every, left=rc.next - t.state.step)
        rc.every = plan["every"] if mode == "check auto" else 0
        rc.next = t.state.step + 1 + plan["left"]  # the chunk's untimed first step not counted

    steps: list[int] = []  # the number of every timed step with checks

    def during(mode: str, timed: bool) -> None:
        if timed and mode == "check auto":
            steps.append(t.state.step + 1)

    times, cpu = _interleave(a, t, modes, enter, during)
    t.should_stop()
    Path(a.out, f"replicas-r{parlay.rank()}.json").write_text(json.dumps({
        "wall": times, "cpu": cpu, "steps": steps,
        "checks": [c for c in checks if c[3] in steps]}))  # not those of the untimed round


# ---------------------------------------------------------------------- driver
def _launch(a: argparse.Namespace, out: Path, *worker: str, pairs: int | None = None) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PARLAY_TIMEOUT", "60")
    cmd = [sys.executable, "-m", "parlay.cli", "run", "-n", "2", "--max-restarts", "1",
           __file__, *worker, "--out", str(out), "--chunk", str(a.chunk), "--pairs",
           str(pairs or a.pairs), "--kill-step", str(a.kill_step), "--ckpt-every",
           str(a.ckpt_every)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"recovery benchmark: {' '.join(worker)} failed:\n{p.stderr[-3000:]}")


def _worker_run(a: argparse.Namespace, out: Path, worker: str, *flags: str,
                pairs: int | None = None) -> Any:
    """Launch ``worker`` writing into the new folder ``out``; rank 0's results."""
    out.mkdir()
    _launch(a, out, "--worker", worker, *flags, pairs=pairs)
    return json.loads((out / f"{worker}-r0.json").read_text())


def recovery(a: argparse.Namespace, tmp: Path, snapshots: bool, repeat: int) -> dict[str, Any]:
    out = tmp / f"{'snap' if snapshots else 'ckpt'}{repeat}"
    out.mkdir()
    worker = ["--worker", "recovery", "--snapshot-every", "1" if snapshots else "0"]
    if not snapshots:
        worker += ["--ckpt", str(out / "ckpt")]
    _launch(a, out, *worker)
    kill = float((out / "kill").read_text())
    recs = [json.loads((out / f"rec-a1-r{r}.json").read_text()) for r in range(2)]
    return {"recovery": "snapshots" if snapshots else "disk checkpoints (anchor)",
            "kill_step": a.kill_step, "resumed_at": recs[0]["start_step"],
            "steps_lost": a.kill_step - recs[0]["start_step"],
            "restarted_s": max(r["t_process"] for r in recs) - kill,
            "imported_s": max(r["t_imported"] for r in recs) - kill,
            "data_s": max(r["t_data"] for r in recs) - kill,
            "built_s": max(r["t_built"] for r in recs) - kill,
            "recovery_s": max(r["t_first_step"] for r in recs) - kill}


def save_cost(repeats: int) -> dict[str, Any]:
    """Time of SnapshotStore.save (on the training thread; then of the deferred copy and commit,
    which a training step does while it waits for communication) vs torch.save for the MLP +
    Adam state, and of SnapshotStore.load (what a restart reads)."""
    import torch

    from parlay.demos.mnist import build_mlp
    from parlay.snapshot import SnapshotStore, optimizer_tensors

    torch.set_num_threads(1)
    model, _ = build_mlp()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 784)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    class Strategy:
        optimizer = opt
    defer = optimizer_tensors(Strategy())
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        store = SnapshotStore("bench", 0, root=d)
        ours, deferred, plain, load = [], [], [], []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            store.save(i, state, defer=defer)
            t0b = time.perf_counter()
            store.wait()
            t1 = time.perf_counter()
            torch.save(state, f"{d}/plain.pt")
            t2 = time.perf_counter()
            store.load(i)
            t3 = time.perf_counter()
            if i >= 2:  # the first two map (create) the two slot files
                ours.append(t0b - t0)
                deferred.append(t1 - t0b)
                plain.append(t2 - t1)
                load.append(t3 - t2)
        store.clear()
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
    return {"state_mb": mb, "save_ms": 1e3 * median(ours),
            "deferred_ms": 1e3 * median(deferred), "torch_save_ms": 1e3 * median(plain),
            "load_ms": 1e3 * median(load)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (under two minutes)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None, help="anchor's checkpoint interval")
    p.add_argument("--chunk", type=int, default=None,
                   help="timed steps per chunk of a mode (default 32)")
    p.add_argument("--pairs", type=int, default=None, help="rounds of on/off chunks measured")
    p.add_argument("--repeats", type=int, default=None,
                   help="recovery runs per side, and launches of the overhead measurement")
    p.add_argument("--overhead-only", action="store_true", help="skip the recovery runs")
    p.add_argument("--replica-check-only", action="store_true",
                   help="measure only the replica check's cost")
    p.add_argument("--worker", choices=["recovery", "overhead", "replicas"],
                   help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--in-code", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--snapshot-every", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.kill_step = a.kill_step or (24 if a.quick else 60)
    a.ckpt_every = a.ckpt_every or (16 if a.quick else 50)
    a.chunk = a.chunk or 32
    a.pairs = a.pairs or (4 if a.quick else 15)
    a.repeats = a.repeats or (1 if a.quick else 3)
    if a.worker:
        {"recovery": worker_recovery, "overhead": worker_overhead,
         "replicas": worker_replicas}[a.worker](a)
        return
    only = a.replica_check_only
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs, ratios = ([], {}) if a.overhead_only or only else _recoveries(a, tmp)
        over, launches = ([], []) if only else _overheads(a, tmp)
        checks, check_launches = _replica_checks(a, tmp)
    results = runs + over
    if over:
        cost = save_cost(5 if a.quick else 20)
        print()
        print(table(over, ["overhead", "step_ms_on", "step_ms_off", "ratio", "paired_ratio",
                           "median_ratio", "cpu_ratio", "in_code_pct", "launch_ratios",
                           "steps_each"]))
        print("ratio: mean step time over mean step time with snapshots off, the median over "
              "launches; paired_ratio: the mean, with its 95% half-width, of each round's chunk "
              "over the off chunk of the same round; median_ratio: of median step times; "
              "in_code_pct: the deferred snapshot's own code (save, the deferred copy and "
              "commit, also where they fill waits for communication) as a share of its steps' "
              "time, timed in a launch of its own; the A/A control is how far the same code "
              "reads from itself")
        print()
        print(table([cost], ["state_mb", "save_ms", "deferred_ms", "torch_save_ms", "load_ms"]))
        for row in over:
            ratios["step_time_off_again_vs_off_aa_control" if row["mode"] == "off again" else
                   f"step_time_{row['mode']}_snapshots_vs_off"] = row["ratio"]
            if row["in_code_pct"] is not None:
                ratios["snapshot_in_code_share"] = row["in_code_pct"] / 100
        ratios["save_vs_torch_save"] = cost["save_ms"] / cost["torch_save_ms"]
        results.append(cost)
    print()
    print(table(checks, ["overhead", "step_ms_on", "step_ms_off", "ratio", "paired_ratio",
                         "median_ratio", "cpu_ratio", "checks", "check_ms", "every",
                         "added_pct", "check_cpu_pct", "launch_ratios", "steps_each"]))
    print("replica check (snapshots off) vs off; checks: in all launches; every: intervals "
          "chosen; added_pct: steps with a check and the next beyond their chunk's other steps' "
          "mean, over the checked steps' time; check_cpu_pct: CPU time in checks over it")
    aa, auto = checks
    ratios.update(replica_check_off_again_vs_off_aa_control=aa["ratio"],
                  replica_check_vs_off=auto["ratio"], replica_check_share=auto["added_pct"] / 100)
    print("\nratios:", json.dumps({k: round(v, 4) for k, v in ratios.items()}))
    walls = [t["wall"] for t in launches + check_launches]
    write_json(a.json, "recovery", ratios, results + checks,
               step_times_ms=[{k: [1e3 * v for v in vs] for k, vs in w.items()} for w in walls],
               spread=[{k: statistics.pstdev(vs) / max(median(vs), 1e-12) for k, vs in w.items()}
                       for w in walls])


def _recoveries(a: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``--repeats`` recovery runs per side, alternating; the median run of each side."""
    runs = [recovery(a, tmp, snap, i) for i in range(a.repeats) for snap in (True, False)]
    rows = []
    for snap in (True, False):  # the median run of each (by recovery time)
        mine = sorted((r for r in runs if (r["recovery"] == "snapshots") == snap),
                      key=lambda r: r["recovery_s"])
        rows.append({**mine[len(mine) // 2], "runs": len(mine),
                     "all_recovery_s": [round(r["recovery_s"], 2) for r in mine]})
    print(table(rows, ["recovery", "kill_step", "resumed_at", "steps_lost", "restarted_s",
                       "imported_s", "data_s", "built_s", "recovery_s", "runs"]))
    print("recovery_s of every run:", {r["recovery"]: r["all_recovery_s"] for r in rows})
    print("steps_lost of every run:", {side: [r["steps_lost"] for r in runs
                                              if r["recovery"] == side]
                                       for side in ("snapshots", "disk checkpoints (anchor)")})
    snap, disk = rows
    return runs, {"recovery_s_snapshot_vs_checkpoint": snap["recovery_s"] / disk["recovery_s"],
                  "steps_lost_snapshot_vs_checkpoint":
                      snap["steps_lost"] / max(1, disk["steps_lost"])}


def _compare(a: argparse.Namespace, launches: list[Any], mode: str, off: str) -> dict[str, Any]:
    """``mode`` against ``off`` over the launches: per launch the ratio of mean (and median)
    step times, their median over launches, and the paired ratio (the mean, with its 95%
    half-width, over every launch's rounds of this mode's chunk over the ``off`` chunk of the
    same round: seconds apart, so slow drift of the machine cancels)."""
    def ratio(run: dict[str, Any], kind: str, stat: Any = statistics.fmean) -> float:
        return stat(run[kind][mode]) / stat(run[kind][off])

    paired = []
    for run in launches:
        on, base = run["wall"][mode], run["wall"][off]
        paired += [statistics.fmean(on[i:i + a.chunk]) / statistics.fmean(base[i:i + a.chunk])
                   for i in range(0, min(len(on), len(base)), a.chunk)]
    mean, half = statistics.fmean(paired), 1.96 * statistics.stdev(paired) / len(paired) ** 0.5
    walls = [ratio(run, "wall") for run in launches]
    return {"step_ms_on": 1e3 * median([statistics.fmean(r["wall"][mode]) for r in launches]),
            "step_ms_off": 1e3 * median([statistics.fmean(r["wall"][off]) for r in launches]),
            "ratio": median(walls), "launch_ratios": [round(w, 4) for w in walls],
            "paired_ratio": f"{mean:.4f} +- {half:.4f}",
            "median_ratio": median([ratio(run, "wall", median) for run in launches]),
            "cpu_ratio": median([ratio(run, "cpu") for run in launches]),
            "steps_each": sum(len(r["wall"][mode]) for r in launches)}


def _replica_checks(a: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """``--repeats`` launches of the replica-check worker; the check's modes vs off (rank 0)."""
    launches = [_worker_run(a, tmp / f"replicas{i}", "replicas") for i in range(a.repeats)]
    checks = [c for r in launches for c in r["checks"]]  # wall, CPU seconds, interval, step
    checked = sum(sum(r["wall"]["check auto"]) for r in launches)
    added = 0.0  # steps with a check and the next (the ranks' skew moves from one to the
    for r in launches:  # other) beyond the mean of the other steps of their chunk
        w, at = r["wall"]["check auto"], {r["steps"].index(c[3]) for c in r["checks"]}
        hit = at | {k + 1 for k in at}
        for lo in range(0, len(w), a.chunk):
            mine = [w[j] for j in range(lo, min(lo + a.chunk, len(w))) if j in hit]
            rest = [w[j] for j in range(lo, min(lo + a.chunk, len(w))) if j not in hit]
            added += sum(mine) - len(mine) * statistics.fmean(rest or r["wall"]["check off"])
    auto = {"mode": "check auto", "overhead": "replica_check='auto' (the default) vs off",
            **_compare(a, launches, "check auto", "check off"), "checks": len(checks),
            "check_ms": 1e3 * median([c[0] for c in checks] or [0]),
            "every": sorted({c[2] for c in checks}), "added_pct": round(100 * added / checked, 3),
            "check_cpu_pct": round(100 * sum(c[1] for c in checks) / checked, 3)}
    return [{"mode": "check off again", **_compare(a, launches, "check off again", "check off"),
             "overhead": "replica check off again vs off (A/A control)"}, auto], launches


def _overheads(a: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    """``--repeats`` launches of the overhead worker; per mode, the median over launches of each
    launch's ratio of mean step times (rank 0), and every launch's ratio (the spread)."""
    launches = [_worker_run(a, tmp / f"ovh{i}", "overhead") for i in range(a.repeats)]
    # The snapshot's own code is timed in one launch more, a third as long: its wrappers and
    # clock reads (~30 us a step) would count in the ratios of a launch that timed it.
    in_code_run = _worker_run(a, tmp / "ovh-in-code", "overhead", "--in-code",
                              pairs=max(2, a.pairs // 3))

    rows = []
    for mode in ("off again", "inline", "deferred", "auto"):
        in_code = (in_code_run["in_code_s"] / sum(in_code_run["wall"]["deferred"])
                   if mode == "deferred" else None)
        rows.append({"mode": mode,
                     "overhead": ("snapshots off again vs off (A/A control)" if mode == "off again"
                                  else "snapshot_every='auto' (the default: every "
                                  f"{sorted({r['auto_every'] for r in launches})} steps) vs off"
                                  if mode == "auto" else f"snapshot_every=1, {mode} vs off"),
                     **_compare(a, launches, mode, "off"),
                     "in_code_pct": None if in_code is None else round(100 * in_code, 2)})
    return rows, launches


if __name__ == "__main__":
    main()
