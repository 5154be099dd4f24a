"""Non-finite policy on real gloo ranks: one NaN input on one rank at step 3.

``nonfinite="raise"`` must stop every rank before the update with an error naming the step,
the rank and the first parameter, leaving the weights and the last checkpoint intact;
``"skip"`` must drop that step identically on every rank, so the weights equal a run (computed
here by hand) that took every other step.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import parlay
from parlay.checkpoint import CheckpointManager, load
from parlay.data.sampler import ShardedSampler
from parlay.errors import CheckpointError, NonFiniteError
from parlay.testing import run_world

pytestmark = pytest.mark.timeout(120)

N, BATCH, STEPS, BAD_STEP, BAD_RANK, LR = 40, 4, 5, 3, 1, 0.1   # 5 steps per epoch on 2 ranks


def _indices(rank: int, world: int = 2, shuffle: bool = True) -> list[int]:
    return ShardedSampler(N, world, rank, shuffle=shuffle, seed=0).epoch_indices()


def _dataset(world: int = 2, shuffle: bool = True) -> TensorDataset:
    """Finite data except one sample of BAD_RANK's batch at BAD_STEP."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 6, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    x[_indices(BAD_RANK % world, world, shuffle)[(BAD_STEP - 1) * BATCH], 2] = math.nan
    return TensorDataset(x, y)


def _build():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), nn.CrossEntropyLoss()


def _trainer(ckpt, nonfinite, **kw):
    return parlay.Trainer(_build, _dataset(), optimizer=torch.optim.SGD,
                          optimizer_args={"lr": LR}, batch_size=BATCH, max_iteration=STEPS,
                          scaling_learning_rate=False, checkpoint_dir=ckpt, checkpoint_every=1,
                          keep_last=2, nonfinite=nonfinite, progress=False, **kw)


def _train(t):
    """Train to the end; the NonFiniteError that stopped it, if one did."""
    try:
        while not t.should_stop():
            t.train_on_batch()
    except NonFiniteError as e:
        return e
    return None


FP16 = {"precision": "fp16", "strategy_options": {"loss_scale": 1024.0}}


def _raise_run(ckpt, precision):
    t = _trainer(ckpt, "raise", **(FP16 if precision == "fp16" else {}))
    err = _train(t)
    return err, t.state.step, [p.detach().clone() for p in t.model.parameters()]


# fp16: a NaN loss is bad data, not a loss-scale overflow (which fp16 skips under any policy)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_raise_stops_every_rank_before_the_update(tmp_path, precision):
    out = run_world(_raise_run, 2, str(tmp_path), precision)
    saved = load(tmp_path / f"ckpt-{BAD_STEP - 1:010d}.rank0.pt")["strategy"]["model"]
    for err, step, params in out:
        assert isinstance(err, NonFiniteError), "both ranks raise, not only the NaN one"
        assert (err.step, err.rank, err.parameter) == (BAD_STEP, BAD_RANK, "0.weight")
        assert f"step {BAD_STEP}" in str(err) and f"rank {BAD_RANK}" in str(err)
        assert "'0.weight'" in str(err) and "not applied" in str(err)
        assert step == BAD_STEP - 1
        for p, q in zip(params, saved.values()):
            assert torch.isfinite(p).all()
            assert torch.equal(p, q), "the weights are those of the last good step"
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert names == [f"ckpt-{s:010d}.rank{r}.pt" for s in (BAD_STEP - 2, BAD_STEP - 1)
                     for r in range(2)], "the last good checkpoints are kept, none added"


def _skip_run(ckpt, compression, precision="fp32"):
    t = _trainer(ckpt, "skip", compression=compression, **(FP16 if precision == "fp16" else {}))
    init = [p.detach().clone() for p in t.model.parameters()]
    skipped = []
    while not t.should_stop():
        t.train_on_batch()
        skipped.append(t.last_step.skipped)
    residuals = t.strategy.optimizer.compression.state_dict()
    if precision == "fp16":  # the NaN was the data's, not an overflow: the scale stays
        assert t.strategy.scaler.scale == 1024.0
    return init, [p.detach().clone() for p in t.model.parameters()], skipped, t.skipped_steps, \
        residuals


def _by_hand(init):
    """Data-parallel SGD over both ranks' batches, without the update of BAD_STEP."""
    model, loss_fn = _build()
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(v)
    ds = _dataset()
    for step in range(1, STEPS + 1):
        grads = []
        for r in range(2):
            idx = _indices(r)[(step - 1) * BATCH: step * BATCH]
            model.zero_grad()
            loss_fn(model(ds.tensors[0][idx]), ds.tensors[1][idx]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        if step == BAD_STEP:
            continue
        with torch.no_grad():
            for p, g0, g1 in zip(model.parameters(), *grads):
                p -= LR * (g0 + g1) / 2
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("compression, precision", [(None, "fp32"), ("topk:0.5", "fp32"),
                                                    (None, "fp16")])
def test_skip_drops_the_step_on_every_rank(tmp_path, compression, precision):
    if compression is not None and compression.split(":")[0] not in parlay.compress.available():
        pytest.skip(f"compressor {compression} not registered")
    out = run_world(_skip_run, 2, str(tmp_path), compression, precision)
    (init, final0, skipped, count, res), (_, final1, _, count1, _) = out
    assert skipped == [s == BAD_STEP for s in range(1, STEPS + 1)]
    assert count == count1 == 1
    for p, q in zip(final0, final1):
        assert torch.isfinite(p).all() and torch.equal(p, q), "replicas stay identical"
    assert all(torch.isfinite(v).all() for v in _tensors(res)), "residuals were not polluted"
    if compression is None and precision == "fp32":
        for p, q in zip(final0, _by_hand(init)):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["skipped_steps"]) for e in events if e["event"] == "skipped_step"] \
        == [(BAD_STEP, 1)]
    assert len(list(tmp_path.glob("ckpt-*.rank0.pt"))) == 2


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _hybrid(nonfinite, precision="fp32"):
    t = parlay.Trainer(_build_seq, _dataset(world=1, shuffle=False), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR}, batch_size=BATCH, max_iteration=STEPS,
                       mode="hybrid", shuffle=False, progress=False, nonfinite=nonfinite,
                       precision=precision, strategy_options={
                           "pp": 2, "chunks": 2,
                           **({"loss_scale": 1024.0} if precision == "fp16" else {})})
    err = None
    try:
        while not t.should_stop():
            t.train_on_batch()
    except NonFiniteError as e:
        err = e
    return err, all(bool(torch.isfinite(p).all()) for p in t.model.parameters()), \
        t.state.step, t.skipped_steps


