"""Parameter servers with in-memory snapshots (sync): a SIGKILLed rank costs at most one step.

`parlay run -n 3 --ps 1 --max-restarts 1` runs a Trainer in mode="ps" (float64, SGD with
momentum, so the servers' optimizer state matters). On the first attempt either the server
dies right after an update, before any worker saw it, or a worker dies between two steps. The
agent restarts every rank; servers and workers agree on the newest step all of them hold in
host memory (or on disk, whichever is newer), the servers load their shards of that step and
the workers their Trainer state, and the final weights equal an uninterrupted run's bit for
bit. The agreement rule itself (snapshot vs disk, sync vs async/stale with workers that sit
out) is checked on real ranks with hand-made step lists.

async: a server killed after a worker was dropped comes back under `--max-restarts` from the
newest step the server and the surviving worker hold; the dropped worker joins and sits out.
"""
from __future__ import annotations

import pytest
import torch

from parlay.ps.consistency import Reply, ServerCore, get_consistency
from parlay.ps.recovery import agree_resume
from parlay.testing import run_world
from tests.dist.test_ps_restart import PS_CKPT_TRAINER, ROOT, _parlay_run
from tests.dist.test_snapshot import _run_script

pytestmark = pytest.mark.timeout(150)
STEPS = 8

SCRIPT = '''
    import os, signal, sys
    import torch
    import parlay

    root, out, ckpt, who, kill_step = sys.argv[1:6]
    kill_step = int(kill_step)
    sys.path.insert(0, root)
    from tests.dist.test_ps_trainer import BATCH, LR, _build, _dataset

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR, "momentum": 0.9}, batch_size=BATCH,
                       max_iteration=STEPS, warmup_epochs=0.5, progress=False, mode="ps",
                       checkpoint_dir=ckpt or None, checkpoint_every=3)
    rank = parlay.rank()
    server = t.strategy.session.server
    if server is not None and attempt == 0 and who == "server":
        apply = server.core._apply

        def apply_then_die(grads, lr):  # dies right after update `kill_step`, unanswered
            apply(grads, lr)
            if server.core.version + 1 == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)

        server.core._apply = apply_then_die
    print(f"attempt {attempt} rank {rank} start {t.state.step} "
          f"snapshot {t.resumed_from_snapshot}", flush=True)
    while not t.should_stop():
        if attempt == 0 and who == f"rank{rank}" and t.state.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        t.train_on_batch()
    torch.save([p.detach().clone() for p in t.model.parameters()], f"{out}/final-r{rank}.pt")
    print(f"attempt {attempt} rank {rank} finished at step {t.state.step}", flush=True)
'''.replace("STEPS", str(STEPS))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of every rank of an uninterrupted run (run_world: no launcher start-up)."""
    import textwrap

    tmp = tmp_path_factory.mktemp("ps-ref")
    (tmp / "script.py").write_text(textwrap.dedent(SCRIPT))
    run_world(_run_script, 3, str(tmp / "script.py"), str(ROOT), str(tmp), "", "none", "-1",
              env={"PARLAY_NUM_PS": "1"}, timeout=90)
    return [torch.load(tmp / f"final-r{r}.pt", weights_only=True) for r in range(3)]


@pytest.mark.parametrize("who, kill_step, disk", [("server", 5, True), ("rank2", 3, False)])
def test_killed_rank_resumes_from_snapshots_bit_identical(tmp_path, reference, who, kill_step,
                                                          disk):
    # Disk checkpoints every 3 steps (server case): the snapshot of step 4 is newer than the
    # checkpoint of step 3 and wins; the workers' older disk state is superseded.
    out, shm = tmp_path / "out", tmp_path / "shm"
    out.mkdir()
    p = _parlay_run(tmp_path, SCRIPT, str(ROOT), str(out), str(tmp_path / "ckpt") if disk else "",
                    who, str(kill_step), restarts=1, env={"PARLAY_SNAPSHOT_DIR": str(shm)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    starts = {line.split()[5] for line in p.stdout.splitlines()
              if line.startswith("attempt 1 rank ") and " start " in line
              and not line.startswith("attempt 1 rank 0 ")}
    assert len(starts) == 1, p.stdout
    resumed = int(starts.pop())
    assert kill_step - 1 <= resumed <= kill_step, p.stdout  # at most one step recomputed
    for r in (1, 2):
        assert f"attempt 1 rank {r} start {resumed} snapshot {resumed}" in p.stdout, p.stdout
        assert f"attempt 1 rank {r} finished at step {STEPS}" in p.stdout, p.stdout
    assert "attempt 0 rank 1 finished" not in p.stdout, "the first attempt was killed"
    for r in range(3):  # the server's copy of the model and both workers'
        got = torch.load(out / f"final-r{r}.pt", weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(got, reference[r])), f"rank {r} differs"
    assert not [f for f in shm.rglob("*") if f.is_file()], "snapshots are cleared at the end"
    if disk:  # snapshots never asked the servers for a disk checkpoint: only checkpoint steps
        steps = sorted(int(f.name.split(".step-")[1][:-3]) for f in (tmp_path / "ckpt" / "ps")
                       .glob("ps-0.step-*.pt"))
        assert steps and all(t % 3 == 0 or t == STEPS for t in steps), steps


# -- the agreement rule -------------------------------------------------------------------------
# Per case: (disk steps, snapshot steps) of rank 0 (the server) and ranks 1, 2 (workers),
# relaxed (async/stale), and the expected (step, from_snapshot, training workers).
CASES = {
    "snapshot newer than disk": ([([3], [4, 5]), ([3], [4, 5]), ([3], [3, 4])], False,
                                 (4, True, [1, 2])),
    "disk newer than snapshot": ([([6], [4, 5]), ([6], [4, 5]), ([6], [5])], False,
                                 (6, False, [1, 2])),
    "sync: every rank": ([([2, 4, 6], []), ([2, 4, 6], []), ([2], [])], False,
                         (2, False, [1, 2])),
    "async: a worker lost at 2 sits out": ([([6, 8, 10], []), ([6, 8, 10], []), ([2], [])],
                                           True, (10, False, [1])),
    "async: a worker lost before any file": ([([8, 10], []), ([8, 10], []), ([], [])], True,
                                             (10, False, [1])),
    "async: a worker ahead of the server": ([([6, 8], []), ([6, 8, 10], []), ([8, 10], [])],
                                            True, (8, False, [1, 2])),
}


def _agree(cases):
    import parlay

    r = parlay.rank()
    out = {}
    for name, (held, relaxed, _) in cases.items():
        disk, snaps = held[r]
        res = agree_resume(disk, snaps, is_worker=r > 0, tagged=r > 0, snapshots=r > 0 and
                           bool(snaps), relaxed=relaxed, group=None)
        out[name] = (res.step, res.from_snapshot, res.training)
    return out


def test_ranks_agree_on_one_step_and_who_trains():
    for got in run_world(_agree, 3, CASES):
        assert got == {name: want for name, (_, _, want) in CASES.items()}


# -- async: a server lost after a worker was dropped -------------------------------------------
DROP_THEN_SERVER = PS_CKPT_TRAINER + '''
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, s = parlay.rank(), t.strategy.session
    if s.server is not None and attempt == 0:
        apply = s.server.core._apply

        def apply_then_die(grads, lr):  # after worker 0's 9th push, long after rank 2 died
            apply(grads, lr)
            if s.server.core.clocks[0] == 9:
                os.kill(os.getpid(), signal.SIGKILL)

        s.server.core._apply = apply_then_die
    print(f"attempt {attempt} rank {rank} start {t.state.step} sits out {s.sits_out}", flush=True)
    while not t.should_stop():
        if attempt == 0 and rank == 2 and t.state.step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t.train_on_batch()
    print(f"attempt {attempt} rank {rank} done at step {t.state.step}", flush=True)
'''


@pytest.mark.parametrize("consistency", ["async"])
def test_server_killed_after_a_worker_was_dropped_resumes_without_it(tmp_path, consistency):
    # Rank 2 dies at step 3 (dropped: its newest file is step 2); the survivor and the server
    # checkpoint on (4, 6, 8); the server dies at the survivor's step 9. The restart resumes
    # step 8 without rank 2, which joins, sits out and finishes; the survivor ends at 12.
    p = _parlay_run(tmp_path, DROP_THEN_SERVER, str(tmp_path / "ckpt"), consistency,
                    restarts=1)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "rank 2 (droppable parameter-server worker) was lost" in p.stderr, p.stderr[-3000:]
    assert "attempt 0 rank 1 done" not in p.stdout, "the server's death stopped attempt 0"
    assert "attempt 1 rank 1 start 8 sits out False" in p.stdout, p.stdout
    assert "attempt 1 rank 2 start 0 sits out True" in p.stdout, p.stdout
    assert "attempt 1 rank 1 done at step 12" in p.stdout, p.stdout
    assert "attempt 1 rank 2 done at step 0" in p.stdout, p.stdout


def test_stale_survivor_is_released_once_the_worker_sitting_out_finished():
    # Resumed at the survivor's step 8 with the sitting-out worker's clock still at 2 (its
    # count when it was lost): under stale:1 the survivor waits for it only until its DONE,
    # which follows its hello at once.
    core = ServerCore(get_consistency("stale:1"), 2, 10.0, lambda g, f: None, 0.0, version=10,
                      clocks=[8, 2])
    assert core.hello(0, 0.0) == []
    assert core.hello(1, 0.0) == [Reply("params", 1)]
    assert core.done(1, 0.0) == [Reply("bye", 1), Reply("params", 0)]


def test_snapshot_key_reads_a_setting_given_as_1_or_as_1_0_alike(monkeypatch):
    # lr=1 in one launch and lr=1.0 in the restart is the same run; the key differed, so the
    # restart found no snapshot of its run.
    import types

    from parlay.ps import recovery

    seen: list[str] = []
    monkeypatch.setattr(recovery, "key_or_off", seen.append)
    monkeypatch.setattr(recovery.runtime, "size", lambda: 3)  # no process group needed
    for lr in (1, 1.0):
        recovery.open_snapshots(types.SimpleNamespace(
            num_servers=1, consistency=types.SimpleNamespace(name="sync"),
            plan=types.SimpleNamespace(rows=list), optimizer_cls=torch.optim.SGD,
            optimizer_args={"lr": lr, "momentum": 0.5}, compressor=None))
    assert len(seen) == 2 and seen[0] == seen[1]
