"""In-memory snapshots through the real launcher: a SIGKILLed rank costs at most one step.

`parlay run -n 2 --max-restarts 1` runs a Trainer with no checkpoint_dir; one rank SIGKILLs
itself on the first attempt, torchrun's agent restarts every worker, and the Trainer resumes
from the newest snapshot every rank holds in PARLAY_SNAPSHOT_DIR. Each rank logs the sample
indices of every step it completes (the dataset carries the index in a column the model strips
off), so the test can check that the resumed run recomputed at most one step, skipped no sample
and saw none twice, and that its final weights equal an uninterrupted run's bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(150)
ROOT = Path(__file__).resolve().parents[2]
STEPS = 12

SCRIPT = textwrap.dedent('''
    import json, os, shutil, signal, sys
    from pathlib import Path
    import torch, torch.nn as nn
    from torch.utils.data import TensorDataset
    import parlay

    out, case, kill_rank, kill_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    lose = sys.argv[5] == "lose"   # the killed rank also loses its snapshots (host memory gone)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hybrid = case.startswith("hybrid")
    seen = []

    class Tap(nn.Module):
        """Records the sample indices (last column) of each training forward, then drops them.
        The pipeline also runs its first micro-batch through the model to check the stage
        boundaries (without gradients) and the stage once more to learn its output, so a step's
        micro-batches are counted once each."""
        def forward(self, x):
            if self.training and torch.is_grad_enabled():
                seen.append(tuple(int(i) for i in x[:, -1]))
            return x[:, :-1]

    def build():
        return (nn.Sequential(Tap(), nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3),
                              nn.Linear(16, 2)), nn.CrossEntropyLoss())

    n = 22 * (1 if case == "hybrid" else 2)       # 6 steps per epoch of batch 4 per replica
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 6, generator=g)
    ds = TensorDataset(torch.cat([x, torch.arange(n).float()[:, None]], 1),
                       (x[:, :3].sum(1) > 0).long())
    t = parlay.Trainer(build, ds, optimizer_args={"lr": 1e-2}, batch_size=4,
                       max_iteration=STEPS, mode="hybrid" if hybrid else "allreduce",
                       compression="topk:0.3" if case == "topk" else None,
                       strategy_options={"chunks": 2} if hybrid else None, progress=False,
                       snapshot_every=1)
    rank = parlay.rank()
    print(f"attempt {attempt} rank {rank} start {t.state.step} "
          f"snapshot {t.resumed_from_snapshot}", flush=True)
    with open(f"{out}/seen-a{attempt}-r{rank}.jsonl", "w") as log:
        while not t.should_stop():
            if attempt == 0 and rank == kill_rank and t.state.step == kill_step:
                if lose:
                    for d in Path(os.environ["PARLAY_SNAPSHOT_DIR"]).glob(f"*/rank{rank}"):
                        shutil.rmtree(d)
                os.kill(os.getpid(), signal.SIGKILL)
            t.train_on_batch()
            log.write(json.dumps([t.state.step, [i for mb in dict.fromkeys(seen) for i in mb]])
                      + "\\n")
            log.flush()
            seen.clear()
    sd = t.strategy.pipe.state_dict() if hybrid else t.model.state_dict()
    torch.save({k: v.clone() for k, v in sd.items()}, f"{out}/final-r{rank}.pt")
    print(f"attempt {attempt} rank {rank} finished at step {t.state.step}", flush=True)
''').replace("STEPS", str(STEPS))


def _launch(tmp: Path, case: str, kill_rank: int = -1, kill_step: int = -1,
            nproc: int = 2, lose: bool = False,
            background: bool = False) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp / "train_snapshot.py"
    script.write_text(SCRIPT)
    out, shm = tmp / "out", tmp / "shm"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PARLAY_TIMEOUT="30", OMP_NUM_THREADS="1", PARLAY_SNAPSHOT_DIR=str(shm),
               PARLAY_SNAPSHOT_BACKGROUND="1" if background else "0")
    pp = ["--pp", "2"] if case.startswith("hybrid") else []
    p = subprocess.run([sys.executable, "-m", "parlay.cli", "run", "-n", str(nproc),
                        "--max-restarts", "1", *pp, str(script), str(out), case,
                        str(kill_rank), str(kill_step), "lose" if lose else "keep"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert list(shm.iterdir()) == [], "snapshots (and the launcher's owner file) go at the end"
    return p, out


def _steps(out: Path, attempt: int, rank: int) -> dict[int, list[int]]:
    path = out / f"seen-a{attempt}-r{rank}.jsonl"
    if not path.exists():
        return {}
    return {s: idx for s, idx in map(json.loads, path.read_text().splitlines())}


def _finals(out: Path, nproc: int) -> list[dict]:
    return [torch.load(out / f"final-r{r}.pt", weights_only=True) for r in range(nproc)]


def _run_script(script: str, *argv: str) -> None:
    import runpy

    old = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(final weights, per-rank samples of each step) of uninterrupted runs, per case: the
    same script on real gloo ranks of run_world (no launcher start-up to pay)."""
    from parlay.testing import run_world

    cache: dict[tuple[str, int], tuple[list[dict], list[dict[int, list[int]]]]] = {}

    def get(case: str, nproc: int = 2):
        if (case, nproc) not in cache:
            tmp = tmp_path_factory.mktemp(f"ref-{case}")
            (tmp / "out").mkdir()
            (tmp / "train_snapshot.py").write_text(SCRIPT)
            run_world(_run_script, nproc, str(tmp / "train_snapshot.py"), str(tmp / "out"), case,
                      "-1", "-1", "keep", timeout=90,
                      env={"PARLAY_PP": "2"} if case.startswith("hybrid") else None)
            out = tmp / "out"
            cache[case, nproc] = (_finals(out, nproc), [_steps(out, 0, r) for r in range(nproc)])
        return cache[case, nproc]
    return get


