"""Verified state: a flipped byte anywhere in a checkpoint or snapshot is never loaded silently."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from parlay import checkpoint
from parlay.checkpoint import CheckpointManager
from parlay.errors import CheckpointError
from parlay.snapshot import SnapshotStore

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(300, 700, generator=g)          # 840 KB: more than one deferred-copy chunk
    return {"trainer": {"step": step, "epoch": 2, "lr": 0.1},
            "strategy": {"model": {"w": w, "b": torch.arange(5.0)},
                         "optimizer": {"state": {0: {"exp_avg": w * 0.5}},
                                       "param_groups": [{"lr": 0.1, "params": [0]}]}},
            "rng": {"pos": 7}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b and type(a) is type(b)


def _flip(path, offset: int, bit: int = 0) -> bytes:
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))
    return original


def _tensor_offset(path, t: torch.Tensor) -> int:
    """Offset of ``t``'s bytes inside a torch.save file (stored uncompressed)."""
    needle = t.reshape(-1)[:64].numpy().tobytes()
    at = path.read_bytes().find(needle)
    assert at > 0
    return at


def test_a_flipped_weight_byte_in_a_checkpoint_is_refused_and_the_previous_one_used(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3, rank=0)
    m.save(1, _state(1))
    m.save(2, _state(2))
    path = m.path(2)
    _flip(path, _tensor_offset(path, _state(2)["strategy"]["model"]["w"]) + 1000, bit=3)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        checkpoint.load(path)
    with pytest.warns(UserWarning, match=r"checkpoint step 2 is not usable.*fails its checksum"):
        got = CheckpointManager(tmp_path, keep_last=3, rank=0).load_latest()
    assert got["step"] == 1 and _equal(got["strategy"], _state(1)["strategy"])


def test_no_flipped_byte_anywhere_in_a_checkpoint_loads_silently(tmp_path):
    m = CheckpointManager(tmp_path, rank=0)
    path = m.save(3, _state(3))
    want = checkpoint.load(path)
    size = path.stat().st_size
    rng = random.Random(0)
    offsets = rng.sample(range(size), 40) + [_tensor_offset(path, want["strategy"]["model"]["b"])]
    for off in offsets:
        original = _flip(path, off, rng.randrange(8))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = checkpoint.load(path)
        except CheckpointError:
            pass
        else:  # a byte torch never reads (zip padding, a central-directory field)
            assert _equal(got, want), f"offset {off} changed the state without an error"
        path.write_bytes(original)


def test_old_checkpoints_without_checksum_still_load_with_a_warning(tmp_path, caplog):
    path = tmp_path / "ckpt-0000000001.rank0.pt"
    torch.save({"parlay_checkpoint": 1, "step": 1, "model": {"w": torch.ones(2)}}, path)
    with caplog.at_level("WARNING", logger="parlay"):
        assert checkpoint.load(path)["step"] == 1
    assert "predates checksums" in caplog.text
    torch.save({"parlay_checkpoint": checkpoint.FORMAT_VERSION, "step": 1}, path)
    with pytest.raises(CheckpointError, match="carries no checksum"):
        checkpoint.load(path)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_flipped_byte_in_a_snapshot_is_refused_and_the_previous_one_used(tmp_path, deferred):
    store = SnapshotStore("run-v", 0, root=tmp_path)
    for step in (1, 2):
        live = _state(step)
        defer = {t.data_ptr() for t in (live["strategy"]["model"]["w"],
                                        live["strategy"]["optimizer"]["state"][0]["exp_avg"])}
        store.save(step, live, defer=defer if deferred else frozenset())
        store.wait()
    assert _equal(store.load(2), _state(2))
    slot = sorted(store.directory.glob("snap-0000000002.*"))[0].name.split(".s")[1][0]
    data = store.directory / f"data-{slot}.pt"
    _flip(data, _tensor_offset(data, _state(2)["strategy"]["model"]["w"]) + 4 * 150_000, bit=6)
    with pytest.raises(CheckpointError, match=r"snapshot .*data-.* of step 2 fails its "
                                              r"checksum"):
        store.load(2)
    step, state = store.latest()
    assert step == 1 and _equal(state, _state(1))
    store.clear()


def test_no_flipped_byte_in_a_snapshot_record_or_data_loads_silently(tmp_path):
    store = SnapshotStore("run-v", 0, root=tmp_path)
    store.save(5, _state(5))
    want = _state(5)
    record = next(store.directory.glob("snap-*.json"))
    data = next(store.directory.glob("data-*.pt"))
    rng = random.Random(1)
    tries = [(record, off) for off in rng.sample(range(record.stat().st_size), 30)]
    tries += [(data, off) for off in rng.sample(range(data.stat().st_size), 30)]
    for path, off in tries:
        original = _flip(path, off, rng.randrange(8))
        try:
            got = SnapshotStore("run-v", 0, root=tmp_path).load(5)
        except CheckpointError:
            pass
        else:
            assert _equal(got, want), f"{path.name} offset {off} changed the state silently"
        path.write_bytes(original)
    store.clear()
