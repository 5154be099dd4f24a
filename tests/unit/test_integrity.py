"""Checksums of training state: equal across a save/load round trip, changed by any flipped bit."""
import io

import pytest
import torch

from parlay.integrity import state_crc, tensor_crc

pytestmark = pytest.mark.timeout(60)


def _state() -> dict:
    return {"model": {"w": torch.randn(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
            "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.1},
            "sampler": [1, None, "x"], "shape": torch.Size([2, 3])}


def test_round_trip_keeps_the_checksum() -> None:
    state = _state()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert state_crc(torch.load(buf, weights_only=True)) == state_crc(state)


@pytest.mark.parametrize("bit", [0, 7, 13, 31])
def test_any_flipped_bit_changes_it(bit: int) -> None:
    state = _state()
    before = state_crc(state)
    state["model"]["w"].view(-1).view(torch.int32)[100] ^= 1 << bit
    assert state_crc(state) != before


def test_plain_values_and_structure_count() -> None:
    a, b = _state(), _state()
    b["model"] = dict(a["model"])
    b["opt"] = {**a["opt"], "lr": 0.2}
    assert state_crc(b) != state_crc(a)
    assert state_crc({"x": [torch.ones(2)]}) != state_crc({"x": (torch.ones(2),)})


def test_tensor_crc_reads_non_contiguous_views() -> None:
    t = torch.arange(8, dtype=torch.float32)
    assert tensor_crc([t[::2]]) == tensor_crc([t[::2].clone()])
