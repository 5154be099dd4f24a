"""DistributedOptimizer in hand-written loops: ``step(closure)`` reduces each call's gradients
and loss (L-BFGS trains as one process on the combined batch), and what would silently lose
or skip gradients is refused: a model converted after wrapping, a group added to the wrapped
optimizer, ``zero_grad()`` between accumulated passes, a second optimizer's hooks."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

N = 8  # samples per rank


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _batch(world: int, step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * N, 4, generator=g, dtype=torch.float64)
    return x, x[:, :2].sin()


def _closure_training(make, world: int, rank: int | None, **kwargs):
    """Three ``step(closure)`` steps: wrapped on this rank's shard, or (``rank=None``) one
    process on the whole batch. Returns the parameters and the losses step() returned."""
    model = _model()
    opt = make(model.parameters())
    if rank is not None:
        opt = parlay.DistributedOptimizer(opt, model.named_parameters(), **kwargs)
    losses = []
    for s in range(3):
        x, y = _batch(world, s)
        if rank is not None:
            x, y = x[rank * N:][:N], y[rank * N:][:N]

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        losses.append(float(opt.step(closure).detach()))
    if kwargs.get("shard"):
        with opt.gathered_parameters():
            return [p.detach().clone() for p in model.parameters()], losses
    return [p.detach().clone() for p in model.parameters()], losses


def _refused(f) -> str:
    try:
        f()
    except parlay.ConfigError as e:
        return str(e)
    return ""


def _everything():
    rank, world = parlay.rank(), parlay.size()
    x, y = _batch(world, 0)
    out: dict = {}

    def lbfgs(p):
        return torch.optim.LBFGS(p, lr=0.5, max_iter=4, line_search_fn="strong_wolfe")

    def sgd(p):
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)
    for name, make, kw in (("sgd", sgd, {}), ("lbfgs", lbfgs, {}),
                           ("sgd_shard", sgd, {"shard": "gradients"})):
        out[name] = (_closure_training(make, world, rank, **kw),
                     _closure_training(make, world, None))
    out["lbfgs_shard"] = _refused(lambda: _closure_training(lbfgs, world, rank, shard="optimizer"))

    # converted after wrapping: refused at backward (the reduced gradient used to be lost)
    for conv in ("double", "channels_last"):
        model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(8, 1))
        opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model.named_parameters())
        model.double() if conv == "double" else model.to(memory_format=torch.channels_last)
        img = torch.randn(2, 3, 4, 4, dtype=next(model.parameters()).dtype)
        out[conv] = _refused(lambda m=model, i=img: m(i).sum().backward())

    # a group added to the wrapped optimizer after wrapping: refused at step()
    model = _model()
    base = torch.optim.SGD(model[2].parameters(), lr=0.1)
    opt = parlay.DistributedOptimizer(base, model.named_parameters())
    base.add_param_group({"params": list(model[0].parameters())})
    F.mse_loss(model(x), y).backward()
    out["added_group"] = _refused(opt.step)
    opt.remove_hooks()

    # zero_grad() between the passes of backward_passes_per_step=2
    model = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters(), backward_passes_per_step=2)
    F.mse_loss(model(x), y).backward()
    out["zero_grad_mid"] = _refused(opt.zero_grad)
    F.mse_loss(model(x), y).backward()
    opt.step()

    # a second optimizer over the same parameters: refused until the first's remove_hooks();
    # optimizers over disjoint parameters (a GAN's) are fine
    second = _refused(lambda: parlay.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), model.named_parameters()))
    opt.remove_hooks()
    adam = parlay.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                       model.named_parameters())
    other = _model()
    parlay.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                other.named_parameters())
    for _ in range(2):
        adam.zero_grad()
        F.mse_loss(model(x[rank * N:][:N]), y[rank * N:][:N]).backward()
        adam.step()
    out["second"] = second
    out["switched"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_closures_reduce_and_misuse_that_lost_gradients_is_refused():
    a, b = run_world(_everything, 2)
    for out in (a, b):
        for name in ("sgd", "lbfgs", "sgd_shard"):
            (got, got_losses), (want, want_losses) = out[name]
            for p, q in zip(got, want):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10, msg=name)
            assert got_losses == pytest.approx(want_losses, rel=1e-10), name
        assert "L-BFGS needs norms" in out["lbfgs_shard"]
        for conv in ("double", "channels_last"):
            assert "'0.weight'" in out[conv] or "'2.bias'" in out[conv], out[conv]
            assert "gradient_as_bucket_view=False" in out[conv], out[conv]
        assert "add_param_group" in out["added_group"]
        assert "remove_hooks()" in out["added_group"]
        assert "backward_passes_per_step=2" in out["zero_grad_mid"]
        assert "remove_hooks()" in out["second"] and "another DistributedOptimizer" in out["second"]
    for p, q in zip(a["switched"], b["switched"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
