"""Checkpoint files: atomic writes, keep-last-N, fallback past corrupt files (one process)."""
from __future__ import annotations

import pytest
import torch

from parlay.checkpoint import CheckpointManager, load, save_atomic
from parlay.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((3, 3), v)}, "step_info": [1, 2.5, "x", None]}


def test_round_trip_and_keep_last(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2, rank=0)
    for step in (1, 2, 3, 4):
        m.save(step, _state(step))
    assert m.steps() == [3, 4]
    latest = m.load_latest()
    assert latest["step"] == 4 and torch.equal(latest["model"]["w"], torch.full((3, 3), 4.0))
    assert latest["step_info"] == [1, 2.5, "x", None]
    assert not list(tmp_path.glob(".*")), "no temporary files left"


def test_truncated_file_raises_and_the_previous_checkpoint_stays_usable(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3, rank=0)
    m.save(10, _state(1.0))
    m.save(20, _state(2.0))
    path = m.path(20)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load(path)
    with pytest.warns(UserWarning, match="step 20 is not usable"):
        latest = m.load_latest()
    assert latest["step"] == 10 and torch.equal(latest["model"]["w"], torch.full((3, 3), 1.0))


def test_failed_write_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "x.pt"
    save_atomic({"a": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="could not write"):
        save_atomic({"a": lambda: 0}, path)          # unpicklable: fails half-way
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"parlay_checkpoint": 1, "obj": _Custom()}, path)
    with pytest.raises(CheckpointError, match="weights_only"):
        load(path)


class _Custom:
    pass


def test_not_a_parlay_checkpoint(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="not a parlay checkpoint"):
        load(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "missing.pt")


def test_empty_directory_and_bad_keep_last(tmp_path):
    assert CheckpointManager(tmp_path / "new", rank=0).load_latest() is None
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0, rank=0)


def test_files_of_other_ranks_are_left_alone(tmp_path):
    a, b = CheckpointManager(tmp_path, keep_last=1, rank=0), CheckpointManager(tmp_path, rank=1)
    b.save(1, _state(0.0))
    a.save(1, _state(1.0))
    a.save(2, _state(2.0))
    assert a.steps() == [2] and b.steps() == [1]


def test_zero_byte_checkpoint_falls_back_to_the_previous_one(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3, rank=0)
    m.save(1, _state(1.0))
    m.save(2, _state(2.0))
    m.path(2).write_bytes(b"")                  # e.g. the disk filled up before the write
    with pytest.raises(CheckpointError, match=r"empty \(0 bytes\)"):
        load(m.path(2))
    with pytest.warns(UserWarning, match="step 2 is not usable"):
        latest = m.load_latest()
    assert latest["step"] == 1


def test_no_usable_checkpoint_is_refused_not_started_over(tmp_path):
    # starting at step 0 would have written over the corrupt files: the evidence gone
    m = CheckpointManager(tmp_path, keep_last=3, rank=0)
    m.save(3, _state(3.0))
    m.save(6, _state(6.0))
    for step in (3, 6):
        m.path(step).write_bytes(m.path(step).read_bytes()[:-100])
    with pytest.warns(UserWarning), pytest.raises(CheckpointError,
                                                  match="no checkpoint .* is usable.* 3, 6"):
        CheckpointManager(tmp_path, keep_last=3, rank=0).load_latest()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [m.path(3).name, m.path(6).name]


def test_random_bytes_are_reported_as_corrupt_not_as_a_weights_only_refusal(tmp_path):
    path = tmp_path / "noise.pt"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                                   dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError, match="not a valid checkpoint file") as info:
        load(path)
    assert "weights_only" not in str(info.value)


def test_pruning_never_removes_the_newest_good_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1, rank=0)
    m.save(9, _state(9.0))                      # left over from a later, abandoned timeline
    m.save(3, _state(3.0))                      # e.g. after falling back past step 9
    assert m.steps() == [3, 9], "the step just written is never pruned"
    m.save(4, _state(4.0))
    assert m.steps() == [4, 9]


