"""DiLoCoOptimizer and mode="diloco" on real gloo ranks against plain single-process oracles."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.dp.hierarchical import host_groups
from parlay.errors import ConfigError, NonFiniteError
from parlay.local.diloco import OUTER_DEFAULTS, DiLoCoOptimizer, _split
from parlay.strategies import get_strategy
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)
TOL = dict(rtol=1e-10, atol=1e-10)
STEPS, PER = 12, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(),
                         nn.Linear(7, 2)).double()


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(STEPS, world * PER, 5, generator=g, dtype=torch.float64),
            torch.randn(STEPS, world * PER, 2, generator=g, dtype=torch.float64))


INNER = {"sgd": (torch.optim.SGD, {"lr": 0.1}), "adam": (torch.optim.Adam, {"lr": 0.01})}


def _run(inner, H, P, tau, outer_args, hierarchical=False, shard=None, compression=None):
    """Every rank's final weights and shared (outer) weights. With ``shard``, data parallel
    sharded inside each host, local updates across hosts."""
    world, r = parlay.size(), parlay.rank()
    m = _model()
    cls, args = INNER[inner]
    opt, group = cls(m.parameters(), **args), None
    if shard is not None:
        host, group = host_groups()
        opt = parlay.DistributedOptimizer(opt, m.named_parameters(), shard=shard, model=m,
                                          process_group=host)
    dl = DiLoCoOptimizer(opt, m.named_parameters(), sync_every=H, fragments=P, overlap=tau,
                         outer_optimizer_args=outer_args, hierarchical=hierarchical,
                         process_group=group, compression=compression)
    x, y = _data(world)
    sl = slice(r * PER, (r + 1) * PER)
    for s in range(STEPS):
        dl.zero_grad()
        nn.functional.mse_loss(m(x[s][sl]), y[s][sl]).backward()
        dl.step()
    gathered = opt.gathered_parameters if shard else contextlib.nullcontext
    with dl.shared_weights(), gathered():
        shared = [p.detach().clone() for p in m.parameters()]
    with gathered():
        return [p.detach().clone() for p in m.parameters()], shared


def _oracle(world, inner, H, P, tau, outer_args, per=PER):
    """The algorithm written plainly, one process: ``world`` replicas side by side, each
    training on ``per`` rows of every step's batch."""
    models = [_model() for _ in range(world)]
    cls, args = INNER[inner]
    inners = [cls(m.parameters(), **args) for m in models]
    named = list(models[0].named_parameters())
    frags = _split(named, P)
    outer = [[p.detach().clone().requires_grad_() for i in f for p in [named[i][1]]]
             for f in frags]
    outer_opts = [torch.optim.SGD(o, **(outer_args or OUTER_DEFAULTS)) for o in outer]
    flights: dict[int, tuple[list[torch.Tensor], list[list[torch.Tensor]], int]] = {}
    x, y = _data(world * per // PER)

    def params(k, f):
        return [list(models[k].parameters())[i] for i in frags[f]]

    def merge(f):
        avg, sent, _ = flights.pop(f)
        for o, a in zip(outer[f], avg):
            o.grad = a
        outer_opts[f].step()
        with torch.no_grad():
            for k in range(world):
                for j, (p, o) in enumerate(zip(params(k, f), outer[f])):
                    p.copy_(o + (p - sent[k][j]) if tau else o)

    for t in range(1, STEPS + 1):
        for k, (m, opt) in enumerate(zip(models, inners)):
            opt.zero_grad()
            sl = slice(k * per, (k + 1) * per)
            nn.functional.mse_loss(m(x[t - 1][sl]), y[t - 1][sl]).backward()
            opt.step()
        for f in range(len(frags)):
            if f in flights and flights[f][2] <= t:
                merge(f)
            off = f * H // P
            if t > off and (t - off) % H == 0:
                avg = [sum(o.detach() - params(k, f)[j].detach() for k in range(world)) / world
                       for j, o in enumerate(outer[f])]
                sent = [[p.detach().clone() for p in params(k, f)] for k in range(world)]
                flights[f] = (avg, sent, t + tau)
                if tau == 0:
                    merge(f)
    return [[p.detach() for p in m.parameters()] for m in models]


def _plain_sgd(world):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = _data(world)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(m(x[s]), y[s]).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


@pytest.mark.parametrize("world", [2, 4])
def test_one_inner_step_and_a_plain_outer_sgd_is_data_parallel(world):
    ref = _plain_sgd(world)
    for final, shared in run_world(_run, world, "sgd", 1, 1, 0, {"lr": 1.0}):
        for a, b, c in zip(final, shared, ref):
            torch.testing.assert_close(a, c, **TOL)
            torch.testing.assert_close(b, c, **TOL)


@pytest.mark.parametrize("inner, H, P, tau", [("adam", 4, 1, 0), ("adam", 4, 2, 0),
                                               ("sgd", 6, 3, 1), ("adam", 4, 2, 1),
                                               ("sgd", 5, 2, 2)])  # tau < H/P = 2.5
def test_rounds_fragments_and_overlap_follow_the_algorithm(inner, H, P, tau):
    world = 2
    ref = _oracle(world, inner, H, P, tau, None)
    for r, (final, _) in enumerate(run_world(_run, world, inner, H, P, tau, None)):
        for a, b in zip(final, ref[r]):
            torch.testing.assert_close(a, b, **TOL)


def test_host_first_pseudo_gradients_on_2_hosts_x_2():
    ref = _oracle(4, "adam", 4, 2, 1, None)
    for r, (final, _) in enumerate(run_world(_run, 4, "adam", 4, 2, 1, None, True,
                                             local_world_size=2)):
        for a, b in zip(final, ref[r]):
            torch.testing.assert_close(a, b, **TOL)


def _auto_host_first() -> tuple:
    m = _model()
    dl = DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                         sync_every=1, hierarchical=True,
                         compression="auto:candidates=topk:0.05+fp16")
    x, y = _data(parlay.size())
    nn.functional.mse_loss(m(x[0]), y[0]).backward()
    dl.step()
    return dl.compression._eligible, dict(dl.compression.choices)


