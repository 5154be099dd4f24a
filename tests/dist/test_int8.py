"""The shared-scale int8 compressor on real gloo ranks: its sum equals the quantisation done by
hand, it never wraps, its error feedback loses nothing, and DiLoCo overlaps its second round."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import parlay
from parlay import comm
from parlay.compress import CommStats, Int8, get_compressor, reduce_async
from parlay.compress.reduce import local_round_trip
from parlay.errors import ConfigError
from parlay.local.diloco import DiLoCoOptimizer
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

N, STEPS = 300, 4


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(N, generator=g, dtype=torch.float64) * (1 + rank)


def _by_hand(world: int, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's error-corrected bucket quantised with the shared scale, summed."""
    res = [torch.zeros(N, dtype=torch.float64) for _ in range(world)]
    outs = []
    for s in range(steps):
        corrected = [_grad(r, s) + res[r] for r in range(world)]
        total = sum(float(c.abs().max()) for c in corrected)
        scale = total / (127 - math.ceil(world / 2))
        qs = [(c / scale).round() for c in corrected]
        res = [c - q * scale for c, q in zip(corrected, qs)]
        outs.append(sum(qs) * scale)
    return outs, res


def _reduce_steps() -> dict:
    rank = parlay.rank()
    c, stats = get_compressor("int8"), CommStats()
    outs = [reduce_async(_grad(rank, s), c, "b", stats=stats).wait() for s in range(STEPS)]
    same_sign = reduce_async(torch.ones(N, dtype=torch.float64) * (rank + 1), Int8(), "s").wait()
    nan = torch.zeros(N)
    nan[7] = float("nan") if rank == 1 else 0.0
    return dict(outs=outs, residual=c.state_dict()["memory"]["residual"]["b"],
                wire=stats.wire_bytes, same_sign=same_sign,
                nan=reduce_async(nan, Int8(), "n").wait())


@pytest.mark.parametrize("world", [2, 3])
def test_sum_equals_the_quantisation_by_hand_and_never_wraps(world):
    reports = run_world(_reduce_steps, world)
    hand, res = _by_hand(world, STEPS)
    for rank, rep in enumerate(reports):
        for got, want in zip(rep["outs"], hand):  # (3 ranks may sum the scale in another order)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        torch.testing.assert_close(rep["residual"], res[rank], rtol=0, atol=1e-12)
        # Error feedback: what was summed plus what every rank still owes is the true sum.
        true = sum(_grad(r, s) for r in range(world) for s in range(STEPS))
        owed = sum(r["residual"] for r in reports)
        torch.testing.assert_close(sum(rep["outs"]) + owed, true, rtol=0, atol=1e-12)
        assert rep["wire"] == STEPS * (16 + N)  # the scale round, then a byte per element
        # Every rank at its maximum with the same sign: the int8 sum stays in range (no wrap).
        want = world * (world + 1) / 2
        assert (rep["same_sign"] - want).abs().max() <= want / (127 - math.ceil(world / 2))
        assert rep["nan"].isnan()[7] and rep["nan"].isnan().sum() == 1  # shown, not hidden


def test_state_round_trip_and_refusals():
    a, b = Int8(), Int8()
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    local_round_trip(a, x, "k")
    b.load_state_dict(a.state_dict())
    assert torch.equal(local_round_trip(a, x, "k"), local_round_trip(b, x, "k"))
    b.load_state_dict({})  # a reset forgets what was owed
    assert "k" not in b.state_dict()["memory"]["residual"]
    assert get_compressor("int8:ef=0").memory is None
    with pytest.raises(ConfigError, match="unknown option"):
        get_compressor("int8:bits=4")
    with pytest.raises(ConfigError, match="parameter-server pushes"):
        parlay.DistributedSession(parlay.TaskSpec("worker", 0, ["a:1"], ["b:1"]),
                                  nn.Linear(2, 2), torch.optim.SGD, {"lr": 0.1},
                                  compression="int8")


def _diloco_overlap() -> dict:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), m.named_parameters(),
                          sync_every=4, overlap=2, compression="int8",
                          outer_optimizer_args={"lr": 1.0})
    g = torch.Generator().manual_seed(parlay.rank())
    x = torch.randn(64, 8, generator=g)
    y = x.sum(1, keepdim=True)
    losses, started_early = [], None
    for step in range(1, 21):
        opt.zero_grad()
        loss = (m(x) - y).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        comm.allreduce(torch.tensor([loss.item()]), "sum")  # other collectives, as a Trainer's
        flight = opt.fragments[0].flight
        if step == 5:  # the inner step after the send started the int8 round; merged at 6
            started_early = flight.handle.rounds.payload[0].dtype == torch.int8
    opt.sync_now()
    return dict(losses=losses, early=started_early, stats=opt.comm_stats(),
                weights=[p.detach().clone() for p in m.parameters()])


def test_diloco_overlaps_the_int8_round_and_trains():
    r0, r1 = run_world(_diloco_overlap, 2)
    assert r0["early"] and r1["early"]
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"]))
    assert r0["losses"][-1] < 0.5 * r0["losses"][0]
    st, n = r0["stats"], 8 * 16 + 16 + 16 + 1  # 161 parameters
    assert st["dense_bytes"] == st["reductions"] * 4 * n  # a byte each, and the scale round
    assert st["wire_bytes"] == st["reductions"] * (n + 16)


def _dp_int8() -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Linear(10, 3)
    opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      named_parameters=m.named_parameters(), compression="int8")
    g = torch.Generator().manual_seed(parlay.rank())
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


def test_data_parallel_replicas_stay_identical():
    w0, w1 = run_world(_dp_int8, 2)
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
