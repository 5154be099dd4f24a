"""Parameter-server mode on real gloo ranks: sync equals single-process training, sharding over
two servers equals one server, compressed pushes, the "ps" strategy, and a clean shutdown."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlay
from parlay.compress import Compressor, available, get_compressor
from parlay.errors import ConfigError
from parlay.ps import DistributedSession, ShardPlan
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

# float64: PS sync and the oracle differ only in summation order, so 1e-10 states equality.
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, PER_WORKER = 4, 3
PS1 = {"PARLAY_NUM_PS": "1"}
PS2 = {"PARLAY_NUM_PS": "2"}
OPTS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": 0.01}),
        "adafactor": (torch.optim.Adafactor, {"lr": 0.01})}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _data(workers: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, workers * PER_WORKER, 5, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, workers * PER_WORKER, 3, generator=g, dtype=torch.float64)
    return x, y


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _reference(opt: str, workers: int, compression=None):
    """Single process on the concatenated batch. With ``compression``, each worker's gradient
    goes through its own compressor instance (encode, local extra rounds, decode) and the
    decoded gradients are averaged: exactly what the server applies."""
    model = _model()
    cls, args = OPTS[opt]
    o = cls(model.parameters(), **args)
    x, y = _data(workers)
    coders = [get_compressor(compression) for _ in range(workers)] if compression else None
    for s in range(STEPS):
        o.zero_grad()
        if coders is None:
            _mse(model(x[s]), y[s]).backward()
            o.step()
            continue
        acc = [torch.zeros_like(p) for p in model.parameters()]
        for w, c in enumerate(coders):
            sl = slice(w * PER_WORKER, (w + 1) * PER_WORKER)
            g = torch.autograd.grad(_mse(model(x[s][sl]), y[s][sl]), list(model.parameters()))
            payload, ctx = c.compress(torch.cat([t.reshape(-1) for t in g]), "ps0")
            while (nxt := c.next_round(payload, ctx)) is not None:
                payload = nxt
            flat = c.decompress(payload, ctx)
            off = 0
            for a, p in zip(acc, model.parameters()):
                a += flat[off: off + p.numel()].view_as(p)
                off += p.numel()
        for a, p in zip(acc, model.parameters()):
            p.grad = a / workers
        o.step()
    return [p.detach() for p in model.parameters()]


def _ps_train(opt: str, consistency: str = "sync", compression=None, split_bytes=8 * 2**20):
    model = _model()
    cls, args = OPTS[opt]
    groups_before = len(dist.distributed_c10d._world.pg_map)
    with DistributedSession(task_spec=parlay.TaskSpec.from_env(), model=model, optimizer=cls,
                            optimizer_args=args, consistency=consistency,
                            compression=compression, split_bytes=split_bytes) as sess:
        x, y = _data(sess.num_workers)
        t = 0
        while not sess.should_stop() and t < STEPS:
            w = sess.worker_index
            sl = slice(w * PER_WORKER, (w + 1) * PER_WORKER)
            sess.train_step((x[t][sl], y[t][sl]), _mse)
            t += 1
    leaked = len(dist.distributed_c10d._world.pg_map) - groups_before
    mine = ([(p.name, p.start, p.length) for p in sess.plan.pieces(parlay.rank())]
            if not sess.is_worker else None)
    return {"params": [p.detach().clone() for p in model.parameters()], "leaked": leaked,
            "role": parlay.role(), "pieces": mine, "hist": sess.staleness_histogram(),
            "version": sess.global_step}


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_sync_equals_single_process_on_concatenated_batch(opt):
    out = run_world(_ps_train, 3, opt, env=PS1)  # 1 PS + 2 workers
    ref = _reference(opt, 2)
    for r in out:  # the server's copy and both workers' copies
        for p, q in zip(r["params"], ref):
            torch.testing.assert_close(p, q, **TOL)
        assert r["leaked"] == 0 and r["version"] == STEPS
    assert out[0]["hist"] == {0: 2 * STEPS}  # sync: every gradient is fresh


def test_two_servers_split_as_planned_and_equal_one_server():
    # 3 workers, 2 servers; split_bytes=256 splits the 16x5 weight (640 B) over both servers.
    out = run_world(_ps_train, 5, "adam", "sync", None, 256, env=PS2)
    plan = ShardPlan.from_module(_model(), 2, split_bytes=256)
    for s in (0, 1):
        assert out[s]["pieces"] == [(p.name, p.start, p.length) for p in plan.pieces(s)]
    assert sorted(plan.servers_of("0.weight")) == [0, 1]
    one = run_world(_ps_train, 4, "adam", env=PS1)  # 1 PS + 3 workers
    for r in out[2:]:
        for p, q in zip(r["params"], one[1]["params"]):
            torch.testing.assert_close(p, q, **TOL)
    for p, q in zip(one[1]["params"], _reference("adam", 3)):
        torch.testing.assert_close(p, q, **TOL)


class _Half(Compressor):
    """Plain fp16 cast, defined here: a compressor from outside the registry works too."""

    name = "half-test"

    def compress(self, flat, key):
        return [flat.to(torch.float16)], flat.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)


_P2P = [n for n in available() if getattr(get_compressor(n), "point_to_point", True)]


@pytest.mark.parametrize("name", [*_P2P, "topk:0.3", "randomk:0.3", "half"])
def test_compressed_pushes_equal_oracle_on_decoded_gradients(name):
    # Every point-to-point compressor of the registry (a newcomer inherits this test): the
    # server must apply exactly the mean of what each worker's compressor decodes to, including
    # contexts that change every step (random-k's seed, fp16's scale).
    comp = _Half() if name == "half" else name
    out = run_world(_ps_train, 3, "sgd", "sync", comp, env=PS1)
    ref = _reference("sgd", 2, compression=_Half if name == "half" else name)
    for p, q in zip(out[1]["params"], ref):
        torch.testing.assert_close(p, q, **TOL)


def _strategy_run():
    from parlay.strategies import get_strategy

    s = get_strategy("ps", compression=None, precision="fp32", grad_clip=None)
    assert s.dp_size == parlay.size() - 1
    model = _model()
    s.setup(model, _mse, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    x, y = _data(s.dp_size)
    losses = []
    if not s.serve_until_done():
        assert s.consumes_data and s.reports_loss
        for t in range(STEPS):
            sl = slice(s.dp_rank * PER_WORKER, (s.dp_rank + 1) * PER_WORKER)
            s.set_lr_factor(1.0)
            losses.append(s.train_step(x[t][sl], y[t][sl]).loss)
        assert s.eval_forward(x[0]).shape == (len(x[0]), 3)
        assert comm.group_size(s.dp_group) == s.dp_size
        s.finish()
    else:
        assert not s.consumes_data and not s.reports_loss and s.eval_forward(x[0]) is None
        s.finish()
    return [p.detach().clone() for p in model.parameters()], losses


from parlay import comm  # noqa: E402  (used inside _strategy_run on the ranks)


def test_ps_strategy_drives_like_the_trainer():
    out = run_world(_strategy_run, 3, env=PS1)
    ref = _reference("sgd", 2)
    for params, _ in out:
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, **TOL)
    assert len(out[1][1]) == STEPS and all(math.isfinite(v) for v in out[1][1])


def _no_ps():
    try:
        with DistributedSession(model=_model(), optimizer=torch.optim.SGD,
                                optimizer_args={"lr": 0.1}):
            pass
    except ConfigError as e:
        return str(e)
    return "no error"


def test_world_without_parameter_servers_is_a_config_error():
    for msg in run_world(_no_ps, 2):
        assert "at least one parameter-server rank" in msg and "--ps 1" in msg


def _by_hand_limits(case):
    model = _model()
    with DistributedSession(model=model, optimizer=torch.optim.SGD, optimizer_args={"lr": 0.1},
                            max_steps=2) as sess:
        x, y = _data(sess.num_workers)
        try:
            for t in range(3):
                if sess.is_ps:
                    sess.serve()
                    break
                xs = x[t].clone()
                if case == "nan" and sess.worker_index == 1 and t == 1:
                    xs[0, 0] = float("nan")
                sess.train_step((xs, y[t]), _mse)  # the third is past max_steps
        except (parlay.NonFiniteError, ConfigError) as e:
            return type(e).__name__, str(e)
    return None, None


def test_a_session_by_hand_refuses_nonfinite_pushes_and_steps_past_max_steps():
    out = run_world(_by_hand_limits, 3, "past", env=PS1)
    assert all(kind == "ConfigError" and "max_steps=2" in msg for kind, msg in out[1:])
    out = run_world(_by_hand_limits, 3, "nan", env=PS1, return_exceptions=True)
    assert out[2][0] == "NonFiniteError"  # before its NaN reached the servers


def test_max_steps_counts_the_newest_version_any_server_reported():
    # servers apply pushes in different orders, so a worker's replies report versions of
    # different moments: the smallest lags, and stopping on it let pushes land past the bound
    from types import SimpleNamespace

    sess = DistributedSession(model=nn.Linear(2, 1), optimizer=torch.optim.SGD,
                              optimizer_args={"lr": 0.1}, consistency="async", max_steps=10)
    sess.worker = SimpleNamespace(versions=[9, 10])
    assert sess.at_max_steps()
    sess.worker = SimpleNamespace(versions=[9, 9])
    assert not sess.at_max_steps()


def test_a_shape_dependent_optimizer_keeps_whole_tensors_by_default():
    # The balanced placement cut the 16x5 weight into 1-D pieces over the two servers:
    # Adafactor's factored second moment became an unfactored one (7.9e-3 off).
    ref = _reference("adafactor", 2)
    out = run_world(_ps_train, 4, "adafactor", env=PS2)
    for r in out[2:]:
        for p, q in zip(r["params"], ref):
            torch.testing.assert_close(p, q, **TOL)


def _embedding(sparse):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Flatten(),
                         nn.Linear(8, 3)).double()


def _ids():
    return torch.arange(2 * STEPS * PER_WORKER).remainder(10).reshape(STEPS, PER_WORKER, 2)


def _thawed_or_sparse(case):
    model = _model() if case == "thawed" else _embedding(sparse=True)
    if case == "thawed":
        model[0].requires_grad_(False)
    with DistributedSession(model=model, optimizer=torch.optim.SGD,
                            optimizer_args={"lr": 0.1}) as sess:
        if sess.is_ps:
            sess.serve()
            return None
        x, y = _data(sess.num_workers)
        ids = _ids()
        try:
            for t in range(STEPS):
                if case == "thawed" and t == 2:
                    model[0].requires_grad_(True)
                xs = x[t][:PER_WORKER] if case == "thawed" else ids[t]
                sess.train_step((xs, y[t][:PER_WORKER]), _mse)
        except ConfigError as e:
            return str(e)
    return [p.detach().clone() for p in model.parameters()]


def _frozen_steps(model, t):
    """Layer 0 trains at step 0, is frozen at steps 1 and 2, and trains again from step 3."""
    model[0].requires_grad_(t not in (1, 2))


def _freeze_midway(consistency):
    model = _model()
    with DistributedSession(model=model, optimizer=torch.optim.Adam, consistency=consistency,
                            optimizer_args={"lr": 0.01, "weight_decay": 0.1}) as sess:
        if sess.is_ps:
            sess.serve()
            return None
        x, y = _data(sess.num_workers)
        sl = slice(sess.worker_index * PER_WORKER, (sess.worker_index + 1) * PER_WORKER)
        for t in range(STEPS):
            _frozen_steps(model, t)
            sess.train_step((x[t][sl], y[t][sl]), _mse)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world,consistency,env", [
    (3, "sync", {**PS1, "PARLAY_PS_CHUNK_BYTES": "64"}),  # chunked pushes
    (4, "sync", {**PS2, "PARLAY_PS_CHUNK_BYTES": "0"}),  # whole pushes, two servers
    (2, "async", PS1), (2, "stale:1", PS1)])  # one worker: async equals one process too
def test_a_layer_frozen_midway_is_left_alone_as_by_torch(world, consistency, env):
    # The workers pushed zeros for the frozen layer and the servers stepped it: Adam's moments
    # and weight decay moved it, and its step count ran on into the steps after the thaw.
    out = run_world(_freeze_midway, world, consistency, env=env)
    workers = world - int(env["PARLAY_NUM_PS"])
    ref = _model()
    o = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.1)
    x, y = _data(workers)
    for t in range(STEPS):
        _frozen_steps(ref, t)
        o.zero_grad()
        _mse(ref(x[t]), y[t]).backward()
        o.step()
    for p, q in zip(out[-1], ref.parameters()):
        torch.testing.assert_close(p, q.detach(), **TOL)


def test_a_layer_unfrozen_after_the_start_is_refused_and_sparse_gradients_train():
    out = run_world(_thawed_or_sparse, 2, "thawed", env=PS1, return_exceptions=True)
    assert "0.weight, 0.bias were frozen when the session started" in out[1]
    # An Embedding(sparse=True) crashed the push (reshape of a sparse tensor): one worker
    # equals one process training the dense twin.
    ref = _embedding(sparse=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _, y = _data(1)
    for t in range(STEPS):
        opt.zero_grad()
        _mse(ref(_ids()[t]), y[t][:PER_WORKER]).backward()
        opt.step()
    for p, q in zip(run_world(_thawed_or_sparse, 2, "sparse", env=PS1)[1], ref.parameters()):
        torch.testing.assert_close(p, q.detach(), **TOL)