def test_host_first_auto_pseudo_gradients_keep_to_summable_candidates():
    # a host-first reducer sums payloads: top-k's indices must never go through it
    for eligible, choices in run_world(_auto_host_first, 4, local_world_size=2):
        assert eligible == ["fp16"] and set(choices.values()) == {"fp16"}, choices


def test_host_first_int8_pseudo_gradients_equal_the_flat_ones():
    # int8's scale round and its int8 round both sum host first; the scale may differ by the
    # order of its sum (a last bit), nothing else.
    flat = run_world(_run, 4, "adam", 4, 2, 1, None, False, None, "int8")
    host_first = run_world(_run, 4, "adam", 4, 2, 1, None, True, None, "int8",
                           local_world_size=2)
    for (a_final, a_shared), (b_final, b_shared) in zip(flat, host_first):
        for a, b in zip(a_final + a_shared, b_final + b_shared):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not all(torch.equal(a, b) for a, b in zip(flat[0][1], run_world(
        _run, 4, "adam", 4, 2, 1, None)[0][1]))  # int8 did round


@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_sharded_data_parallel_inside_each_host_and_local_updates_across(shard):
    # 2 hosts x 2 ranks: each host is one replica training on its ranks' rows together.
    ref = _oracle(2, "adam", 4, 1, 1, None, per=2 * PER)
    out = run_world(_run, 4, "adam", 4, 1, 1, None, False, shard, local_world_size=2)
    for r, (final, shared) in enumerate(out):
        for a, b in zip(final, ref[r // 2]):
            torch.testing.assert_close(a, b, **TOL)
        for a, b in zip(shared, out[0][1]):
            torch.testing.assert_close(a, b, **TOL)


def _nan_round():
    m = _model()
    opt = DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                          sync_every=2)
    x, y = _data(parlay.size())
    for s in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(m(x[s][:PER]), y[s][:PER]).backward()
        if s == 1 and parlay.rank() == 1:
            with torch.no_grad():
                next(m.parameters())[0, 0] = float("nan")
        try:
            opt.step()
        except NonFiniteError as e:
            return str(e), opt.fragments[0].outer[0].detach().isfinite().all().item()
    return None, None


def test_a_nonfinite_pseudo_gradient_is_refused_on_every_rank():
    for msg, outer_finite in run_world(_nan_round, 2):
        assert msg is not None and "pseudo-gradient" in msg and outer_finite


@pytest.mark.parametrize("kw, words", [({"sync_every": 0}, "sync_every"),
                                        ({"sync_every": 4, "fragments": 5}, "fragments"),
                                        ({"sync_every": 4, "fragments": 2, "overlap": 2},
                                         "overlap"),
                                        ({"outer_optimizer_args": {"bogus": 1}}, "outer")])
def test_bad_arguments_are_refused(kw, words):
    m = _model()
    with pytest.raises(ConfigError, match=words):
        DiLoCoOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), **kw)


# ------------------------------------------------------------------- the Trainer's mode
def _dataset():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def _build():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2),
                          nn.Linear(16, 2)).double(), nn.CrossEntropyLoss())


