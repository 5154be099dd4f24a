"""Hierarchical allreduce and hybrid placement on 2 simulated hosts x 2 ranks (real gloo ranks).

``run_world(..., local_world_size=2)`` gives the 4 ranks the environment torchrun gives 2 nodes
of 2 (``LOCAL_RANK``, ``GROUP_RANK``...), so the runtime sees two hosts; the traffic itself
stays on loopback (tests/dist/test_multinode.py runs it across real namespaces).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import parlay
from parlay.dp.hierarchical import Topology
from parlay.errors import ConfigError
from parlay.pipeline.hybrid import choose_placement
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, PER_RANK = 3, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Odd sizes, so buckets and shards do not divide evenly by the local size.
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(),
                         nn.Linear(5, 3)).double()


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(n, 7, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def _train(hierarchical, compression=None, bucket_cap_mb=0.0004, shard=None):
    m = _model()
    opt = parlay.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=m.named_parameters(),
                                      compression=compression, bucket_cap_mb=bucket_cap_mb,
                                      hierarchical=hierarchical, shard=shard, model=m)
    r = parlay.rank()
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s, parlay.size() * PER_RANK)
        sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
        nn.functional.mse_loss(m(x[sl]), y[sl]).backward()
        opt.step()
    with opt.gathered_parameters():
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
    return params, opt.hierarchical, opt.comm_stats(), len(opt.plan.buckets)


def _oracle(world: int) -> dict[str, torch.Tensor]:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s, world * PER_RANK)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in m.named_parameters()}


def _flat_and_hierarchical():
    return _train(False), _train(True), _train("auto")


def test_hierarchical_equals_flat_and_one_process_on_2_hosts_x_2():
    out = run_world(_flat_and_hierarchical, 4, local_world_size=2)
    ref = _oracle(4)
    n_params = sum(p.numel() for p in ref.values())
    for flat, hier, auto in out:
        assert (flat[1], hier[1], auto[1]) == (False, True, True), "auto picks it on 2 x 2"
        assert hier[3] > 1, "several buckets"
        for name in ref:
            torch.testing.assert_close(hier[0][name], flat[0][name], **TOL, msg=name)
            torch.testing.assert_close(hier[0][name], ref[name], **TOL, msg=name)
            torch.testing.assert_close(auto[0][name], ref[name], **TOL, msg=name)
        # Each rank's ring across 2 hosts carries its half of each bucket once (shards padded
        # to the local size): the host sends one model per step, not the flat ring's 1.5.
        cross = hier[2]["cross_host_bytes_per_step"]
        assert n_params * 8 / 2 <= cross <= (n_params + 2 * hier[3]) * 8 / 2
        assert hier[2]["dense_bytes_per_step"] == flat[2]["dense_bytes_per_step"] == n_params * 8


def _auto_only():
    return _train("auto")[1]


@pytest.mark.parametrize("local", [4, 1])
def test_auto_stays_flat_on_one_host_or_one_rank_per_host(local):
    assert run_world(_auto_only, 4, local_world_size=local) == [False] * 4


def _compressed():
    out = {}
    for comp in ("fp16", "powersgd:2"):
        flat, hier = _train(False, comp), _train(True, comp)
        out[comp] = (flat[0], hier[0], hier[1])
    try:
        _train(True, "topk:0.5")
    except ConfigError as e:
        out["topk"] = str(e)
    out["topk-auto"] = _train("auto", "topk:0.5")[1]
    return out


def test_summable_compressors_go_hierarchical_and_allgather_ones_refuse_or_stay_flat():
    for res in run_world(_compressed, 4, local_world_size=2):
        for comp in ("fp16", "powersgd:2"):
            flat, hier, used = res[comp]
            assert used
            for name in flat:  # fp16 sums in a different order: its own rounding
                torch.testing.assert_close(hier[name], flat[name], rtol=2e-3, atol=2e-3)
        assert "summed on the wire" in res["topk"] and "hierarchical='auto'" in res["topk"]
        assert res["topk-auto"] is False


def _bad_value():
    with pytest.raises(ConfigError, match="False, True or 'auto', got 'yes'"):
        _train("yes")


def test_bad_value_is_a_config_error():
    run_world(_bad_value, 2)


def test_topology_groups_ranks_by_host():
    t = Topology.from_node_ids([0, 0, 1, 1, 2, 2])
    assert t.hosts == ((0, 1), (2, 3), (4, 5)) and t.worthwhile
    assert t.local_group(3) == (2, 3) and t.cross_group(3) == (1, 3, 5)
    assert not Topology.from_node_ids([0, 0, 1]).uniform
    assert not Topology.from_node_ids([0, 1, 2, 3]).worthwhile
    assert not Topology.from_node_ids([0, 0, 0, 0]).worthwhile


def test_hybrid_placement_choice():
    assert choose_placement(2, 2, 2)[0] == "pp-local"          # a pipeline fits in a host
    assert choose_placement(4, 2, 2)[0] == "dp-local"          # it does not; replicas do
    assert choose_placement(2, 2, 4)[1].startswith("one host")
    # Byte estimates decide when both fit: big model, small activations -> pipelines cross.
    assert choose_placement(2, 2, 2, dp_bytes=1e8, pp_bytes=1e5)[0] == "dp-local"
    assert choose_placement(2, 2, 2, dp_bytes=1e5, pp_bytes=1e8)[0] == "pp-local"
    with pytest.raises(ConfigError, match="placement"):
        choose_placement(2, 2, 2, placement="near")


def _hybrid(placement):
    from parlay.pipeline import Pipeline
    from parlay.pipeline.hybrid import build_mesh

    mesh = build_mesh(2, placement=placement)
    pipe = Pipeline(_model(), nn.functional.mse_loss, stages=2, chunks=3, mesh=mesh)
    opt = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9))
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _batch(s, 2 * PER_RANK)
        sl = slice(mesh.dp_rank * PER_RANK, (mesh.dp_rank + 1) * PER_RANK)
        pipe.step(x[sl], y[sl])
        opt.step()
    return (mesh.placement, mesh.dp_rank, mesh.pp_rank,
            {n: p.detach().clone() for n, p in pipe.named_parameters()})


@pytest.mark.parametrize("placement", ["pp-local", "dp-local"])
def test_both_hybrid_placements_equal_one_process(placement):
    out = run_world(_hybrid, 4, placement, local_world_size=2)
    ref = _oracle(2)
    params: dict[str, torch.Tensor] = {}
    for rank, (where, dp_rank, pp_rank, p) in enumerate(out):
        assert where == placement
        expect = (rank // 2, rank % 2) if placement == "pp-local" else (rank % 2, rank // 2)
        assert (dp_rank, pp_rank) == expect
        params.update(p)
    for name in ref:
        torch.testing.assert_close(params[name], ref[name], **TOL, msg=name)



@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_sharded_host_first_equals_one_process_on_2_hosts_x_2(level):
    # Reduce-scatter inside each host, then across hosts per local rank (all-gather back):
    # every rank ends with 1/4 of each unit, and training equals the one-process oracle.
    ref = _oracle(4)
    for params, hier, _, _ in run_world(_train, 4, True, None, 0.0004, level,
                                        local_world_size=2):
        assert hier
        for name in ref:
            torch.testing.assert_close(params[name], ref[name], **TOL, msg=name)
