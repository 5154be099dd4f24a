"""The core's collectives run straight on c10d and never load parlay.horovod.

A Trainer in every mode, and the state broadcasts (``parlay.broadcast_parameters``, ...), must
leave ``parlay.horovod`` unimported and write no ``HOROVOD_*`` variable; the Horovod-named
functions (``parlay.allreduce``, ...) stay the very objects of ``parlay.horovod``. Also here:
the one reduce-op table of :mod:`parlay.reduce_ops`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlay
from parlay import comm
from parlay.errors import ConfigError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _horovod_traces() -> tuple[bool, list[str]]:
    return "parlay.horovod" in sys.modules, sorted(k for k in os.environ
                                                   if k.startswith("HOROVOD_"))


def _build():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), nn.CrossEntropyLoss()


def _train(mode: str, options: dict | None):
    assert _horovod_traces() == (False, []), "the rank started with parlay.horovod loaded"
    rng = np.random.default_rng(3)
    X, y = rng.random((32, 8)).astype(np.float32), rng.integers(0, 3, 32)
    trainer = parlay.Trainer(build_training_func=_build,
                             training_dataset=parlay.data.from_arrays(X, y),
                             optimizer=torch.optim.Adam, optimizer_args={"lr": 0.001},
                             batch_size=4, mode=mode, max_iteration=3, progress=False,
                             strategy_options=options)
    while not trainer.session.should_stop():
        trainer.train_on_batch()
    return parlay.role(), trainer.state.step, _horovod_traces()


@pytest.mark.parametrize("mode, world, env, options", [
    ("allreduce", 2, {}, None),
    ("ps", 3, {"PARLAY_NUM_PS": "1"}, None),
    ("hybrid", 2, {}, {"pp": 2}),
])
def test_a_trainer_never_loads_horovod_nor_writes_horovod_variables(mode, world, env, options):
    out = run_world(_train, world, mode, options, env=env, timeout=100)
    assert [traces for _, _, traces in out] == [(False, [])] * world
    assert all(step == 3 for role, step, _ in out if role == "worker")


def test_import_parlay_and_the_trainer_leave_horovod_unloaded():
    code = ("import sys, parlay; parlay.Trainer; parlay.Compression.fp16; parlay.compression; "
            "parlay.broadcast_parameters; parlay.Average; "
            "print('parlay.horovod' in sys.modules, end=' '); "
            "f = parlay.allreduce; import parlay.horovod as hvd; "
            "print('parlay.horovod' in sys.modules, f is hvd.allreduce, "
            "parlay.Compression is hvd.Compression, parlay.DistributedOptimizer is "
            "hvd.DistributedOptimizer)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=100, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    # Untouched until a Horovod name is used; then the re-exports are Horovod's own objects.
    assert p.stdout.split() == ["False", "True", "True", "True", "True"]


class _Members:
    """A process set as dp.functions sees one: its torch group and its global ranks."""

    def __init__(self, group, ranks):
        self._group, self._ranks = group, ranks

    def group(self):
        return self._group

    def global_ranks(self):
        return self._ranks


def _state_broadcasts():
    r = parlay.rank()
    torch.manual_seed(r)                         # every rank starts different
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    parlay.broadcast_parameters(model.state_dict(), root_rank=1)
    parlay.broadcast_optimizer_state(opt, root_rank=1)
    state = [t.clone() for t in model.state_dict().values()]
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    lr = opt.param_groups[0]["lr"]
    # A set of ranks {0, 2}: any object with group() and global_ranks() works.
    sub = dist.new_group([0, 2])
    members = _Members(sub, [0, 2]) if r in (0, 2) else None
    obj = parlay.broadcast_object({"from": r}, root_rank=2, process_set=members) if members \
        else None
    gathered = parlay.allgather_object(r * 10)
    in_group = parlay.allgather_object(r, process_group=sub) if r in (0, 2) else None
    return state, moments, lr, obj, gathered, in_group, _horovod_traces()


def test_state_broadcasts_run_on_c10d_without_horovod():
    out = run_world(_state_broadcasts, 3, timeout=90)
    for state, moments, lr, _, gathered, _, traces in out:
        for a, b in zip(state, out[1][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(moments, out[1][1], rtol=0, atol=0)
        assert lr == pytest.approx(0.2) and gathered == [0, 10, 20]
        assert traces == (False, [])
    assert out[0][3] == out[2][3] == {"from": 2} and out[1][3] is None
    assert out[0][5] == out[2][5] == [0, 2]


def _bad_roots():
    errors = []
    for call in (lambda: parlay.broadcast_parameters([torch.ones(1)], root_rank=5),
                 lambda: parlay.broadcast_object(1, root_rank=0, process_set=object()),
                 lambda: comm.allreduce(torch.ones(1), "mean")):
        try:
            call()
        except ConfigError as e:
            errors.append(str(e))
    return errors


def test_bad_roots_sets_and_ops_are_config_errors():
    [errs, _] = run_world(_bad_roots, 2, timeout=60)
    assert "root_rank must be a global rank in the process set [0, 1], got 5" in errs[0]
    assert "process_set must be a process set such as hvd.ProcessSet" in errs[1]
    assert "reduction op must be one of" in errs[2] and "'mean'" in errs[2]


def _reductions():
    r = parlay.rank()
    x = torch.tensor([1.0, -2.0]) * (r + 1)
    outs = {name: comm.allreduce(x.clone(), op) for name, op in [
        ("avg", "avg"), ("Average", parlay.Average), ("sum", parlay.Sum), ("max", "MAX"),
        ("min", comm.ReduceOp.Min), ("product", 5)]}
    h = comm.allreduce(x.clone(), parlay.Average, async_op=True)
    outs["async"] = h.wait()
    out = torch.empty(4)
    comm.all_gather_single(out, x)
    outs["gathered"] = out
    return outs


def test_the_one_reduce_op_table_names_and_horovod_ops_agree():
    out = run_world(_reductions, 2, timeout=60)
    for o in out:
        torch.testing.assert_close(o["avg"], torch.tensor([1.5, -3.0]))
        torch.testing.assert_close(o["Average"], o["avg"])
        torch.testing.assert_close(o["async"], o["avg"])
        torch.testing.assert_close(o["sum"], torch.tensor([3.0, -6.0]))
        torch.testing.assert_close(o["max"], torch.tensor([2.0, -2.0]))
        torch.testing.assert_close(o["min"], torch.tensor([1.0, -4.0]))
        torch.testing.assert_close(o["product"], torch.tensor([2.0, 8.0]))
        torch.testing.assert_close(o["gathered"], torch.tensor([1.0, -2.0, 2.0, -4.0]))


def test_reduce_op_table_maps_horovod_numbers_and_rejects_adasum_on_c10d():
    assert comm.reduce_op("AVG") is comm.ReduceOp.Average is parlay.Average
    assert comm.reduce_op(1) is parlay.Sum and comm.reduce_op("adasum") is parlay.Adasum
    assert comm.c10d_op(parlay.Average) == dist.ReduceOp.SUM
    with pytest.raises(ConfigError, match="Adasum has no torch.distributed reduction"):
        comm.c10d_op(parlay.Adasum)
    with pytest.raises(ConfigError, match="reduction op must be one of"):
        comm.reduce_op(True)


def _fusion_threshold():
    import parlay.horovod as hvd
    from parlay.horovod.optimizer import _bucket_cap_mb

    os.environ["HOROVOD_FUSION_THRESHOLD"] = str(3 * 2 ** 20)   # set after import
    try:
        hvd.allreduce(torch.ones(2), name="start")              # the engine starts now
        engine_bytes = hvd.global_process_set._engine.fusion_bytes
        cap = _bucket_cap_mb(None), _bucket_cap_mb(7.0)
    finally:
        del os.environ["HOROVOD_FUSION_THRESHOLD"]
    return engine_bytes, cap, _bucket_cap_mb(None)


def test_horovod_fusion_threshold_is_read_when_used_not_at_import():
    for engine_bytes, cap, default in run_world(_fusion_threshold, 2, timeout=60):
        assert engine_bytes == 3 * 2 ** 20
        assert cap == (3.0, 7.0) and default == 25