def test_identity_mismatches_say_why_and_how_to_fix():
    from parlay.runinfo import describe_mismatch, fingerprint, model_layout

    small = model_layout(torch.nn.Linear(3, 4))
    big = model_layout(torch.nn.Linear(3, 5))
    base = {"mode": "allreduce", "world_size": 2, "dp_size": 2, "pp": 1, "batch_size": 4,
            "dp_rank": 0, "model_fingerprint": fingerprint(small), "model_layout": small}
    assert describe_mismatch(base, dict(base)) is None
    assert fingerprint(small) == fingerprint(model_layout(torch.nn.Linear(3, 4))), "no values"
    cases = {"world_size": (3, "this run has 3 rank(s)"), "batch_size": (8, "batch_size=4"),
             "mode": ("ps", "mode='allreduce'")}
    for key, (value, words) in cases.items():
        msg = describe_mismatch(base, {**base, key: value})
        assert msg is not None and words in msg and "Fix:" in msg
    msg = describe_mismatch(base, {**base, "model_fingerprint": fingerprint(big),
                                   "model_layout": big})
    assert "'weight' (4, 3) float32 in the checkpoint but 'weight' (5, 3) float32" in msg
    assert describe_mismatch({"mode": "allreduce"}, base) is None, "older checkpoints still load"
    # shard="parameters" checkpoints written before the layout was taken ahead of sharding
    # recorded its size-0 placeholders: still resumable; any other shape is not.
    emptied = [[n, [0] if n == "weight" else s, d] for n, s, d in small]
    old = {**base, "model_fingerprint": fingerprint(emptied), "model_layout": emptied}
    assert describe_mismatch(old, base) is None
    assert "different model architecture" in describe_mismatch(old, {
        **base, "model_fingerprint": fingerprint(big), "model_layout": big[:1]})


def test_a_compression_spelt_another_way_is_the_same_recipe():
    from parlay.compression import TopK
    from parlay.runinfo import recipe_difference, stable_repr

    def recipe(compression):
        return {"compression": stable_repr(compression), "optimizer": "'sgd'"}

    for now in ("topk:1e-2", TopK(ratio=0.01), "TOPK:0.010"):
        assert recipe_difference(recipe("topk:0.01"), recipe(now)) is None, now
    assert recipe_difference(recipe(None), recipe("none")) is None
    assert recipe_difference(recipe("topk:0.01"), recipe("topk:0.02")) == (
        "compression: TopK(ratio=0.01) then, TopK(ratio=0.02) now")


def test_directory_lock_refuses_another_process(tmp_path):
    import subprocess
    import sys

    from parlay.runinfo import DirLock

    mine = DirLock(tmp_path)
    assert mine.acquire({"run_id": "abc"}) is None
    again = DirLock(tmp_path)
    assert again.acquire({"run_id": "abc"}) is None, "the same process may lock again"
    # Another process (without torch, to stay quick): can it take the same POSIX lock?
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "try: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
             "except OSError: print('held by', open(sys.argv[1]).read())")
    def run():
        return subprocess.run([sys.executable, "-c", probe, str(tmp_path / ".lock")],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    assert run().startswith('held by {"pid": ') and '"run_id": "abc"' in run()
    again.release()
    assert run().startswith("held by"), "held until the last user releases it"
    mine.release()
    assert run() == "free"


def test_identity_and_run_id_are_recorded_and_checked(tmp_path):
    ident = {"mode": "allreduce", "world_size": 1, "batch_size": 4}
    m = CheckpointManager(tmp_path, rank=0, identity=ident)
    m.save(1, _state(1.0))
    m.save(2, _state(2.0))
    ids = {load(m.path(s))["identity"]["run_id"] for s in (1, 2)}
    assert len(ids) == 1, "one run id for the whole run"
    again = CheckpointManager(tmp_path, rank=0, identity=ident)
    assert again.load_latest()["step"] == 2 and again.run_id == ids.pop()
    other = CheckpointManager(tmp_path, rank=0, identity={**ident, "batch_size": 8})
    with pytest.raises(CheckpointError, match="batch_size=4 per replica.*Nothing was deleted"):
        other.load_latest()
    assert m.steps() == [1, 2]


def test_a_later_store_of_this_process_supersedes_one_left_open(tmp_path):
    # A Trainer stopped early (never finished nor closed), then a second one in the same
    # process: it was refused as "another live job", naming this process's own pid.
    from parlay.snapshot import SnapshotStore

    first = SnapshotStore("job-0123456789ab", 0, root=tmp_path, live=True)
    first.save(5, _state(5.0))
    second = SnapshotStore("job-ba9876543210", 0, root=tmp_path, live=True)  # another recipe
    assert not first.directory.exists(), "the superseded store's snapshots are cleared"
    with pytest.raises(CheckpointError, match="took over rank 0's snapshots"):
        first.save(6, _state(6.0))
    second.save(1, _state(1.0))
    second.close()
    assert second.steps() == [1]
