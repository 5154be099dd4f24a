"""Pure pipeline pieces: partitioning, balancing, boundary checks, schedule registry."""
from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.nn as nn

from parlay.errors import ConfigError
from parlay.pipeline import (
    available_schedules,
    balance_by_cost,
    get_schedule,
    partition,
    theoretical_bubble,
)
from parlay.pipeline.partition import check_boundaries, param_costs
from parlay.pipeline.trace import trace_to_sequential

pytestmark = pytest.mark.timeout(60)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(),
                         nn.Linear(40, 3))


def brute_force(costs: list[float], stages: int) -> float:
    """Smallest bottleneck over every contiguous split (the oracle for the DP)."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = [0, *cuts, n]
        best = min(best, max(sum(costs[i:j]) for i, j in zip(b, b[1:])))
    return best


# -- balance_by_cost ---------------------------------------------------------------------------

@pytest.mark.parametrize("costs, stages", [
    ([1, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 2), ([1, 2, 3, 4, 5, 6, 7], 3),
    ([3, 0, 3, 0, 3, 0], 3), ([10, 1, 1, 1, 10], 3), ([2.5, 0.1, 7, 0.3, 0.3, 4, 4], 4),
    ([1] * 9, 9), ([4, 4], 1),
])
def test_balance_is_optimal_and_contiguous(costs, stages):
    bal = balance_by_cost(costs, stages)
    assert len(bal) == stages and sum(bal) == len(costs) and min(bal) >= 1
    bounds = list(itertools.accumulate([0, *bal]))
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(brute_force(costs, stages), rel=1e-9)


def test_balance_random_against_brute_force():
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        n = int(torch.randint(2, 9, (1,), generator=g))
        s = int(torch.randint(1, n + 1, (1,), generator=g))
        costs = torch.rand(n, generator=g).tolist()
        bal = balance_by_cost(costs, s)
        bounds = list(itertools.accumulate([0, *bal]))
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == pytest.approx(brute_force(costs, s), rel=1e-6)


def test_activation_layers_stay_with_their_linear():
    # Parameter count: Linear(784,800) | ReLU | Linear(800,800) | ReLU | Linear(800,10).
    model = nn.Sequential(nn.Linear(784, 800), nn.ReLU(), nn.Linear(800, 800), nn.ReLU(),
                          nn.Linear(800, 10))
    part = partition(model, 2, by="params")
    assert part.balance == (2, 3) and part.method == "params"
    assert part.stage_names(0) == ("0", "1")
    assert part.stage_costs() == [pytest.approx(sum(param_costs(list(model)[:2]))),
                                  pytest.approx(sum(param_costs(list(model)[2:])))]


def test_balance_by_time_follows_the_slow_layer():
    class Slow(nn.Module):  # a sleep: a cost the profile must see however loaded the host is
        def forward(self, x):
            time.sleep(0.03)
            return x * 1.0

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), Slow(), nn.Linear(64, 64))
    part = partition(model, 2, sample=torch.randn(32, 64), by="time")
    assert part.method == "time" and len(part.costs) == 4
    assert part.costs[2] >= 0.03                        # forward+backward of the slow layer
    # The split is the optimum for the measured costs (exact DP against brute force).
    assert max(part.stage_costs()) == pytest.approx(brute_force(list(part.costs), 2), rel=1e-6)


def test_balancing_by_time_leaves_batchnorm_statistics_as_they_were():
    # profiling runs every layer in training mode: it moved running_mean/var and counted
    # num_batches_tracked before the first step
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    partition(model, 2, sample=torch.randn(4, 5) * 3 + 2, by="time")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, fresh[k], rtol=0, atol=0, msg=k)


def test_build_shares_modules_and_keeps_names():
    model = mlp()
    part = partition(model, balance=[3, 2])
    s1 = part.build(model, 1)
    assert [n for n, _ in s1.named_parameters()] == ["4.weight", "4.bias"]
    assert s1[-1] is model[4]
    x = torch.randn(5, 6)
    torch.testing.assert_close(s1(part.build(model, 0)(x)), model(x))


def test_split_points():
    model = nn.Sequential()
    for name in ("embed", "act", "fc", "act2", "head"):
        model.add_module(name, nn.Identity())
    part = partition(model, split_points=["fc", "head"])
    assert part.balance == (2, 2, 1) and part.method == "split_points"
    assert partition(model, 3, split_points=["fc", "head"]).balance == (2, 2, 1)


# -- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(stages=6), r"cannot split a model of 5 layer\(s\) into 6 stages.*Hint"),
    (dict(stages=0), r"stages must be an int >= 1, got 0"),
    (dict(stages=2.0), r"stages must be an int >= 1"),
    (dict(balance=[2, 2]), r"balance \[2, 2\] sums to 4, but the model has 5 layers.*Hint"),
    (dict(balance=[2, 2, 2]), r"sums to 6, but the model has 5 layers"),
    (dict(stages=3, balance=[3, 2]), r"balance has 2 entries but stages=3.*Hint.*virtual_stages"),
    (dict(balance=[5, 0]), r"balance entries must be ints >= 1"),
    (dict(split_points=["9"]), r"not in the model: \['9'\]"),
    (dict(split_points=["0"]), r"first layer"),
    (dict(split_points=["3", "2"]), r"distinct and in model order"),
    (dict(stages=3, split_points=["2"]), r"make 2 stages, but stages=3.*pp x virtual_stages"),
    (dict(stages=2, by="time"), r"needs sample"),
    (dict(stages=2, by="bogus"), r"by must be one of"),
    (dict(balance=[3, 2], split_points=["2"]), r"either balance or split_points"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        partition(mlp(), **kwargs)


def test_not_sequential():
    with pytest.raises(ConfigError, match=r"expects an nn.Sequential, got Linear.*Hint"):
        partition(nn.Linear(2, 2), 1)


class DictOut(nn.Module):
    def forward(self, x):
        return {"h": x}


class FromDict(nn.Module):
    def forward(self, d):
        return d["h"]


class WithNone(nn.Module):
    def forward(self, x):
        return x, None


class Take(nn.Module):
    def forward(self, xs):
        return xs[0]


def test_non_tensor_boundary_is_refused_at_construction():
    model = nn.Sequential(nn.Linear(3, 3), DictOut(), FromDict(), nn.Linear(3, 1))
    with pytest.raises(ConfigError, match=r"stage 0 ends with layer '1', which returns a dict.*"
                                          r"tensor or a tuple of tensors.*Hint"):
        partition(model, balance=[2, 2], sample=torch.randn(4, 3))
    # Moving the boundary past the dict fixes it; the check reports what crosses.
    part = partition(model, balance=[3, 1], sample=torch.randn(4, 3))
    outs = check_boundaries(model, part, torch.randn(4, 3))
    assert outs[0].shape == (4, 3) and outs[1].shape == (4, 1)
    # The offending element of a tuple is named; the last stage's dict is refused too (torch's
    # pipelining would fail at the first step, its neighbour waiting out the timeout).
    with pytest.raises(ConfigError, match=r"layer '1', which returns a tuple whose element 1 "
                                          r"is None; a stage boundary"):
        partition(nn.Sequential(nn.Linear(3, 3), WithNone(), Take(), nn.Linear(3, 1)),
                  balance=[2, 2], sample=torch.randn(4, 3))
    with pytest.raises(ConfigError, match=r"last layer '1' returns a dict; .*Hint: return a "
                                          r"tensor or a tuple.*allreduce"):
        partition(nn.Sequential(nn.Linear(3, 3), DictOut()), 2, sample=torch.randn(4, 3))


def test_tuple_boundary_is_allowed():
    class Two(nn.Module):
        def forward(self, x):
            return x, 2 * x

    class Add(nn.Module):
        def forward(self, xy):
            return xy[0] + xy[1]

    model = nn.Sequential(Two(), Add())
    assert partition(model, 2, sample=torch.randn(2, 2), by="params").balance == (1, 1)


# -- tracing a non-Sequential model at split points ----------------------------------------------

class Residual(nn.Module):
    def __init__(self, skip_across: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.skip_across = skip_across

    def forward(self, x):
        h = torch.tanh(self.a(x))
        g = torch.relu(self.b(h))
        return self.c(g) + h[:, :3] if self.skip_across else self.c(g + h)


# torch.export inside pipeline() emits a FutureWarning of its own (pytree LeafSpec).
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trace_to_sequential_matches_the_model():
    model = Residual()
    seq = trace_to_sequential(model, ["b", "c"], torch.randn(2, 4))
    assert [n for n, _ in seq.named_children()] == ["stage0", "stage1", "stage2"]
    assert seq.stage1.gm.b.weight is model.b.weight    # shared, not copied
    x = torch.randn(5, 4)
    torch.testing.assert_close(seq(x), model(x))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trace_refuses_skips_across_stages():
    with pytest.raises(ConfigError, match=r"not produced by stage 1.*neighbouring stages"):
        trace_to_sequential(Residual(skip_across=True), ["b", "c"], torch.randn(2, 4))
    with pytest.raises(ConfigError, match=r"not in the model: \['nope'\]"):
        trace_to_sequential(Residual(), ["nope"], torch.randn(2, 4))


# -- schedules ---------------------------------------------------------------------------------

def test_schedule_registry():
    assert {"gpipe", "1f1b", "interleaved"} <= set(available_schedules())
    assert get_schedule("1F1B").name == "1f1b" and get_schedule("GPipe").name == "gpipe"
    assert not get_schedule("1f1b").accepts(2, 4) and get_schedule("1f1b").accepts(4, 4)
    assert get_schedule("1f1b").fallback == "gpipe"
    with pytest.raises(ConfigError, match=r"unknown pipeline schedule 'zb'; valid schedules: "):
        get_schedule("zb")


@pytest.mark.parametrize("s, m, v, want", [(2, 1, 1, 0.5), (4, 4, 1, 3 / 7), (4, 8, 1, 3 / 11),
                                           (1, 4, 1, 0.0), (4, 8, 2, 3 / 19)])
def test_theoretical_bubble(s, m, v, want):
    assert theoretical_bubble(s, m, v) == pytest.approx(want)


def test_interleaved_bubble_needs_whole_rounds():
    assert theoretical_bubble(4, 1, 2) == pytest.approx(3 / 4)   # no overlap with one chunk
    with pytest.raises(ConfigError, match=r"chunks % stages == 0, got chunks=6, stages=4"):
        theoretical_bubble(4, 6, 2)