def _check(p, out: Path, reference, case: str, kill_rank: int, kill_step: int,
           nproc: int = 2, exact: bool = True) -> None:
    want_finals, want_seen = reference(case, nproc)
    # Every rank came back on the second attempt at the same step, at most one step behind
    # the furthest any rank got (the killed rank may have died before committing step K).
    starts = {line.split()[5] for line in p.stdout.splitlines()
              if line.startswith("attempt 1 ") and " start " in line}
    assert len(starts) == 1, p.stdout
    resumed = int(starts.pop())
    assert kill_step - 1 <= resumed <= kill_step, p.stdout
    assert f"start {resumed} snapshot {resumed}" in p.stdout, "resumed from a snapshot"
    assert f"attempt 1 rank {kill_rank} finished at step {STEPS}" in p.stdout, p.stdout
    assert not [ln for ln in p.stdout.splitlines() if ln.startswith("attempt 0") and "finished"
                in ln], "the first attempt was killed"
    for r in range(nproc):
        first, second = _steps(out, 0, r), _steps(out, 1, r)
        assert min(second) == resumed + 1 and max(first) >= resumed
        merged = {s: i for s, i in first.items() if s <= resumed} | second
        assert merged == want_seen[r], f"rank {r} consumed other samples than the reference"
    # The reference itself sees every sample exactly once per epoch (over all replicas).
    per_epoch: dict[int, list[int]] = {}
    for seen in want_seen:
        for s, idx in seen.items():
            per_epoch.setdefault((s - 1) // 6, []).extend(idx)
    for epoch, idx in per_epoch.items():
        assert sorted(idx) == list(range(len(idx))), f"epoch {epoch}: a sample twice or skipped"
    finals = _finals(out, nproc)
    if not exact:  # re-seeded RNG: other dropout masks, but the replicas still agree
        want_finals = [finals[0]] * nproc
    for got, want in zip(finals, want_finals):
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"


# background: parameters and optimizer state copied while the next step waits for its
# gradient reduction (deferred, the default) rather than before save() returns (inline).
# One kill per mode (each rank and both copy modes covered once; the suite's time is bounded).
@pytest.mark.parametrize("case, kill_rank, kill_step, background", [  # allreduce's and hybrid's
    pytest.param("allreduce", 1, 4, False, marks=pytest.mark.slow),    # kill-and-restart (from a
    ("topk", 0, 5, True),                                              # snapshot) are in
    pytest.param("hybrid", 0, 9, False, marks=pytest.mark.slow)])      # test_restart
def test_sigkill_resumes_from_snapshot_bit_identical(tmp_path, reference, case, kill_rank,
                                                     kill_step, background):
    p, out = _launch(tmp_path, case, kill_rank, kill_step, background=background)
    _check(p, out, reference, case, kill_rank, kill_step)


def test_rank_that_lost_its_snapshots_gets_the_state_from_a_replica(tmp_path, reference):
    # The killed rank's snapshot folder is gone, as with a lost host: the survivor sends it
    # the model and optimizer; the step, the samples and the replicas' agreement still hold.
    p, out = _launch(tmp_path, "allreduce", 1, 7, lose=True)
    assert "not bit-exact" in p.stderr and "rank(s) [1] hold no usable snapshot" in p.stderr
    _check(p, out, reference, "allreduce", 1, 7, exact=False)


# ---------------------------------------------------------------------- agreement on real ranks
def _held_world(root, held, corrupt, after, groups=None):
    import torch.distributed as dist

    import parlay
    from parlay.snapshot import SnapshotStore, agree
    from parlay.snapshot.share import share_newest

    r = parlay.rank()
    store = SnapshotStore("agree", r, root=root)
    for step in held[r]:
        store.save(step, {"rank": r, "w": torch.full((8192,), float(step)), "mine": torch.ones(1)})
    store.wait()
    if r in corrupt:
        meta = next(store.directory.glob(f"snap-{corrupt[r]:010d}.*"))
        meta.write_bytes(meta.read_bytes()[:100])
    try:
        if groups is None:
            found = agree(store, after=after)
            return None if found is None else (found[0], found[1]["rank"])
        mine = None
        for members in groups:  # every rank creates every group, in the same order
            g = dist.new_group(members)
            if r in members:
                mine = g
        got = share_newest(store, None, mine, after, lambda s: {k: s[k] for k in ("rank", "w")})
        if got is None:
            return None
        step, state, exact = got
        return step, exact, state["rank"], float(state["w"][0]), "mine" in state
    finally:
        store.clear()


@pytest.mark.parametrize("held, corrupt, after, want", [
    ({0: [3, 4], 1: [4, 5]}, {}, 0, [(4, 0), (4, 1)]),        # killed while committing step 5
    ({0: [3, 4], 1: [3, 4]}, {1: 4}, 0, [(3, 0), (3, 1)]),     # unreadable on rank 1: both go back
    ({0: [3, 4], 1: [4, 5]}, {}, 4, [None, None]),            # the disk checkpoint is as new
    ({0: [1, 2], 1: []}, {}, 0, [None, None])])               # nothing in common
def test_ranks_agree_on_the_newest_common_readable_step(tmp_path, held, corrupt, after, want):
    from parlay.testing import run_world

    assert run_world(_held_world, 2, str(tmp_path), held, corrupt, after, timeout=60) == want


def test_replica_sends_the_shared_state_to_a_rank_without_snapshots(tmp_path):
    from parlay.testing import run_world

    # Replica groups {0, 2} and {1, 3} (a pipeline stage each): rank 2 has nothing, rank 3 only
    # an older step; step 4 is held in both groups, so ranks 0 and 1 send theirs.
    out = run_world(_held_world, 4, str(tmp_path), {0: [4], 1: [4], 2: [], 3: [3]}, {}, 0,
                    [[0, 2], [1, 3]], timeout=60)
    assert out == [(4, True, 0, 4.0, True), (4, True, 1, 4.0, True),
                   (4, False, 0, 4.0, False), (4, False, 1, 4.0, False)]
    # A group with no holder at all: nobody resumes from a snapshot.
    out = run_world(_held_world, 4, str(tmp_path), {0: [4], 1: [], 2: [], 3: []}, {}, 0,
                    [[0, 2], [1, 3]], timeout=60)
    assert out == [None] * 4
    # Step 4 is one step past the disk checkpoint (3): everyone resumes exactly from 3 instead
    # (rank 3 was killed before committing step 4 while the others committed theirs).
    out = run_world(_held_world, 4, str(tmp_path), {0: [3, 4], 1: [3, 4], 2: [3, 4], 3: [3]},
                    {}, 3, [[0, 2], [1, 3]], timeout=60)
    assert out == [None] * 4


# ---------------------------------------------------------------------- snapshots vs checkpoints
def _phase(ckpt_dir, steps, checkpoint_every, snapshot_every, finish):
    import torch.nn as nn
    from torch.utils.data import TensorDataset

    import parlay

    g = torch.Generator().manual_seed(11)
    x = torch.randn(44, 6, generator=g)
    t = parlay.Trainer(lambda: (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3),
                                              nn.Linear(16, 2)), nn.CrossEntropyLoss()),
                       TensorDataset(x, (x[:, :3].sum(1) > 0).long()),
                       optimizer_args={"lr": 1e-2}, batch_size=4, max_iteration=12,
                       checkpoint_dir=ckpt_dir, checkpoint_every=checkpoint_every,
                       snapshot_every=snapshot_every, compression="topk:0.3", progress=False)
    start = (t.state.step, t.resumed_from_snapshot)
    while t.state.step < steps:
        t.train_on_batch()
    if finish:
        t.should_stop()
    params = [p.detach().clone() for p in t.model.parameters()]
    t.close()  # without should_stop(): like a crash, the snapshots stay
    return start, params