def _trainer(ckpt, max_iteration, compression=None):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=4, mode="diloco",
                       compression=compression,
                       strategy_options={"sync_every": 4, "fragments": 2, "overlap": 1},
                       max_iteration=max_iteration, checkpoint_dir=ckpt, checkpoint_every=3,
                       progress=False)
    losses = []
    while not t.should_stop():
        losses.append(t.train_on_batch())
    return losses, [p.detach().clone() for p in t.model.parameters()]


@pytest.mark.parametrize("compression", [None, "int8", "powersgd:1"])  # residuals, 2 rounds
def test_trainer_mode_resumes_bit_for_bit_with_a_fragment_in_flight(tmp_path, compression):
    # Checkpoints every 3 steps: step 3 holds fragment 1's exchange (sent at 2, merged at 3)
    # or fragment 0's (sent at 4... ) in flight at 9 and 10; the cut at 10 resumes one.
    full = run_world(_trainer, 2, None, 14, compression)
    first = run_world(_trainer, 2, str(tmp_path), 10, compression)
    second = run_world(_trainer, 2, str(tmp_path), 14, compression)
    for r in range(2):
        assert first[r][0] + second[r][0] == full[r][0]
        assert all(torch.equal(a, b) for a, b in zip(full[r][1], second[r][1]))
    # training ends with a final sync: every replica holds the same weights
    assert all(torch.equal(a, b) for a, b in zip(full[0][1], full[1][1]))


def _mode(mode, options, shard=None):
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=4, mode=mode, shard=shard,
                       strategy_options=options, max_iteration=10, progress=False,
                       validation_dataset=_dataset(), validation_batch_size=5)
    while not t.should_stop():
        t.train_on_batch()
    acc = t.validate()
    with t.strategy.optimizer.inner.gathered_parameters() if shard else contextlib.nullcontext():
        return [p.detach().clone() for p in t.model.parameters()], acc


def test_trainer_mode_with_one_inner_step_and_plain_outer_sgd_is_the_allreduce_mode():
    # Same learning-rate scaling, warm-up, dropout masks and data order as mode "allreduce".
    dp = run_world(_mode, 2, "allreduce", None)
    dl = run_world(_mode, 2, "diloco", {"sync_every": 1,
                                        "outer_optimizer_args": {"lr": 1.0}})
    for (a, _), (b, _) in zip(dp, dl):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, **TOL)


def _build_bn():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(),
                          nn.Linear(16, 2)).double(), nn.CrossEntropyLoss())


def _batchnorm(mode, options):
    t = parlay.Trainer(_build_bn, _dataset(), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": 0.05}, batch_size=8, mode=mode,
                       strategy_options=options, max_iteration=6, progress=False)
    t.train_to_end()
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_trainer_mode_buffers_follow_rank_0_at_every_sync():
    # BatchNorm's running statistics: at one inner step as the allreduce mode's (every step)
    dp = run_world(_batchnorm, 2, "allreduce", None)
    dl = run_world(_batchnorm, 2, "diloco", {"sync_every": 1,
                                             "outer_optimizer_args": {"lr": 1.0}})
    for a, b in zip(dp, dl):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], **TOL)
    # 6 steps of 4-step rounds in 2 overlapped fragments: the final sync leaves one model
    a, b = run_world(_batchnorm, 2, "diloco", {"sync_every": 4, "fragments": 2, "overlap": 1})
    assert all(torch.equal(a[k], b[k]) for k in a)


def _evaluate_mid_round():
    s = get_strategy("diloco", compression=None, precision="fp32", grad_clip=None,
                     sync_every=4)
    model, loss = _build_bn()
    s.setup(model, loss, torch.optim.SGD, {"lr": 0.05})
    g = torch.Generator().manual_seed(10 + torch.distributed.get_rank())  # each its own data
    for step in range(6):
        s.train_step(torch.randn(8, 6, generator=g, dtype=torch.float64),
                     torch.randint(0, 2, (8,), generator=g))
        if step == 3:  # the sync: the shared model's buffers are rank 0's here
            at_sync = [b.clone() for b in model.buffers()]
    own = [b.clone() for b in model.buffers()]
    with s.evaluating():
        out = s.eval_forward(torch.linspace(-1, 1, 30, dtype=torch.float64).reshape(5, 6))
    restored = all(torch.equal(a, b) for a, b in zip(own, model.buffers()))
    return out, at_sync, own, restored


