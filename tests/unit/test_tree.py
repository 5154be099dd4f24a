"""parlay._tree: the one walk over nested state (torch's pytree underneath)."""
from __future__ import annotations

import collections

import torch

from parlay._tree import map_tensors, tensors_in, tensors_with_paths, to_device

Pair = collections.namedtuple("Pair", "x n")


def _state() -> dict[str, object]:
    return {"state": {0: {"step": torch.tensor(1.0), "exp": torch.ones(2)}},
            "groups": [{"lr": 0.1, "params": [0]}], "shape": torch.Size([2, 3]),
            "pair": Pair(torch.zeros(1), 2), "od": collections.OrderedDict(a=torch.ones(1))}


def test_map_tensors_keeps_every_container_type_and_every_other_leaf() -> None:
    out = map_tensors(lambda t: t + 1, _state())
    assert out["state"][0]["step"].item() == 2.0 and out["groups"] == [{"lr": 0.1, "params": [0]}]
    assert type(out["shape"]) is torch.Size and out["shape"] == torch.Size([2, 3])
    assert type(out["pair"]) is Pair and out["pair"].n == 2 and out["pair"].x.item() == 1.0
    assert type(out["od"]) is collections.OrderedDict


def test_tensors_in_order_with_their_paths() -> None:
    state = _state()
    assert [t.shape for t in tensors_in(state)] == [(), (2,), (1,), (1,)]
    paths = [p for p, _ in tensors_with_paths(state)]
    assert paths == ["['state'][0]['step']", "['state'][0]['exp']", "['pair'].x", "['od']['a']"]
    assert tensors_in(torch.Size([1])) == [] and tensors_in(3) == []


def test_to_device_moves_a_tensor_or_a_nested_batch() -> None:
    t = torch.ones(2, dtype=torch.float64)
    assert to_device(t, "cpu") is t  # already there: torch returns the same tensor
    x, (y,) = to_device((t, [t]), torch.device("cpu"))
    assert x is t and y is t
    assert to_device({"a": 1}, "cpu") == {"a": 1}
