"""shard=: full gradient buckets freed once reduce-scattered, remove_hooks() then wrapping anew,
state of 0-dim parameters, empty units under fp16 and inf-norm clipping, clipping before
synchronize(), and tied weights in a rank's checkpoint. float64, against one process."""
from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay
from parlay.errors import ConfigError
from parlay.strategies.template import replicated_part
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

LEVELS = ("optimizer", "gradients", "parameters")


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.t


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "deep":
        return nn.Sequential(*[nn.Linear(4, 4) if i % 2 == 0 else nn.Tanh()
                               for i in range(12)]).double()
    # a 0-dim parameter registered last: it heads its unit (units go in backward order)
    return nn.Sequential(nn.Linear(4, 4), _Scale()).double()


def _train(kind: str, phases: list[tuple[Any, dict[str, Any]]], level: str | None,
           **wrap: Any) -> tuple[list[torch.Tensor], int, int]:
    """Two steps per phase, each phase a new optimizer (``remove_hooks()`` on the old one);
    one process on the whole batch when ``level`` is None. Returns the parameters, the most
    full gradient elements alive at once during backward and the largest (padded) unit."""
    model, world = _model(kind), parlay.size() if level else 2
    rank = parlay.rank() if level else 0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * len(phases), world, 3, 4, generator=g, dtype=torch.float64)
    y = x.sin()
    alive: list[weakref.ref[torch.Tensor]] = []
    peak = largest = 0
    opt: Any = None
    for k, (cls, kw) in enumerate(phases):
        if opt is not None and level:
            opt.remove_hooks()
        opt = cls(model.parameters(), **kw)
        if level:
            opt = parlay.DistributedOptimizer(opt, model.named_parameters(), shard=level,
                                              model=model, **wrap)
            eng = opt.shard_engine
            fill, largest = eng._fill, max(eng.chunk) * eng.world

            def counted(i: int, eng: Any = eng, fill: Any = fill) -> None:
                nonlocal peak
                fill(i)
                buf = eng.buffers[eng.plan.where[i][0]]
                if not any(r() is buf for r in alive):
                    alive.append(weakref.ref(buf))
                peak = max(peak, sum(t.numel() for t in (r() for r in alive) if t is not None))
            eng._fill = counted
        for s in (2 * k, 2 * k + 1):
            xs, ys = (x[s, rank], y[s, rank]) if level else (x[s].flatten(0, 1), y[s].flatten(0, 1))
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
    with opt.gathered_parameters() if level else torch.no_grad():
        return [p.detach().clone() for p in model.parameters()], peak, largest


def _equal(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


SGD = (torch.optim.SGD, dict(lr=0.1, momentum=0.9))
ADAM = (torch.optim.Adam, dict(lr=0.05))
ADAGRAD = (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.1))


@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_full_gradient_buckets_are_freed_once_reduced(level: str) -> None:
    ref = _train("deep", [SGD], None)[0]
    for got, peak, unit in run_world(_train, 2, "deep", [SGD], level, bucket_cap_mb=0.0002):
        _equal(got, ref)
        # 6 units of about a Linear(4, 4) each (120 elements in all): at most one being
        # filled and one on the wire at a time
        assert 0 < peak <= 2 * unit < 120, (peak, unit)


@pytest.mark.parametrize("kind, phases", [("deep", [SGD, ADAM]),  # remove_hooks(), wrap anew
                                          ("scaled", [ADAGRAD])])  # a 0-dim parameter heads
def test_rewrap_after_remove_hooks_and_adagrad_with_0dim_parameter(kind: str, phases: Any) -> None:
    ref = _train(kind, phases, None)[0]
    for level in LEVELS:
        for got, _, _ in run_world(_train, 2, kind, phases, level):
            _equal(got, ref)


def test_elementwise_state_keys_of_0dim_parameters() -> None:
    from parlay.dp.shard import _elementwise_keys
    scalars = [nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.tensor(2.0))]
    assert _elementwise_keys(torch.optim.Adagrad(scalars).state) == {"sum"}
    mixed = [*scalars, nn.Parameter(torch.ones(3))]
    assert _elementwise_keys(torch.optim.Adagrad(mixed).state) == {"sum"}


class _Empty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Linear(0, 0, bias=False)  # a unit of zero elements
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.empty(x[:, :0]).sum()


def _edges(level: str) -> tuple[str, list[float]]:
    torch.manual_seed(0)
    model, norms = _Empty().double(), []
    opt = parlay.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                      model.named_parameters(), shard=level, model=model,
                                      bucket_cap_mb=0.00001, compression="fp16")
    x = torch.randn(3, 4, dtype=torch.float64)
    F.mse_loss(model(x), x).backward()
    try:
        opt.clip_grad_norm_(0.01)
        early = "no error"
    except ConfigError as e:
        early = str(e)
    opt.synchronize()  # the order the error names
    norms.append(float(opt.clip_grad_norm_(0.01, float("inf"))))
    for bad in (0, float("-inf")):  # the chunks' zero padding would count: refused
        try:
            opt.clip_grad_norm_(0.01, bad)
        except ConfigError as e:
            assert "norm_type > 0 or inf" in str(e)
        else:
            raise AssertionError(f"norm_type={bad} was accepted")
    with opt.skip_synchronize():
        opt.step()
    return early, norms


def test_empty_unit_under_fp16_and_clipping_before_synchronize() -> None:
    for level in LEVELS:
        for early, norms in run_world(_edges, 2, level):
            assert "before opt.synchronize()" in early and "Fix:" in early, early
            assert "opt.synchronize(); opt.clip_grad_norm_" in early
            assert norms[0] > 0 and torch.isfinite(torch.tensor(norms)).all()


def test_tied_weight_left_out_of_a_ranks_model_state() -> None:
    emb, head = nn.Embedding(5, 3), nn.Linear(3, 5)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.BatchNorm1d(3), head)
    kept = replicated_part(model.state_dict(), model.named_parameters())
    assert "2.weight" not in kept and "0.weight" not in kept and "2.bias" not in kept
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(kept)
