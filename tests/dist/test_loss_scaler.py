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


D, B, STEPS, BIG_STEP, LR = 8, 4, 6, 3, 0.125


def _owed_data():
    from parlay.data.sampler import ShardedSampler

    g = torch.Generator().manual_seed(1)
    x = torch.randint(-4, 5, (2 * B * STEPS, D), generator=g).float() / 4  # exact in fp16
    # one sample whose fp16 gradient overflows at the scale 1024: a true overflow
    x[ShardedSampler(len(x), 2, 1, seed=0).epoch_indices()[(BIG_STEP - 1) * B], 0] = 1000.0
    return x


def _owed_run():
    x = _owed_data()

    def build():
        m = torch.nn.Linear(D, 1, bias=False)
        torch.nn.init.zeros_(m.weight)
        return m, lambda out, y: out.float().mean()
    t = parlay.Trainer(build, [(v, torch.zeros(1)) for v in x], torch.optim.SGD, {"lr": LR}, B,
                       max_iteration=STEPS, scaling_learning_rate=False, progress=False,
                       precision="fp16", compression="topk:0.25",
                       strategy_options={"loss_scale": 1024.0})
    while not t.should_stop():
        t.train_on_batch()
    owed = t.strategy.optimizer.compression.state_dict()["residual"]
    return (t.model.weight.detach().double().flatten(), t.strategy.scaler.scale,
            sum(v.double() for v in owed.values()), t.skipped_steps)


def test_error_feedback_owes_in_the_loss_scale_of_the_moment():
    # sent + kept == produced across a loss-scale change: the residual, kept in units of the
    # scaled gradients, is rescaled with the scale (it was restored at the old one)
    from parlay.data.sampler import ShardedSampler

    x = _owed_data().double()
    shards = [ShardedSampler(len(x), 2, r, seed=0).epoch_indices() for r in range(2)]
    produced = sum(x[[i for s in shards for i in s[(k - 1) * B:k * B]]].mean(0)
                   for k in range(1, STEPS + 1) if k != BIG_STEP)
    out = run_world(_owed_run, 2)
    w, scale, _, skipped = out[0]
    assert (scale, skipped) == (512.0, 1)
    owed = sum(o[2] for o in out) / 2 / scale  # the ranks' residuals, averaged, unscaled
    torch.testing.assert_close(-w / LR + owed, produced, rtol=0, atol=1e-6)


def _accumulating(k: int) -> tuple[int, float, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g),
                                        torch.randint(0, 4, (96,), generator=g))
    t = parlay.Trainer(lambda: (torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                    torch.nn.Linear(16, 4)),
                                torch.nn.CrossEntropyLoss()),
                       ds, torch.optim.SGD, {"lr": 0.1}, 8, shuffle=False, precision="fp16",
                       max_iteration=6, progress=False, snapshot_every=0,
                       strategy_options={"backward_passes_per_step": k})
    t.train_to_end()
    return t.skipped_steps, t.strategy.scaler.scale, t.model[0].weight.detach().clone()


def test_micro_batches_see_the_loss_scale_of_one_pass():
    # Each pass was weighed k x (m/n) and the sum divided by k: the scaled gradients of a pass
    # were k times k=1's, so fp16 overflowed k times sooner (a skip and half the scale at k=4).
    skipped, scale, w = run_world(_accumulating, 2, 1)[0]
    for k in (2, 4):
        for got in run_world(_accumulating, 2, k):
            assert got[:2] == (skipped, scale) == (0, 2.0 ** 16)
            torch.testing.assert_close(got[2], w, rtol=0, atol=1e-4)


def _hand_loop_rescaling(comp, init, growth_interval):
    rank = parlay.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), compression=comp)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=growth_interval)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        opt.unscale_(scaler)
        with opt.skip_synchronize():
            scaler.step(opt)
        old = scaler.get_scale()
        scaler.update()
        if scaler.get_scale() != old:  # docs/modes.md: what error feedback owes follows
            opt.compression.rescale_owed(scaler.get_scale() / old)
    return model[0].weight.detach().clone()


@pytest.mark.parametrize("comp", ["topk:0.2", "powersgd:1"])
def test_hand_written_loop_rescaling_what_is_owed_is_independent_of_the_scale(comp):
    fixed = run_world(_hand_loop_rescaling, 2, comp, 2.0 ** 8, 10 ** 9)[0]
    growing = run_world(_hand_loop_rescaling, 2, comp, 2.0 ** 4, 1)[0]  # doubles every step
    assert torch.equal(fixed, growing)