def _build_seq():
    return (nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2)), nn.CrossEntropyLoss())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_hybrid_raises_or_skips_on_every_stage(precision):
    out = run_world(_hybrid, 2, "raise", precision)
    for err, finite, step, _ in out:
        assert isinstance(err, NonFiniteError) and finite and step == BAD_STEP - 1
        # One replica of two stages: the loss is computed (and goes NaN) on the last stage.
        assert err.step == BAD_STEP and err.rank == 1
    assert out[0][0].parameter == "0.weight"
    for err, finite, step, skipped in run_world(_hybrid, 2, "skip", precision):
        assert err is None and finite and (step, skipped) == (STEPS, 1)


def test_a_non_finite_state_is_never_written(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=1, rank=0)
    m.save(1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"step 2: state\['w'\] holds a NaN"):
        m.save(2, {"w": torch.tensor([1.0, math.nan])})
    with pytest.raises(CheckpointError, match="infinity"):
        m.save(3, {"opt": [torch.tensor([math.inf])]})
    mask = torch.tensor([0.0, -math.inf])    # e.g. an attention-mask buffer
    m.save(4, {"mask": mask, "ids": torch.tensor([1, 2])}, allow_inf=lambda t: t is mask)
    assert m.steps() == [4], "only written checkpoints count; the newest good one stays"


def _ps_raise():
    t = parlay.Trainer(_build, _dataset(world=1), optimizer=torch.optim.SGD,
                       optimizer_args={"lr": LR}, batch_size=BATCH, max_iteration=STEPS,
                       mode="ps", strategy_options={"consistency": "async", "timeout": 20},
                       progress=False)
    try:
        while not t.should_stop():
            t.train_on_batch()
    except NonFiniteError as e:
        t.strategy.session.worker.fail()        # tell the server, as a dying worker does
        return e
    server = t.strategy.session.server
    return [v.clone() for v in server.params] if server is not None else None


def test_ps_worker_raises_before_pushing():
    err, = [o for o in run_world(_ps_raise, 2, env={"PARLAY_NUM_PS": "1"}, return_exceptions=True)
            if isinstance(o, NonFiniteError)]
    assert (err.step, err.rank, err.parameter) == (BAD_STEP, 1, "0.weight")


def _sharded_run(ckpt, shard, nonfinite):
    t = _trainer(ckpt, nonfinite, shard=shard)
    opt = t.strategy.optimizer
    with opt.gathered_parameters():
        init = [p.detach().clone() for p in t.model.parameters()]
    err = _train(t)
    with opt.gathered_parameters():
        return init, [p.detach().clone() for p in t.model.parameters()], t.skipped_steps, err


@pytest.mark.parametrize("shard", ["gradients", "parameters"])
def test_sharded_ranks_agree_on_a_nonfinite_step(tmp_path, shard):
    # The NaN reaches only the chunks its rank owns after the reduce-scatter: the ranks still
    # agree to skip (or to stop) together.
    out = run_world(_sharded_run, 2, str(tmp_path / "skip"), shard, "skip")
    (init, final0, count0, _), (_, final1, count1, _) = out
    assert count0 == count1 == 1
    for p, q, r in zip(final0, final1, _by_hand(init)):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    for _, _, _, err in run_world(_sharded_run, 2, str(tmp_path / "raise"), shard, "raise"):
        assert isinstance(err, NonFiniteError) and (err.step, err.rank) == (BAD_STEP, BAD_RANK)
        assert "chunk of" not in str(err)
        assert "non-finite gradient is '" in str(err) or "no gradient on this rank" in str(err)


def _build_inf_bias():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    m[4].bias.register_hook(lambda g: g * math.inf)  # only 4.bias overflows
    return m, nn.CrossEntropyLoss()


def _name_of_the_overflow(shard):
    x = torch.randn(32, 6)
    t = parlay.Trainer(_build_inf_bias, TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4,
                       shard=shard, max_iteration=2, progress=False)
    e = _train(t)
    chunks = t.strategy.optimizer.named_local_gradients()
    return str(e), [(n, g.numel()) for n, g in chunks]


@pytest.mark.parametrize("shard", [None, "gradients", "parameters"])
def test_the_error_names_the_very_parameter_whose_gradient_overflowed(shard):
    out = run_world(_name_of_the_overflow, 2, shard)
    named = [msg for msg, _ in out
             if "the first parameter with a non-finite gradient is '4.bias'" in msg]
    # Sharded, each rank checks its own chunks: the rank holding 4.bias's elements names it.
    assert len(named) == (1 if shard else 2), [msg for msg, _ in out]
    if shard:  # each rank's chunks, cut by parameter: together every element exactly once
        sizes: dict[str, int] = {}
        for _, parts in out:
            for name, n in parts:
                sizes[name] = sizes.get(name, 0) + n
        full = dict((n, p.numel()) for n, p in _build_inf_bias()[0].named_parameters())
        assert sizes == full
