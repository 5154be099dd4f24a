"""RNG state save and restore (:mod:`parlay.rngstate`): what makes a resume bit-exact."""
from __future__ import annotations

import random

import numpy as np
import torch

from parlay.rngstate import rng_state, set_rng_state


def _draws() -> tuple:
    return (random.random(), random.gauss(0.0, 1.0), float(np.random.rand()),
            float(np.random.randn()), torch.rand(2).tolist())


def test_rng_state_reflects_every_draw():
    before = rng_state()
    random.random()
    np.random.rand()
    after = rng_state()
    assert not torch.equal(after["python"]["state"], before["python"]["state"])
    assert after["numpy"]["pos"] != before["numpy"]["pos"]
    set_rng_state(before)
    first = _draws()
    set_rng_state(after)
    second = _draws()
    set_rng_state(before)
    assert _draws() == first != second
    # NumPy's legacy Gaussian cache is used up without moving the generator: still seen.
    np.random.seed(0)
    random.seed(0)
    np.random.randn()
    cached = rng_state()["numpy"]
    np.random.randn()
    used = rng_state()["numpy"]
    assert (cached["has_gauss"], used["has_gauss"]) == (1, 0) and cached["pos"] == used["pos"]
    set_rng_state({**before, "numpy": cached})
    assert rng_state()["numpy"]["has_gauss"] == 1
    # Python's gauss() likewise caches its second value in the instance, outside the generator.
    random.gauss(0.0, 1.0)
    cached = rng_state()["python"]
    random.gauss(0.0, 1.0)
    used = rng_state()["python"]
    assert cached["gauss"] is not None and used["gauss"] is None
    assert torch.equal(cached["state"], used["state"])
    set_rng_state({**before, "python": cached})
    g = random.gauss(0.0, 1.0)
    set_rng_state({**before, "python": cached})
    assert random.gauss(0.0, 1.0) == g


def test_rng_state_survives_weights_only_load(tmp_path):
    st = rng_state()
    torch.save(st, tmp_path / "rng.pt")
    first = _draws()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draws() == first
