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


def _fp16_trainer(compression: str | None) -> tuple[int, float, bool]:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                        100 * torch.randn(32, 4, generator=g))
    t = parlay.Trainer(lambda: (torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(),
                                                    torch.nn.Linear(64, 4)), torch.nn.MSELoss()),
                       ds, torch.optim.SGD, {"lr": 1e-3}, 4, precision="fp16",
                       compression=compression, num_epochs=2, progress=False, snapshot_every=0)
    t.train_to_end()
    state = t.strategy.optimizer.compression.state_dict()
    finite = all(torch.isfinite(v).all() for v in state.get("residual", {}).values())
    return t.skipped_steps, t.strategy.scaler.scale, finite


@pytest.mark.parametrize("compression", ["topk:0.05"])
def test_an_overflow_skipped_by_the_loss_scale_leaves_the_compressor_as_it_was(compression):
    # The overflow's inf went into the top-k residual for good: every
    # later step overflowed again and the loss scale fell to 1.
    plain = run_world(_fp16_trainer, 2, None)[0]
    assert plain[0] > 0  # the recipe overflows at the start
    for skipped, scale, finite in run_world(_fp16_trainer, 2, compression):
        assert (skipped, scale, finite) == (plain[0], plain[1], True)
