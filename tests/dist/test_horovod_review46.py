"""Review 46 of ``parlay.horovod``: the global set connects at the optimizer's first step (a
joined rank then waits per step, not in total), ``hvd.join()`` after a partial accumulation or
with ``opt.unscale_``, a failed join mirror, fusion thresholds that differ between ranks, one
name used for two kinds of operation, and refusals (``ElasticSampler`` before init, a sharded
optimizer in ``TorchState``)."""
from __future__ import annotations

import time

import pytest
import torch

from parlay.errors import ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)


def _first_step_connects():
    import parlay.horovod as hvd

    m = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    before = hvd.global_process_set._engine
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    eng = hvd.global_process_set._engine
    return before is None or before.group is None, eng is not None and eng.group is not None


def test_the_global_set_connects_at_the_optimizers_first_step():
    # so a rank that joins early waits for the others' next step, not for their join
    assert run_world(_first_step_connects, 2) == [(True, True)] * 2


def _partial(passes: tuple[int, int]):
    import parlay.horovod as hvd

    r = hvd.rank()
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   backward_passes_per_step=2)
    grad = torch.tensor([1.0, 10.0 * (r + 1)], dtype=torch.float64)
    opt.zero_grad()
    for k in range(passes[r]):
        (w * grad).sum().backward()
        if k % 2 == 1:
            opt.step()
            opt.zero_grad()
    pending = None if w.grad is None else w.grad.clone()
    hvd.join()
    assert (pending is None and w.grad is None) or torch.equal(pending, w.grad)
    if passes == (5, 5):  # the pending pass is kept: one more pass completes the step
        (w * grad).sum().backward()
        opt.step()
    return w.tolist()


@pytest.mark.parametrize("passes, want", [((5, 5), [-3.0, -45.0]), ((6, 3), None),
                                          ((4, 1), None)])
def test_join_after_a_partial_accumulation_leaves_it_as_it_is(passes, want):
    outs = run_world(_partial, 2, passes, comm_timeout=10, timeout=60)
    if want is not None:
        assert outs == [want, want]
    else:  # (1, 15) per step of both ranks; (0.5, 5) per step with the other rank joined
        full, alone = passes[1] // 2, passes[0] // 2 - passes[1] // 2
        assert outs[0] == [-full - 0.5 * alone, -15.0 * full - 5.0 * alone]


def _join_amp():
    import parlay.horovod as hvd

    r = hvd.rank()
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for s in range(3 if r == 0 else 1):
        opt.zero_grad()
        scaler.scale(m(torch.ones(2, 3) * (s + 1)).sum()).backward()
        opt.synchronize()
        opt.unscale_(scaler)  # reduced gradients: nothing to agree on, nothing to mirror
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return hvd.join()


def test_join_with_unscale_does_not_wait_for_an_unmirrored_collective():
    assert run_world(_join_amp, 2, comm_timeout=10, timeout=60) == [0, 0]


def _mirror_fails():
    import parlay
    import parlay.horovod as hvd
    from torch.distributed import distributed_c10d as c10d

    m = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    m(torch.ones(2, 3)).sum().backward()
    opt.step()  # (connects the engine)
    store = c10d._get_default_store()
    if parlay.rank() == 0:  # still "training": waits until the joined rank has failed
        store.wait(["r46-done"])
        return None

    def boom() -> None:
        raise RuntimeError("boom")

    opt._mirror_round = boom
    t0 = time.monotonic()
    try:
        hvd.join()
        out = ("no error", 0.0)
    except hvd.HorovodInternalError as e:
        out = (str(e), time.monotonic() - t0)
    store.set("r46-done", "1")
    return out


def test_a_failed_join_mirror_surfaces_at_once():
    _, (msg, took) = run_world(_mirror_fails, 2, comm_timeout=20, timeout=90)
    assert "mirroring the optimizer's reductions failed: boom" in msg and took < 10


def _fusion_differs():
    import os

    import parlay.horovod as hvd
    import torch.distributed as dist

    r = hvd.rank()
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "8" if r == 0 else str(64 * 2 ** 20)
    hs = [hvd.allreduce_async(torch.full((4,), float(i + r)), name=f"t{i}", op=hvd.Sum)
          for i in range(4)]
    named = [hvd.synchronize(h).tolist() for h in hs]
    inline = hvd.grouped_allreduce([torch.full((4,), float(i + r)) for i in range(4)],
                                   op=hvd.Sum, process_group=dist.group.WORLD)
    return named, [t.tolist() for t in inline]


def test_ranks_with_different_fusion_thresholds_agree():
    want = [[float(2 * i + 1)] * 4 for i in range(4)]
    assert run_world(_fusion_differs, 2) == [(want, want)] * 2


def _kinds():
    import parlay.horovod as hvd

    r = hvd.rank()
    t0 = time.monotonic()
    try:
        if r == 0:
            hvd.allreduce(torch.ones(2), name="z")
        else:
            hvd.allgather(torch.ones(2), name="z")
        msg = "no error"
    except hvd.HorovodInternalError as e:
        msg = str(e)
    took = time.monotonic() - t0
    # the same name for two kinds, in flight together in either order, still runs
    a = hvd.allreduce_async(torch.ones(1), name="y", op=hvd.Sum)
    b = hvd.allgather_async(torch.ones(1) * r, name="y")
    handles = [a, b] if r == 0 else [b, a]
    got = [hvd.synchronize(h).tolist() for h in handles]
    return msg, took, sorted(got)


def test_one_name_for_two_kinds_of_operation_fails_at_once():
    for msg, took, got in run_world(_kinds, 2, comm_timeout=20, timeout=90):
        assert "Mismatched operations for z: rank 0 ran allreduce, rank 1 allgather" in msg
        assert took < 10 and got == [[0.0, 1.0], [2.0]]


def test_elastic_sampler_needs_init():
    import parlay
    from parlay.horovod.elastic import ElasticSampler

    assert not parlay.is_initialized()
    with pytest.raises(ConfigError, match="has not been initialized"):
        ElasticSampler(list(range(4)))


def _sharded_state(level: str):
    import parlay.horovod as hvd

    m = torch.nn.Linear(3, 2)
    plain = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), shard=level, model=m)
    errors = []
    try:
        hvd.elastic.TorchState(m, opt, epoch=0)
    except ConfigError as e:
        errors.append(str(e))
    state = hvd.elastic.TorchState(m, plain, epoch=0)
    try:
        state.optimizer = opt
    except ConfigError as e:
        errors.append(str(e))
    return errors


@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_elastic_torch_state_refuses_a_sharded_optimizer(level):
    for errors in run_world(_sharded_state, 2, level):
        assert len(errors) == 2
        assert all(f"shard='{level}'" in e and "Hint" in e for e in errors)