@pytest.mark.parametrize("checkpoint_every, snapshot_every, run_id, want", [
    (3, 1, "job-a", (7, 7)),         # snapshot of step 7 is newer than the checkpoint of 6
    (2, 5, "job-a", (8, None)),      # checkpoint of step 8 is newer than the snapshot of 5
    (3, 1, "job-b", (6, None))])     # another job's snapshots are never read
def test_newer_of_snapshot_and_disk_checkpoint_wins(tmp_path, checkpoint_every, snapshot_every,
                                                    run_id, want):
    from parlay.testing import run_world

    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "job-a"}
    ck = str(tmp_path / "ckpt")
    run_world(_phase, 2, ck, 7 if snapshot_every == 1 else 8, checkpoint_every, snapshot_every,
              False, env=env, timeout=90)
    env["PARLAY_RUN_ID"] = run_id
    second = run_world(_phase, 2, ck, 12, checkpoint_every, snapshot_every, True, env=env,
                       timeout=90)
    full = run_world(_phase, 2, None, 12, None, 0, True, env=env, timeout=90)
    for (start, params), (_, want_params) in zip(second, full):
        assert start == want
        assert all(torch.equal(p, q) for p, q in zip(params, want_params))
    if run_id == "job-a":
        assert not [f for f in (tmp_path / "shm").rglob("*") if f.is_file()], "cleared at the end"


