"""``hvd.join()`` with ``DistributedOptimizer`` and uneven numbers of steps per rank: a joined
rank stands in for the others' gradient reductions with zeros (averages divide by the full
size, as in Horovod), the active ranks match single-process training of that rule (float64),
the joined rank keeps its weights, and ``join`` names the rank that joined last."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

TOL = dict(rtol=1e-10, atol=1e-10)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).repeat(1, 2).sin()


def _steps(rank: int) -> int:
    return (4, 2, 6)[rank]  # uneven: rank 1 joins first, rank 2 last


def _uneven(compression: str | None, metric: bool):
    import parlay.horovod as hvd

    r = hvd.rank()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(),
                                   compression=compression or hvd.Compression.none)
    for s in range(_steps(r)):
        opt.zero_grad()
        x, y = _batch(s, r)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if metric:  # an engine operation between steps, answered by the joined ranks too
            hvd.allreduce(loss.detach(), name="loss")
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(opt.compression.state_dict())
    last = hvd.join()
    after = [p.detach().clone() for p in model.parameters()]
    # join leaves gradients alone; the rank that joined last only ran the round every rank
    # mirrored after it, which is undone (with it, error feedback's residuals)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    if r == 2:
        _same(state, opt.compression.state_dict())
    x, y = _batch(0, 0)  # the ranks train on together after the join
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    return last, after, [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _reference(world: int, rank: int) -> list[torch.Tensor]:
    """Weights of rank ``rank`` at its join: the sum of the active ranks' gradients / world."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(_steps(rank)):
        opt.zero_grad()
        active = [q for q in range(world) if s < _steps(q)]
        loss = sum(F.mse_loss(model(_batch(s, q)[0]), _batch(s, q)[1]) for q in active) / world
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("metric", [False, True])
def test_joined_ranks_stand_in_for_the_optimizer_with_zeros(metric):
    out = run_world(_uneven, 3, None, metric, comm_timeout=20)
    assert [o[0] for o in out] == [2, 2, 2]  # rank 2 took the most steps
    for rank, (_, after, _) in enumerate(out):
        for got, want in zip(after, _reference(3, rank)):
            torch.testing.assert_close(got, want, **TOL)
    # after the join every rank reduces again (each from its own weights)
    for _, _, again in out:
        assert all(torch.isfinite(p).all() for p in again)


@pytest.mark.parametrize("compression", ["fp16", "powersgd:1", "topk:0.3"])
def test_join_mirrors_compressed_and_two_round_reductions(compression):
    out = run_world(_uneven, 3, compression, True, comm_timeout=20)
    assert [o[0] for o in out] == [2, 2, 2]
    assert all(torch.isfinite(p).all() for _, after, again in out for p in after + again)
    if compression == "fp16":  # the same rule, up to fp16's rounding of the gradients
        for rank, (_, after, _) in enumerate(out):
            for got, want in zip(after, _reference(3, rank)):
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


def _two_optimizers(uneven: bool):
    import parlay.horovod as hvd

    r = hvd.rank()
    a, b = _model(), _model()
    oa = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), a.named_parameters())
    ob = hvd.DistributedOptimizer(torch.optim.Adam(b.parameters(), lr=0.1),
                                  b.named_parameters())
    for s in range(3):  # a first phase with the first optimizer, then the second alone
        x, y = _batch(s, r)
        oa.zero_grad()
        F.mse_loss(a(x), y).backward()
        oa.step()
    for s in range(_steps(r) if uneven else 3):
        x, y = _batch(s, r)
        ob.zero_grad()
        F.mse_loss(b(x), y).backward()
        ob.step()
    return hvd.join(), [p.detach().clone() for p in b.parameters()]


@pytest.mark.parametrize("uneven", [False, True])
def test_join_stands_in_for_the_optimizer_being_stepped(uneven):
    out = run_world(_two_optimizers, 3, uneven, comm_timeout=20)
    assert [o[0] for o in out] == ([2, 2, 2] if uneven else [out[0][0]] * 3)
    if not uneven:  # the ranks stepped together: their weights agree
        for _, w in out[1:]:
            for got, want in zip(w, out[0][1]):
                assert torch.equal(got, want)


def _sharded():
    import parlay.horovod as hvd

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), shard="optimizer")
    try:
        hvd.join()
    except hvd.HorovodInternalError as e:
        return str(e)
    return None


def test_join_refuses_a_sharded_optimizer_by_name():
    for msg in run_world(_sharded, 2, comm_timeout=20):
        assert msg is not None and "sharded DistributedOptimizer" in msg and "Hint" in msg


def _active_rank_leaves():
    import parlay.horovod as hvd

    r = hvd.rank()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    hvd.allreduce(torch.zeros(1), name="warm-up")  # the engine's group is connected
    for s in range(3 if r == 0 else 1):
        opt.zero_grad()
        x, y = _batch(s, r)
        F.mse_loss(model(x), y).backward()
        opt.step()
    if r == 0:
        return "left without joining"  # its process ends: the joined rank must hear of it
    try:
        hvd.join()
    except hvd.HorovodInternalError as e:
        return str(e)
    return None


def test_a_joined_rank_hears_of_a_rank_that_left_instead_of_hanging():
    left, joined = run_world(_active_rank_leaves, 2, comm_timeout=5, timeout=60)
    assert left == "left without joining"
    assert joined is not None and "rank" in joined


def _in_turn():
    import warnings

    import parlay.horovod as hvd

    r = hvd.rank()
    a, b = _model(), _model()
    oa = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), a.named_parameters())
    ob = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), b.named_parameters())
    try:
        for s in range(3 if r == 0 else 1):  # a GAN's two optimizers, stepped in turn
            for model, opt in ((a, oa), (b, ob)):
                x, y = _batch(s, r)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            hvd.join()
    except (hvd.HorovodInternalError, parlay.CommError) as e:
        return str(e), [str(m.message) for m in w] if r else []
    return None


def test_join_does_not_guess_between_optimizers_stepped_in_turn():
    # mirroring the wrong one collided with the other rank's reductions (gloo abort); now the
    # joined rank says why it cannot stand in, and both ranks fail within the timeout
    active, joined = run_world(_in_turn, 2, comm_timeout=5, timeout=60)
    assert active is not None and joined is not None
    assert "cannot tell which" in joined[0] and "stepped in turn" in joined[0]
    assert any("cannot tell which" in m for m in joined[1])