def test_trainer_mode_evaluates_the_shared_model_mid_round():
    # two steps after a sync each replica's BatchNorm statistics are its own; evaluation
    # uses the outer weights and the buffers as at the sync, the same on every replica
    (out0, sync0, own0, ok0), (out1, sync1, own1, ok1) = run_world(_evaluate_mid_round, 2)
    assert ok0 and ok1 and not torch.equal(own0[0], own1[0])
    assert all(torch.equal(a, b) for a, b in zip(sync0, sync1))
    assert torch.equal(out0, out1)


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_trainer_mode_sharded_inside_hosts_is_the_allreduce_mode_at_one_inner_step(shard):
    # 2 hosts x 2 ranks: data parallel sharded inside each host, local steps across hosts;
    # evaluation (uneven shares: 64 samples in batches of 5) runs on the shared weights.
    opts = {"sync_every": 1, "outer_optimizer_args": {"lr": 1.0}}
    dp = run_world(_mode, 4, "allreduce", None, local_world_size=2)
    dl = run_world(_mode, 4, "diloco", opts, shard, local_world_size=2)
    for (a, acc_a), (b, acc_b) in zip(dp, dl):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, **TOL)
        assert acc_a == pytest.approx(acc_b, abs=1e-9)


def _until(steps, env_ok):
    """Train to ``steps[rank]`` inner steps with a snapshot every step, then stop as a crash
    does (the snapshots stay); the step resumed at and the final weights."""
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=4, mode="diloco",
                       strategy_options={"sync_every": 8}, max_iteration=12, snapshot_every=1,
                       replica_check=0, progress=False)
    start = t.state.step
    while t.state.step < steps[parlay.rank()]:
        t.train_on_batch()
    params = [p.detach().clone() for p in t.model.parameters()]
    if steps[parlay.rank()] == 12:
        t.should_stop()  # the final sync
        params = [p.detach().clone() for p in t.model.parameters()]
    t.close()
    return start, params


@pytest.mark.parametrize("stops", [(7, 3), (10, 8)])
def test_replicas_apart_in_a_round_each_resume_their_own_newest_snapshot(tmp_path, stops):
    # Replicas meet only at syncs (every 8 steps): one crashes at step 3 while the other has
    # gone on to step 7, or right after the sync of step 8 while the other reached 10. Each
    # resumes its own newest snapshot (no step both hold is needed), and the run ends bit for
    # bit as an uninterrupted one.
    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "apart"}
    run_world(_until, 2, dict(enumerate(stops)), True, env=env, timeout=90)
    second = run_world(_until, 2, {0: 12, 1: 12}, True, env=env, timeout=90)
    env["PARLAY_RUN_ID"] = "whole"
    full = run_world(_until, 2, {0: 12, 1: 12}, True, env=env, timeout=90)
    assert [start for start, _ in second] == list(stops)
    for (_, a), (_, b) in zip(second, full):
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def _stop_at(steps, max_iteration, validate_at=None):
    """Train to ``steps[rank]`` inner steps (snapshots every step), validating after step
    ``validate_at``, then stop as a crash does; the step resumed at and the final weights."""
    t = parlay.Trainer(_build, _dataset(), optimizer=torch.optim.Adam,
                       optimizer_args={"lr": 1e-2}, batch_size=4, mode="diloco",
                       strategy_options={"sync_every": 8}, max_iteration=max_iteration,
                       snapshot_every=1, replica_check=0, validation_dataset=_dataset(),
                       progress=False)
    start = t.state.step
    while not t.should_stop() and t.state.step < steps[parlay.rank()]:
        t.train_on_batch()
        if t.state.step == validate_at:
            t.validate()
    params = [p.detach().clone() for p in t.model.parameters()]
    t.close()
    return start, params


@pytest.mark.parametrize("first, lost, starts", [
    # one replica resumes at the last step (12), the other a step behind: the first goes
    # straight to the final sync, the second takes its step; they must meet, not deadlock
    (({0: 12, 1: 11}, 20), False, [12, 11]),
    # rank 0 stops right after validating at step 5; rank 1 snapshots step 5 again after that
    # meeting and waits for rank 0 in vain. Both still hold a state of step 5 from before the
    # validation: the restart resumes there, not from the beginning
    (({0: 5, 1: 6}, 12, 5), True, [5, 5]),
])
def test_replicas_stopped_around_a_meeting_resume_at_most_a_step_back(tmp_path, first, lost,
                                                                       starts):
    env = {"PARLAY_SNAPSHOT_DIR": str(tmp_path / "shm"), "PARLAY_RUN_ID": "cut",
           "PARLAY_TIMEOUT": "10"}
    with pytest.raises(Exception) if lost else contextlib.nullcontext():
        run_world(_stop_at, 2, *first, env=env, timeout=90)
    second = run_world(_stop_at, 2, {0: 12, 1: 12}, 12, env=env, timeout=90)
    env["PARLAY_RUN_ID"] = "whole"
    full = run_world(_stop_at, 2, {0: 12, 1: 12}, 12, env=env, timeout=90)
    assert [start for start, _ in second] == starts
    for (_, a), (_, b) in zip(second, full):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
