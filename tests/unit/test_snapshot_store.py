"""SnapshotStore: round trip, atomic commits, keep-N rotation, corruption, run keys."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch

from parlay.errors import CheckpointError, ConfigError
from parlay.snapshot import SnapshotStore, run_key

pytestmark = pytest.mark.timeout(60)


def _state(step: int, adam: bool = True) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(64, 80, generator=g)                    # 20 KB: in the mapped data slot
    opt: dict = {"state": {}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0],
                                                "foreach": None, "amsgrad": False}]}
    if adam:
        opt["state"][0] = {"step": torch.tensor(float(step)), "exp_avg": w * 0.5,
                           "exp_avg_sq": w * w}
    return {"trainer": {"step": step, "epoch": 1}, "mode": "allreduce",
            "strategy": {"model": OrderedDict(w=w, b=torch.arange(3.0)), "optimizer": opt},
            "rng": {"torch": g.get_state(), "gauss": None, "pos": 7},
            "nan": float("inf")}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b and type(a) is type(b)


def test_round_trip_and_independence_from_live_tensors(tmp_path):
    store = SnapshotStore("run-1", 0, root=tmp_path)
    live = _state(3)
    store.save(3, live)
    want = _state(3)
    live["strategy"]["model"]["w"].add_(1.0)               # training goes on right after save()
    live["strategy"]["model"]["b"].add_(1.0)
    got = store.load(3)
    assert _equal(got, want)
    assert isinstance(got["strategy"]["optimizer"]["state"], dict) and 0 in got["strategy"][
        "optimizer"]["state"], "int keys and tuples survive"
    assert store.latest()[0] == 3
    store.close()


def test_keeps_the_newest_two_in_two_slots(tmp_path):
    store = SnapshotStore("run-1", 1, root=tmp_path)
    for step in range(1, 6):
        store.save(step, _state(step, adam=step > 1))       # the layout changes after step 1
    store.wait()
    assert store.steps() == [4, 5]
    assert sorted(p.name for p in store.directory.iterdir()) == [
        "data-0.pt", "data-1.pt", "snap-0000000004.s1.json", "snap-0000000005.s0.json"]
    assert _equal(store.load(4), _state(4)) and _equal(store.load(5), _state(5))
    # A restarted process reopens the folder: the newest snapshot's slot is never reused next.
    store.close()
    again = SnapshotStore("run-1", 1, root=tmp_path)
    again.save(6, _state(6))
    again.wait()
    assert again.steps() == [5, 6] and _equal(again.load(5), _state(5))
    again.clear()
    assert not (tmp_path / "run-1").exists()


def test_a_step_saved_again_after_a_restart_keeps_the_step_before(tmp_path):
    """A restart resumed step 4 while this rank also held 5 (its peer was killed writing 5):
    saving 5 again overwrites the old 5 in its own slot, and 4 stays, which the peer resumes if
    it is killed at 5 again (it holds 4 alone)."""
    store = SnapshotStore("run-1", 0, root=tmp_path)
    for step in (3, 4, 5):
        store.save(step, _state(step))
    store.close()
    again = SnapshotStore("run-1", 0, root=tmp_path)
    assert again.records() == [(4, 1), (5, 0)]
    again.save(5, _state(50))
    assert again.records() == [(4, 1), (5, 0)]
    assert _equal(again.load(4), _state(4)) and _equal(again.load(5), _state(50))
    again.save(6, _state(6))                                  # then the rotation goes on
    assert again.records() == [(5, 0), (6, 1)]
    again.save(6, _state(60), replace=False)                  # ranks apart keep both of 6
    assert again.records() == [(6, 0), (6, 1)]
    again.close()


def test_leftover_temp_file_is_ignored_and_removed(tmp_path):
    store = SnapshotStore("run-1", 0, root=tmp_path)
    store.save(1, _state(1))
    store.close()
    tmp = store.directory / f".snap-{2:010d}.s1.json.tmp999"
    tmp.write_bytes(b"half a commit record")
    assert store.steps() == [1]
    SnapshotStore("run-1", 0, root=tmp_path)
    assert not tmp.exists()


@pytest.mark.parametrize("victim", ["snap-0000000002.s1.json", "data-1.pt"])
def test_truncated_files_raise_and_latest_falls_back(tmp_path, victim):
    store = SnapshotStore("run-1", 0, root=tmp_path)
    store.save(1, _state(1))
    store.save(2, _state(2))
    store.wait()
    path = store.directory / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="snapshot"):
        store.load(2)
    step, state = store.latest()
    assert step == 1 and _equal(state, _state(1))
    store.close()


_KILL_MID_COPY = textwrap.dedent('''
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_snapshot_store import _state
    from parlay.snapshot import SnapshotStore

    class KillOnCopy(torch.Tensor):
        """Dies (SIGKILL) when the store copies it: the slot is then half overwritten."""
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__torch_function__(func, types, args, kwargs or {})

    store = SnapshotStore("run-1", 0, root=sys.argv[1])
    store.save(1, _state(1))
    store.save(2, _state(2))
    third = _state(3)
    opt = third["strategy"]["optimizer"]["state"][0]
    opt["exp_avg_sq"] = opt["exp_avg_sq"].as_subclass(KillOnCopy)   # copied after "w", "exp_avg"
    store.save(3, third)
''')


def test_process_killed_mid_copy_keeps_the_previous_snapshot(tmp_path):
    script = tmp_path / "kill_mid_copy.py"
    script.write_text(_KILL_MID_COPY)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "shm"),
                        os.path.dirname(__file__)], capture_output=True, text=True, timeout=50)
    assert p.returncode == -signal.SIGKILL, p.stderr
    store = SnapshotStore("run-1", 0, root=tmp_path / "shm")
    assert store.steps() == [2], "step 1's slot was being overwritten: its record went first"
    assert _equal(store.load(2), _state(2))


def test_save_is_committed_on_return_and_refuses_what_it_cannot_map(tmp_path):
    store = SnapshotStore("run-1", 0, root=tmp_path)
    store.save(1, _state(1))
    assert store.steps() == [1]                            # nothing left pending
    store.wait()
    with pytest.raises(CheckpointError, match="dense tensors"):
        store.save(2, {"g": torch.eye(3).to_sparse()})
    assert store.steps() == [1] and _equal(store.load(1), _state(1))


def test_other_runs_and_bad_input(tmp_path):
    a = SnapshotStore("run-a", 0, root=tmp_path)
    a.save(1, _state(1))
    a.close()
    b = SnapshotStore("run-b", 0, root=tmp_path)
    assert b.steps() == [] and b.latest() is None
    for f in a.directory.iterdir():                        # another run's files copied over
        (b.directory / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match="run 'run-b'"):
        b.load(1)
    r1 = SnapshotStore("run-a", 1, root=tmp_path)          # rank 0's folder moved to rank 1's
    for f in a.directory.iterdir():
        (r1.directory / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match="written by rank 0, this is rank 1"):
        r1.load(1)
    with pytest.raises(CheckpointError, match="no snapshot of step 9"):
        b.load(9)
    with pytest.raises(CheckpointError, match="has a device"):
        b.save(2, {"x": torch.device("cpu")})
    with pytest.raises(ConfigError, match="key"):
        SnapshotStore("../escape", 0, root=tmp_path)
    with pytest.raises(ConfigError, match="keep"):
        SnapshotStore("run-c", 0, root=tmp_path, keep=0)


def test_run_key_needs_a_run_id_and_separates_identities(monkeypatch):
    for var in ("PARLAY_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    assert run_key("x") is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")      # torchrun's shared default
    assert run_key("x") is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a/job")
    k = run_key("x")
    assert k is not None and k.startswith("3f2a_job-") and k == run_key("x")
    assert run_key("y") != k


def _adam(monkeypatch, tmp_path, deferred: bool = True):
    """A stepped Adam model, its deferred tensors and a store (deferred copies on or off)."""
    from parlay.snapshot import optimizer_tensors

    model = torch.nn.Linear(640, 800)                      # 2 MB weight: several chunks
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.ones(2, 640)).sum().backward()
    opt.step()

    class Strategy:
        optimizer = opt

    monkeypatch.setenv("PARLAY_SNAPSHOT_BACKGROUND", "1" if deferred else "0")
    return model, opt, optimizer_tensors(Strategy()), SnapshotStore("run-1", 0, root=tmp_path)


def test_deferred_tensors_are_copied_before_the_next_optimizer_step(tmp_path, monkeypatch):
    model, opt, defer, store = _adam(monkeypatch, tmp_path)
    assert {p.data_ptr() for p in model.parameters()} <= defer
    want = {k: v.clone() for k, v in model.state_dict().items()}
    store.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, defer=defer)
    assert store.steps() == [], "not committed before the deferred copy"
    opt.step()                                             # finishes the copy, then changes
    assert store.steps() == [1]
    from parlay import idle
    assert not idle._local.queue, "finished work is not kept queued (nor what it holds)"
    assert not torch.equal(model.weight, want["weight"])
    got = store.load(1)["model"]
    assert all(torch.equal(got[k], want[k]) for k in want), "the pre-step values were kept"
    store.close()


@pytest.mark.parametrize("deferred", [False, True])
def test_last_save_s_is_the_time_a_finished_snapshot_took(tmp_path, monkeypatch, deferred):
    model, opt, defer, store = _adam(monkeypatch, tmp_path, deferred)
    assert store.last_save_s is None
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    store.save(1, state, defer=defer)
    if deferred:
        assert store.last_save_s is None, "the copy is not finished yet"
        opt.step()                                         # finishes it
    assert store.last_save_s is not None and store.last_save_s > 0
    store.close()


def test_deferred_copy_runs_in_chunks_while_waiting_for_communication(tmp_path, monkeypatch):
    from parlay import comm
    from parlay.snapshot.deferred import CHUNK_BYTES, DeferredCopy

    model, opt, defer, store = _adam(monkeypatch, tmp_path)
    chunks = []
    real_step = DeferredCopy.step
    monkeypatch.setattr(DeferredCopy, "step", lambda self: chunks.append(1) or real_step(self))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    store.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, defer=defer)
    done = comm.Handle(None, "test", lambda: "nothing to wait for")
    assert done.wait() == "nothing to wait for" and not chunks, "no work when nothing is pending"

    class InFlight:  # an operation that completes when the idle-time queue reaches it
        done = False

        def is_completed(self) -> bool:
            return self.done

        def wait(self) -> bool:
            return True

    work = InFlight()
    handle = comm.Handle(work, "allreduce", lambda: "reduced")
    from parlay.idle import while_waiting
    while_waiting(lambda: setattr(work, "done", True) or False)   # queued after the copy
    assert handle.wait() == "reduced"
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    assert len(chunks) > nbytes // CHUNK_BYTES, "copied a chunk per call, then committed"
    assert store.steps() == [1], "committed during the wait, before any optimizer step"
    chunks.clear()
    opt.step()
    assert not chunks and all(torch.equal(store.load(1)["model"][k], want[k]) for k in want)
    store.close()


def test_a_chunk_at_a_time(tmp_path):
    from parlay.snapshot.deferred import CHUNK_BYTES, DeferredCopy

    src = [torch.arange(float(CHUNK_BYTES // 2)), torch.ones(3, 4).t(), torch.tensor(7.0)]
    dst = [torch.zeros_like(t).contiguous() for t in src]
    commits = []
    job = DeferredCopy(list(zip(dst, src)), lambda: commits.append(1))
    assert job.step() and torch.equal(dst[0][: CHUNK_BYTES // 4], src[0][: CHUNK_BYTES // 4])
    assert not dst[0][CHUNK_BYTES // 4:].any(), "one chunk, not the whole tensor"
    job.finish()
    assert job.done and commits == [1] and all(map(torch.equal, dst, src))
    assert not job.step() and commits == [1], "committed once"


def test_a_failed_deferred_commit_is_reported_by_wait_not_by_the_optimizer(tmp_path,
                                                                          monkeypatch):
    import shutil

    model, opt, defer, store = _adam(monkeypatch, tmp_path)
    store.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, defer=defer)
    shutil.rmtree(store.directory)                         # e.g. /dev/shm cleaned under us
    opt.step()                                             # training goes on
    with pytest.raises(CheckpointError, match="could not write snapshot file"):
        store.wait()
    store.wait()                                           # reported once


def test_inline_copies_commit_before_save_returns(tmp_path, monkeypatch):
    model, opt, defer, store = _adam(monkeypatch, tmp_path, deferred=False)
    assert defer == set()
    store.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, defer=defer)
    assert store.steps() == [1]
    store.close()


def _create_and_clear(root: str, rank: int, rounds: int, start) -> int:
    start.wait(timeout=30)
    for step in range(rounds):
        store = SnapshotStore("race", rank, root=root)
        store.save(step, {"x": torch.full((4,), float(rank))})
        assert store.steps() == [step]
        store.clear()
    return rounds


def test_ranks_creating_and_clearing_the_same_run_concurrently_never_fail(tmp_path):
    # Each rank's clear() removes the shared run folder once it is empty, which can happen
    # between another rank's creating the run folder and its own folder inside it.
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ranks, rounds = 4, 300
    with ctx.Manager() as manager:
        start = manager.Barrier(ranks)
        with ctx.Pool(ranks) as pool:
            jobs = [pool.apply_async(_create_and_clear, (str(tmp_path), r, rounds, start))
                    for r in range(ranks)]
            assert [j.get(timeout=120) for j in jobs] == [rounds] * ranks
    assert not (tmp_path / "race").exists()


def test_snapshots_of_the_run_id_under_another_recipe_are_named_not_silently_left(
        tmp_path, caplog):
    old = SnapshotStore("job-0123456789ab", 0, root=tmp_path, live=True)
    old.save(3, _state(3))
    old.close()
    with caplog.at_level("WARNING", logger="parlay"):
        new = SnapshotStore("job-ba9876543210", 0, root=tmp_path, live=True)
        other_rank = SnapshotStore("job-ba9876543210", 1, root=tmp_path, live=True)
    warned = [r.getMessage() for r in caplog.records if "another configuration" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "job-0123456789ab" / "rank0") in warned[0]
    assert new.latest() is None and old.directory.is_dir()  # not used, not deleted
    new.close(), other_rank.close()
