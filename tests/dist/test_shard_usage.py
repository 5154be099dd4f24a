"""DistributedOptimizer(shard=...) the way users drive it by hand: attention layers, optimizers
with state from construction, the full model read out, GradScaler, and clear refusals."""
from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay
from parlay.errors import ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

LEVELS = ("optimizer", "gradients", "parameters")


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 2)).double()


def _batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, world, 2, 5, 4, generator=g, dtype=torch.float64),
            torch.randn(3, world, 2, 5, 2, generator=g, dtype=torch.float64))


def _train(level: str | None, opt_cls: Any, world: int = 1) -> list[torch.Tensor]:
    """Three steps; with ``level``, this rank's share of each batch under shard=level."""
    m = _transformer()
    x, y = _batches(world)
    opt = opt_cls(m.parameters(), lr=0.01)
    if level is not None:
        opt = parlay.DistributedOptimizer(opt, m.named_parameters(), shard=level, model=m)
    for s in range(3):
        xs, ys = (x[s, parlay.rank()], y[s, parlay.rank()]) if level else \
            (x[s].reshape(-1, 5, 4), y[s].reshape(-1, 5, 2))
        opt.zero_grad()
        F.mse_loss(m(xs), ys).backward()
        opt.step()
    if level is None:
        return [p.detach().clone() for p in m.parameters()]
    with opt.gathered_parameters():
        state = m.state_dict()  # read after the block: the tensors must stay valid
    return [state[n] for n, _ in m.named_parameters()]


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, functools.partial(
    torch.optim.Adagrad, initial_accumulator_value=0.1)])
def test_attention_and_adagrad_train_as_one_process_at_every_level(opt_cls):
    # MultiheadAttention reads its out_proj's weights without calling out_proj; Adagrad makes
    # its state (here not zeros) in its constructor. The state read after gathered_parameters()
    # stays valid.
    ref = _train(None, opt_cls, 2)
    for level in LEVELS:
        for got in run_world(_train, 2, level, opt_cls, 2):
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _scaler_run(level: str | None) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                                      m.named_parameters(), shard=level, model=m)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    scales = []
    for s in range(3):
        opt.zero_grad()
        x = torch.ones(2, 4)
        if s == 0:
            x[:, 0] = 1e10  # only weight[0]'s scaled gradient overflows: rank 0's chunk
        scaler.scale(m(x).sum()).backward()
        opt.synchronize()
        opt.unscale_(scaler)  # the ranks agree whether to skip
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    with opt.gathered_parameters():
        return scales, [p.detach().clone() for p in m.parameters()]


def _scaler_recipes() -> dict:
    out = {}
    for name, level in (("plain", None), ("plain", "gradients"), ("synchronized", None),
                        ("synchronized", "gradients")):
        m = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(m.weight)
        opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0),
                                          m.named_parameters(), shard=level, model=m)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(m(torch.ones(1, 1)).sum()).backward()  # gradient 1 on every rank
        try:
            if name == "synchronized":
                opt.synchronize()
            scaler.step(opt)
            scaler.update()
            with opt.gathered_parameters():
                out[name, level] = m.weight.item()
        except ConfigError as e:
            out[name, level] = str(e)
            opt.synchronize()  # the reduction the refused step left behind
    return out


def test_grad_scaler_on_gradients_being_reduced_is_refused_not_stepped_scaled():
    # scaler.step(opt) right after backward stepped with the gradients times the scale (-1024)
    for got in run_world(_scaler_recipes, 2):
        assert "before this optimizer reduced them" in got["plain", None]
        assert "before this optimizer reduced them" in got["plain", "gradients"]
        assert got["synchronized", None] == -1.0
        assert "opt.unscale_(scaler)" in got["synchronized", "gradients"]


def test_grad_scaler_skips_the_same_steps_on_every_rank():
    ref = run_world(_scaler_run, 2, None)[0]
    assert ref[0][0] < 2.0 ** 100  # the overflow was seen and the step skipped
    for level in LEVELS:
        a, b = run_world(_scaler_run, 2, level)
        assert a[0] == b[0] == ref[0]
        for x, y, z in zip(a[1], b[1], ref[1]):
            assert torch.equal(x, y) and torch.equal(x, z)


def _usage(level: str) -> tuple[int, int, str]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                      m.named_parameters(), shard=level, model=m)
    opt.zero_grad()
    m(torch.randn(3, 64)).sum().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    try:
        parlay.broadcast_optimizer_state(opt, root_rank=0)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return len(buf.getvalue()), 64 * 64 + 64 + 64 * 4 + 4, refused


@pytest.mark.parametrize("level", LEVELS)
def test_a_saved_state_holds_this_rank_s_chunks_and_broadcasting_it_is_refused(level):
    for size, numel, refused in run_world(_usage, 4, level):
        # parameter chunk + momentum chunk: a quarter of two models each, not the whole model
        assert size < 4 * numel * 2 / 4 + 4096, size
        assert "shard=" in refused and "Hint:" in refused  # on every rank, nothing hangs


def _synchronize_then_step() -> list:
    out = []
    for level in (None, *LEVELS):
        m = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(m.weight)
        opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0),
                                          m.named_parameters(), shard=level, model=m)
        m(torch.ones(1, 1)).sum().backward()
        opt.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            opt.step()  # without skip_synchronize(): Horovod's warning, the same update
        m.zero_grad()  # model.zero_grad(), not opt's: p.grad leaves its bucket view
        m(torch.ones(1, 1)).sum().backward()
        opt.step()
        opt.step()  # no backward since: zero gradients ("optimizer" re-applied the last one)
        with opt.gathered_parameters():
            out.append(m.weight.item())
    with pytest.raises(ConfigError, match="Adasum does not combine with shard"):
        parlay.horovod.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0),
                                            m.named_parameters(), op=parlay.horovod.Adasum,
                                            shard="gradients", model=m)
    return out


def test_synchronize_then_step_and_model_zero_grad_apply_each_gradient_once():
    # a sharded optimizer applied zero gradients after synchronize(): its second finish()
    # reduced handed-back ones; after model.zero_grad(), "optimizer" re-applied the last
    # gradient at a step without backward (unsharded does, as documented: -3)
    for got in run_world(_synchronize_then_step, 2):
        assert got == [-3.0] + [-2.0] * len(LEVELS), got


def _levels_apart():
    m = nn.Linear(2, 2)
    try:
        parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), m.named_parameters(),
                                    shard=(None, "gradients")[parlay.rank()], model=m)
    except ConfigError as e:
        return str(e)
    return None


def test_ranks_passing_different_levels_are_refused_at_construction():
    # they met in mismatched collectives: a store timeout or a gloo abort
    for msg in run_world(_levels_apart, 2, comm_timeout=20):
        assert msg and "shard=None" in msg and "shard='gradients' on rank 1" in msg, msg
