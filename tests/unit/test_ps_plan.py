"""Pure pieces of parameter-server mode, without a process group: ShardPlan placement, the
consistency policies and their bookkeeping (ServerCore), the wire format and argument checks."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from parlay.compress import get_compressor
from parlay.errors import ConfigError
from parlay.ps import DistributedSession, ShardPlan, get_consistency, max_lead
from parlay.ps.consistency import ServerCore, Update
from parlay.ps.wire import Message, Op, decode_ctx, encode_ctx, pack, probe, unpack

pytestmark = pytest.mark.timeout(60)

F32 = torch.float32


def _specs(*numels: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(f"p{i}", (n,), F32) for i, n in enumerate(numels)]


def _check_cover(plan: ShardPlan) -> None:
    """Every element of every parameter is held exactly once, and buffers are packed."""
    for pi, (name, shape, _) in enumerate(plan.params):
        ranges = sorted((p.start, p.length) for p in plan.all_pieces() if p.param == pi)
        pos = 0
        for start, length in ranges:
            assert start == pos
            pos += length
        assert pos == math.prod(shape), name
    for s in range(plan.num_servers):
        off = 0
        for p in plan.pieces(s):
            assert p.offset == off and p.server == s
            off += p.length
        assert off == plan.numel(s)


# -- ShardPlan ------------------------------------------------------------------------------
def test_balanced_by_bytes_is_greedy_largest_first():
    plan = ShardPlan(_specs(100, 60, 50, 40, 10), 2, split_bytes=None)
    # Largest first to the lighter server: 100 -> s0, 60 -> s1, 50 -> s1 (60 < 100),
    # 40 -> s0 (100 < 110), 10 -> s1 (110 < 140); final loads 140 and 120 elements.
    assert [p.name for p in plan.pieces(0)] == ["p0", "p3"]
    assert [p.name for p in plan.pieces(1)] == ["p1", "p2", "p4"]
    assert plan.nbytes(0) == 140 * 4 and plan.nbytes(1) == 120 * 4
    _check_cover(plan)


def test_balanced_beats_round_robin_on_skewed_sizes():
    sizes = (1000, 10, 10, 10, 900, 10)
    bal = ShardPlan(_specs(*sizes), 2, split_bytes=None)
    rr = ShardPlan(_specs(*sizes), 2, placement="round_robin", split_bytes=None)
    def spread(p: ShardPlan) -> int:
        return max(p.nbytes(s) for s in range(2)) - min(p.nbytes(s) for s in range(2))

    assert spread(bal) < spread(rr)
    assert [p.name for p in rr.pieces(0)] == ["p0", "p2", "p4"]  # model order, i % 2
    assert [p.name for p in rr.pieces(1)] == ["p1", "p3", "p5"]
    _check_cover(rr)


def test_large_tensor_is_split_over_distinct_servers():
    model = nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 3))  # weight0: 600 floats = 2400 B
    plan = ShardPlan.from_module(model, 3, split_bytes=1000)
    servers = plan.servers_of("0.weight")
    assert len(servers) == 3 and len(set(servers)) == 3
    chunks = sorted((p for p in plan.all_pieces() if p.name == "0.weight"), key=lambda p: p.start)
    assert [c.length for c in chunks] == [200, 200, 200]
    assert all(c.shape == (200,) for c in chunks)  # chunks are 1-D on the server
    assert [p.shape for p in plan.all_pieces() if p.name == "1.weight"] == [(3, 20)]  # whole
    _check_cover(plan)


def test_split_never_exceeds_servers_and_one_server_holds_all():
    plan = ShardPlan(_specs(10_000), 2, split_bytes=4)
    assert len(list(plan.all_pieces())) == 2
    one = ShardPlan(_specs(10_000, 7), 1, split_bytes=4)
    assert [(p.name, p.length) for p in one.pieces(0)] == [("p0", 10_000), ("p1", 7)]
    _check_cover(plan)


def test_plan_is_deterministic_and_frozen_params_stay_local():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    a = ShardPlan.from_module(model, 2, split_bytes=64)
    b = ShardPlan.from_module(model, 2, split_bytes=64)
    assert a.rows() == b.rows()
    assert "0.bias" not in {p.name for p in a.all_pieces()}
    assert "ps0:" in a.describe()


@pytest.mark.parametrize("kw, match", [
    ({"num_servers": 0}, "num_servers must be an int >= 1"),
    ({"placement": "random"}, "placement must be one of"),
    ({"split_bytes": 0}, "split_bytes must be a positive int"),
])
def test_plan_rejects_bad_arguments(kw, match):
    args = {"num_servers": 2, **kw}
    n = args.pop("num_servers")
    with pytest.raises(ConfigError, match=match):
        ShardPlan(_specs(4), n, **args)


def test_plan_rejects_model_without_trainable_parameters():
    m = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        ShardPlan.from_module(m, 1)


# -- consistency policies -------------------------------------------------------------------
def test_policy_registry_spellings():
    assert get_consistency("sync").aggregate and get_consistency("sync").bound == 0
    assert get_consistency("async").bound is None
    assert get_consistency("stale:3").bound == 3 and get_consistency("Stale:0").bound == 0
    for bad, match in [("stale", "needs a bound"), ("stale:-1", "integer >= 0"),
                       ("stale:x", "integer >= 0"), ("bsp", "unknown consistency"),
                       ("async:2", "takes no option")]:
        with pytest.raises(ConfigError, match=match):
            get_consistency(bad)


class _Log:
    def __init__(self):
        self.applied: list[tuple[list, float]] = []

    def __call__(self, grads, lr):
        self.applied.append((list(grads), lr))


def test_core_sync_applies_one_averaged_update_per_round():
    log = _Log()
    core = ServerCore(get_consistency("sync"), 2, 10.0, log, now=0.0)
    assert [r.kind for r in core.hello(0, 0.0)] == ["params"]
    assert [r.worker for r in core.hello(1, 0.0)] == [1]
    assert core.push(1, 0, 0, "g1", 1.0, 1.0) == []  # held: worker 0 has not pushed
    out = core.push(0, 0, 0, "g0", 1.0, 1.0)
    assert log.applied == [(["g0", "g1"], 1.0)]  # worker order, one update
    assert sorted(r.worker for r in out) == [0, 1] and core.version == 1
    assert core.histogram == {0: 2}


def test_core_stale_holds_the_fast_worker_and_releases_on_catch_up():
    core = ServerCore(get_consistency("stale:1"), 2, 10.0, _Log(), now=0.0)
    core.hello(0, 0.0), core.hello(1, 0.0)
    assert [r.worker for r in core.push(0, 0, 0, "a", 1.0, 0.1)] == [0]  # clock 1 vs 0: ok
    assert core.push(0, 1, 1, "b", 1.0, 0.2) == []  # clock 2 vs 0: held
    out = core.push(1, 0, 0, "c", 1.0, 0.3)  # slowest moves to 1: both may go
    assert sorted(r.worker for r in out) == [0, 1]
    assert [u.staleness for u in core.log] == [0, 0, 2]


def test_core_lost_worker_unblocks_stale_and_fails_sync():
    stale = ServerCore(get_consistency("stale:0"), 2, 5.0, _Log(), now=0.0)
    stale.hello(0, 0.0), stale.hello(1, 0.0)
    assert stale.push(0, 0, 0, "a", 1.0, 1.0) == []  # waits for worker 1
    # worker 0 is told to wait on at t=3.5 (half the timeout), and every 2.5 s after; worker 1
    # (released at t=0) is lost at t=5, which releases worker 0
    assert stale.next_deadline() == 3.5 and stale.expire(3.4) == []
    assert [(r.kind, r.worker) for r in stale.expire(3.5)] == [("wait", 0)]
    assert stale.next_deadline() == 5.0
    out = stale.expire(5.0)
    assert [r.worker for r in out] == [0] and stale.lost == [1]
    sync = ServerCore(get_consistency("sync"), 3, 5.0, _Log(), now=0.0)
    for w in range(3):
        sync.hello(w, 0.0)
    sync.push(0, 0, 0, "a", 1.0, 1.0)
    out = sync.expire(5.0)  # workers 1 and 2 both silent
    assert [(r.kind, r.worker, r.peer) for r in out] == [("error", 0, 1)]
    assert sync.push(2, 0, 0, "late", 1.0, 6.0)[0].kind == "error"  # worker 2 is lost too
    assert sync.finished()


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_core_loses_a_silent_worker_only_while_something_waits_on_it(policy):
    core = ServerCore(get_consistency(policy), 2, 5.0, _Log(), now=0.0)
    core.hello(0, 0.0), core.hello(1, 0.0)
    assert core.expire(5.0) == [] and core.lost == []  # both silent (validating): none waits
    assert core.next_deadline() == 10.0  # the deadlines moved on, no busy loop
    core.push(0, 0, 0, "a", 1.0, 6.0)  # async: released again at once; sync: held for worker 1
    out = core.expire(10.0)
    if policy == "sync":
        assert core.lost == [1] and [(r.kind, r.worker) for r in out] == [("error", 0)]
    else:
        assert core.lost == [] and core.next_deadline() == 11.0  # worker 0 computes again
        core.done(0, 12.0)
        assert core.expire(15.0) == [] and core.lost == [1]  # the server waits only on it


def test_max_lead_recomputes_the_bound_from_versions():
    # Worker 0 computes steps 0..3 on versions 0..3 while worker 1 never pushed until the end.
    log = [Update(0, c, c, c) for c in range(4)] + [Update(1, 0, 0, 4)]
    assert max_lead(log) == 3
    assert max_lead([Update(0, 0, 0, 0), Update(1, 0, 0, 0), Update(0, 1, 1, 1),
                     Update(1, 1, 1, 1)]) == 0


# -- wire format ----------------------------------------------------------------------------
def test_pack_unpack_round_trip_with_mixed_dtypes():
    buf = torch.empty(4096, dtype=torch.uint8)
    ts = [torch.randn(3, 4, dtype=torch.float64), torch.arange(5, dtype=torch.int32),
          torch.zeros(0)]
    msg = Message(Op.PUSH, 2, 7, 9, 0.125, 3, ts)
    got = unpack(pack(msg, buf).clone())
    assert (got.op, got.sender, got.step, got.version, got.scalar, got.extra) == (
        Op.PUSH, 2, 7, 9, 0.125, 3)
    for a, b in zip(ts, got.tensors):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ConfigError, match="does not fit"):
        pack(Message(Op.PUSH, 0, tensors=[torch.zeros(10_000)]), buf)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "topk:0.2", "randomk:0.2"])
def test_compressor_context_travels_without_pickle(name):
    c = get_compressor(name)
    template = probe(c, 40, torch.float64, "ps0")[1]
    g = torch.randn(40, dtype=torch.float64)
    c.compress(g, "ps0")  # advance per-step state (random-k's seed changes every call)
    payload, ctx = c.compress(g, "ps0")
    back = decode_ctx(encode_ctx(ctx), template)
    assert torch.equal(c.decompress(payload, back), c.decompress(payload, ctx))


# -- DistributedSession argument checks (at construction, no process group) -------------------
@pytest.mark.parametrize("kw, match", [
    ({"model": None}, "model must be a torch.nn.Module"),
    ({"optimizer": "sgd"}, "optimizer must be an optimizer class"),
    ({"consistency": "stale"}, "needs a bound"),
    ({"compression": "zip"}, "unknown compression"),
    ({"max_steps": -1}, "max_steps must be None or an int"),
    ({"placement": "hash"}, "placement must be one of"),
    ({"compression": "powersgd"}, "needs collective rounds"),
    ({"optimizer_args": {"learning_rate": 0.1}}, "do not fit SGD"),
    ({"timeout": float("inf")}, "at most 1e7"),  # an OverflowError at start() before
])
def test_session_rejects_bad_arguments(kw, match):
    args = {"model": nn.Linear(2, 2), "optimizer": torch.optim.SGD,
            "optimizer_args": {"lr": 0.1}, **kw}
    with pytest.raises(ConfigError, match=match):
        DistributedSession(**args)


def test_session_rejects_optimizer_instance_and_mixed_dtypes():
    m = nn.Linear(2, 2)
    # An (uninitialised) instance: building a real one costs seconds of torch imports.
    with pytest.raises(ConfigError, match="optimizer class"):
        DistributedSession(model=m, optimizer=torch.optim.SGD.__new__(torch.optim.SGD))
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ConfigError, match="one dtype"):
        DistributedSession(model=mixed, optimizer=torch.optim.SGD)
