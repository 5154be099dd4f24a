"""DistributedOptimizer.no_sync() against DDP's no_sync and single-process training; the
wrapper as a torch optimizer (hooks registered on it, shared containers); reduction handles
that tell the truth about completion and the collective."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parlay
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

# float64: only summation order differs from the oracles.
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, MICRO, PER = 3, 3, 4     # steps, micro-batches per step, samples per micro-batch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _data(world: int):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(STEPS, MICRO, world, PER, 5, generator=g, dtype=torch.float64)
    return x, x[..., :3].sin()


def _sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _loss(model, x, y, s, m, r):
    return F.mse_loss(model(x[s, m, r]), y[s, m, r])


def _parlay(how: str):
    """Train with MICRO micro-batches per step: 'no_sync' (all but the last inside no_sync),
    'no_sync_all' (every one inside, step() reduces), 'passes' (backward_passes_per_step), or
    'set_passes' (set after construction with set_backward_passes_per_step, the passes
    averaged and the learning rate times MICRO: the same SGD-with-momentum trajectory)."""
    r, world = parlay.rank(), parlay.size()
    model = _model()
    passes = MICRO if how == "passes" else 1
    averaged = how == "set_passes"
    opt = parlay.DistributedOptimizer(_sgd(model.parameters(), 0.1 * (MICRO if averaged else 1)),
                                      model.named_parameters(), backward_passes_per_step=passes,
                                      bucket_cap_mb=0.0002, average_aggregated_gradients=averaged)
    if how == "set_passes":
        opt.set_backward_passes_per_step(MICRO)
    x, y = _data(world)
    reductions = []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            silent = how == "no_sync_all" or (how == "no_sync" and m < MICRO - 1)
            before = opt.comm_stats()["reductions"]
            if silent:
                with opt.no_sync():
                    _loss(model, x, y, s, m, r).backward()
                reductions.append(opt.comm_stats()["reductions"] - before)
            else:
                _loss(model, x, y, s, m, r).backward()
        opt.step()
    return [p.detach() for p in model.parameters()], reductions


def _ddp():
    r, world = parlay.rank(), parlay.size()
    model = nn.parallel.DistributedDataParallel(_model())
    opt = _sgd(model.parameters())
    x, y = _data(world)
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO - 1):
            with model.no_sync():
                _loss(model, x, y, s, m, r).backward()
        _loss(model, x, y, s, MICRO - 1, r).backward()
        opt.step()
    return [p.detach() for p in model.module.parameters()]


def _single(world: int):
    # Average over ranks of the summed micro-batch losses == sum over micro-batches of the
    # mean loss over every rank's samples of that micro-batch.
    model = _model()
    opt = _sgd(model.parameters())
    x, y = _data(world)
    for s in range(STEPS):
        opt.zero_grad()
        sum(F.mse_loss(model(x[s, m].reshape(-1, 5)), y[s, m].reshape(-1, 3))
            for m in range(MICRO)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _everything():
    return {how: _parlay(how) for how in ("no_sync", "no_sync_all", "passes", "set_passes")}, \
        _ddp()


def test_no_sync_equals_ddp_single_process_and_backward_passes_per_step():
    ref = _single(2)
    for ranks in run_world(_everything, 2):
        runs, ddp = ranks
        for p, q in zip(ddp, ref):
            torch.testing.assert_close(p, q, **TOL)
        for how, (params, reductions) in runs.items():
            for p, q in zip(params, ref):
                torch.testing.assert_close(p, q, **TOL, msg=lambda m, how=how: f"{how}: {m}")
            # Hooks stayed silent inside no_sync: no bucket reduction started there.
            assert reductions == [0] * len(reductions), (how, reductions)


def _skip_synchronize_still_communicates():
    model = _model()
    opt = parlay.DistributedOptimizer(_sgd(model.parameters()), bucket_cap_mb=0.0002)
    x, y = _data(parlay.size())
    with opt.skip_synchronize():
        _loss(model, x, y, 0, 0, parlay.rank()).backward()
    started = opt.comm_stats()["reductions"]
    opt.step()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _loss(model, x, y, 1, 0, parlay.rank()).backward()
        with opt.no_sync():                    # too late: this step's reduction has started
            pass
    opt.step()
    return started, len(opt.plan.buckets), [str(m.message) for m in w]


def test_skip_synchronize_changes_only_step_and_late_no_sync_warns():
    for started, buckets, msgs in run_world(_skip_synchronize_still_communicates, 2):
        assert started == buckets > 1
        assert any("no_sync() entered after" in m for m in msgs), msgs


def _as_torch_optimizer():
    from parlay.horovod import DistributedOptimizer as HorovodOptimizer

    out = {}
    for cls in (parlay.dp.DistributedOptimizer, HorovodOptimizer):
        model = _model()
        opt = cls(torch.optim.Adam(model.parameters(), lr=0.1),
                  named_parameters=model.named_parameters())
        calls = []
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
        opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
        opt.register_state_dict_post_hook(lambda o, sd: sd.__setitem__("seen", True))
        opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        x, y = _data(parlay.size())
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for s in range(2):
                opt.zero_grad()
                _loss(model, x, y, s, 0, parlay.rank()).backward()
                opt.step()
                sched.step()
        sd = opt.state_dict()
        opt.optimizer.load_state_dict({k: v for k, v in sd.items() if k != "seen"})
        opt.load_state_dict({k: v for k, v in sd.items() if k != "seen"})
        out[cls.__module__] = dict(
            calls=calls, seen=sd.get("seen"), warnings=[str(m.message) for m in w],
            shared=(opt.param_groups is opt.optimizer.param_groups
                    and opt.state is opt.optimizer.state
                    and opt.defaults is opt.optimizer.defaults),
            lr=(opt.param_groups[0]["lr"], opt.optimizer.param_groups[0]["lr"]))
    return out


def test_hooks_registered_on_the_wrapper_fire_once_and_containers_stay_shared():
    for ranks in run_world(_as_torch_optimizer, 2):
        for where, got in ranks.items():
            assert got["calls"] == ["pre", "post", "pre", "post", "loaded"], where
            assert got["seen"] is True and got["shared"], where
            assert got["lr"] == (0.025, 0.025), where
            assert not [m for m in got["warnings"] if "lr_scheduler" in m], got["warnings"]


def _handles():
    import torch.distributed as dist

    from parlay.compress import get_compressor, reduce_async
    from parlay.dp.hierarchical import HierarchicalReducer, Topology

    r = parlay.rank()
    late = dist.new_group([0, 1])       # rank 1 joins each reduction only after rank 0 looked
    out = []
    for spec in ("none", "topk:0.5", "powersgd:1", "hier"):
        flat = torch.arange(8, dtype=torch.float32) + r
        if spec == "hier":
            red = HierarchicalReducer(None, Topology.from_node_ids([0, 0]))
            start = lambda: red.reduce_async(flat, get_compressor("none"), key="b")  # noqa: E731
        else:
            comp = get_compressor(spec)
            start = lambda: reduce_async(flat, comp, key="b")  # noqa: E731
        if r == 0:
            h = start()
            before = h.is_completed()
            parlay.comm.barrier(group=late)
        else:
            parlay.comm.barrier(group=late)
            h = start()
            before = False
        res = h.wait()
        out.append((spec, h.name, before, h.is_completed(), res.sum().item()))
    return out


def test_reduction_handles_report_completion_and_their_collective():
    for ranks in run_world(_handles, 2):
        names = {spec: name for spec, name, *_ in ranks}
        assert names == {"none": "allreduce", "topk:0.5": "allgather",
                         "powersgd:1": "allreduce", "hier": "hierarchical allreduce"}
        for spec, _, before, after, total in ranks:
            assert before is False and after is True, spec
            if spec in ("none", "topk:0.5", "hier"):   # exact sums (top-k keeps 4 of 8: 4+5+6+7 and 5+6+7+8)
                assert total == pytest.approx(64.0 if spec != "topk:0.5" else 48.0), spec