# ---------------------------------------------------------------------- a whole job killed
HOLD = textwrap.dedent('''
    import os, signal, sys, torch
    from parlay.snapshot import SnapshotStore, run_key
    if sys.argv[1] == "hold":  # snapshot, then wait to be killed with the launcher
        store = SnapshotStore(run_key("m"), int(os.environ["RANK"]))
        store.save(1, {"w": torch.ones(2)})
        print(f"ready {os.getpid()}", flush=True)
        signal.pause()
''')


def test_whole_job_sigkill_keeps_snapshots_until_the_next_launch_sweeps_them(tmp_path):
    import contextlib
    import signal

    (tmp_path / "hold.py").write_text(HOLD)
    shm = tmp_path / "shm"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "PARLAY_RUN_ID")}
    env.update(PARLAY_SNAPSHOT_DIR=str(shm), OMP_NUM_THREADS="1")
    user = shm / "my-job-0123456789ab" / "rank0"  # a run id the user chose: never swept
    user.mkdir(parents=True)
    cmd = [sys.executable, "-m", "parlay.cli", "run", "-n", "2", str(tmp_path / "hold.py")]
    p = subprocess.Popen([*cmd, "hold"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        pids = []
        while len(pids) < 2:
            line = p.stdout.readline()
            assert line, "the job ended before its ranks snapshotted"
            if line.startswith("ready "):
                pids.append(int(line.split()[1]))
    finally:  # the launcher's group, then its workers (torchrun gives each its own session)
        os.killpg(p.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.communicate(timeout=30)  # EOF once the workers, which share the pipe, are dead
    # Nothing removed them: a restart of the same run id could still read them.
    runs = [d for d in shm.iterdir() if d.is_dir() and d.name != "my-job-0123456789ab"]
    assert len(runs) == 1 and sorted(f.name for f in runs[0].rglob("snap-*")) == \
        ["snap-0000000001.s0.json"] * 2
    assert [f.name for f in shm.glob("*.owner")] == [runs[0].name[:-13] + ".owner"]
    # The next job on the host finds that run's processes all gone and sweeps it.
    q = subprocess.run([*cmd, "pass"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert q.returncode == 0, q.stderr[-3000:]
    assert sorted(p.name for p in shm.iterdir()) == ["my-job-0123456789ab"]


# ---------------------------------------------------------------------- verified state
def _flip_in_largest_tensor(path: Path) -> None:
    """Flip one bit in the middle of the largest tensor stored in the torch.save file ``path``."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    head = info.header_offset
    start = head + 30 + int.from_bytes(raw[head + 26:head + 28], "little") + \
        int.from_bytes(raw[head + 28:head + 30], "little")
    raw[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["snapshot", "checkpoint"])
def test_a_corrupt_newest_state_on_one_rank_is_never_resumed(tmp_path, where):
    """A flipped bit in rank 1's newest snapshot (or disk checkpoint) between the kill and the
    restart: both ranks resume from the newest state that verifies on both, with a warning that
    names the file, and finish with the weights of an uninterrupted run."""
    from parlay.testing import run_world

    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "job-v"}
    ck = str(tmp_path / "ckpt")
    snap, every = (1, 100) if where == "snapshot" else (0, 2)
    run_world(_phase, 2, ck, 8, every, snap, False, env=env, timeout=90)
    if where == "snapshot":
        record = next((tmp_path / "shm").rglob("rank1/snap-0000000008.s*.json"))
        victim = record.parent / f"data-{record.name.split('.s')[1].split('.')[0]}.pt"
    else:
        victim = Path(ck) / "ckpt-0000000008.rank1.pt"
    _flip_in_largest_tensor(victim)
    second = run_world(_phase, 2, ck, 12, every, snap, True, env=env, timeout=90)
    full = run_world(_phase, 2, None, 12, None, 0, True, env=env, timeout=90)
    want = (7, 7) if where == "snapshot" else (6, None)
    for (start, params), (_, want_params) in zip(second, full):
        assert start == want
        assert all(torch.equal(p, q) for p, q in zip(params, want_params))
