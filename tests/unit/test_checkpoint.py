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
