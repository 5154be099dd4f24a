"""``comm.group_device``: where the scalars, flags and metrics reduced over a group live.

Gloo groups (and ``"auto"``'s ``cpu:gloo,cuda:nccl``) reduce CPU tensors, so every flag stays
on the host; a NCCL-only group would need them on the GPU (not testable on this CPU machine:
the NCCL branch is covered by the static scan in ``tests/unit/test_collective_devices.py``,
which checks that every such site asks ``group_device``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlay
from parlay import comm, runtime
from parlay.compress.measure import agreed_max
from parlay.dp.functions import broadcast_optimizer_state
from parlay.metrics import Meter, reduce_meters
from parlay.testing import run_world
from parlay.trainer.evaluation import reduce_metrics

pytestmark = pytest.mark.timeout(60)


def _devices_and_reductions():
    me = parlay.rank()
    sub = runtime.new_group([0, 1])
    alone = runtime.new_group([0])  # rank 1 is no member: it has no transport there
    devices = [str(comm.group_device()), str(comm.group_device(sub)),
               str(comm.group_device(alone))]
    comm.barrier(sub)
    meter = Meter()
    meter.add(float(me + 1), weight=2.0)
    means = reduce_meters([meter], group=sub)
    metrics = reduce_metrics({"loss": 2.0 * (me + 1)}, 2, sub)
    most = agreed_max([float(me), 10.0 - me], sub)
    # Adam keeps its step counts on the CPU and its moments with the parameters: root's state
    # reaches the other rank through the group's device and lands where each tensor belongs.
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(me + 1):
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    broadcast_optimizer_state(opt, root_rank=0)
    steps = [float(s["step"]) for s in opt.state.values()]
    return devices, means, metrics, most, steps


def test_group_device_is_the_cpu_for_gloo_groups_and_reductions_agree():
    out = run_world(_devices_and_reductions, 2)
    for devices, means, metrics, most, steps in out:
        assert devices == ["cpu", "cpu", "cpu"]
        assert means == [1.5]
        assert metrics == {"loss": 1.5, "samples": 4.0}  # (2 + 4) / (2 + 2) samples
        assert most == [1.0, 10.0]
        assert steps == [1.0, 1.0], "rank 0's step counts on every rank"


def test_group_device_without_a_group_and_for_a_default_group_without_a_backend():
    assert not dist.is_initialized()
    assert comm.group_device() == torch.device("cpu")
    # A default group created without a backend reads "undefined" from get_backend; its
    # config still names the CPU transport.
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert str(dist.get_backend()) == "undefined"
        assert comm.group_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()
