"""The one fp16 loss scaler on real gloo ranks: where ranks hold different gradients (pipeline
stages), an overflow on one rank makes every rank skip, and nobody unscales that step."""
from __future__ import annotations

import pytest
import torch

import parlay
from parlay.strategies.template import LossScaler
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _overflow_on_rank_one() -> tuple[bool, list[float], bool, bool, float]:
    me = parlay.rank()
    grads = [torch.full((4,), 8.0), torch.full((2,), float("inf") if me == 1 else 2.0)]
    agreed = LossScaler(4.0, agree=True)
    skipped = agreed.unscale_(grads)
    agreed.update(skipped)
    clean = [torch.full((3,), 8.0)]
    clean_skip = agreed.unscale_(clean)
    local = LossScaler(4.0, agree=False).unscale_([torch.full((2,), float("inf") if me else 1.0)])
    return skipped, grads[0].tolist(), clean_skip, local, agreed.scale


def test_one_rank_overflowing_makes_every_rank_skip():
    out = run_world(_overflow_on_rank_one, 2)
    for rank, (skipped, first, clean_skip, local, scale) in enumerate(out):
        assert skipped, rank
        assert first == [8.0] * 4, rank           # not unscaled: the step is skipped
        assert not clean_skip and scale == 2.0, rank
        assert local == (rank == 1)                # agree=False decides on this rank's values
